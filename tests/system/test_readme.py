#!/usr/bin/env python3
"""The README and docs/ as written: every block marked `<!-- readme-test -->` (a shell block) or
`<!-- readme-test: NAME -->` (a file, written as NAME; NAME `output`: a block of "$ COMMAND" and
the output the page shows, which COMMAND must print exactly) runs in order (README.md, then the
pages of docs/ in the order docs/README.md lists them; a page it does not list fails the test)
in a fresh temporary
directory that holds `build` (the build under test), `client` and `tools` (the sources), with
`/tmp/` in the blocks turned into that directory's own and HOME set to it (`~/venv`). A block
fails the test when it exits non-zero or outlives its deadline; what each block must print is
checked below (EXPECT), and a marked block this test does not know fails it too (a new block
gets its check here). Processes a block leaves behind are killed with its session. Then
`cmake --install BUILD --prefix P`: this test's interpreter (the suite's venv of Debian's
python3) with P's dist-packages on its path imports shard, which loads P's libshard without
SHARD_LIBRARY, and trains against P's shardd.

Blocks that need PyTorch run where the interpreter running this test has torch 2.x (the suite's
venv, tools/torch-venv.sh): the README's `pip install torch` into ~/venv is then already
satisfied (~/venv is made first, with a .pth naming that venv's site-packages, so the test does
not download 5 GiB again; every other command of the block runs as written). Without it the test
runs the others and then exits 77 (skipped, saying why).

usage: test_readme.py SOURCE_DIR BUILD_DIR
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SRC, BUILD = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
counts = {"passed": 0, "failed": 0}


def check(cond, what):
    counts["passed" if cond else "failed"] += 1
    if not cond:
        print(f"FAIL: {what}", flush=True)


def blocks(text):
    """[(name or None, language, body)] of the marked blocks, in order"""
    out = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = re.fullmatch(r"<!-- readme-test(?::\s*(\S+))?\s*-->", lines[i].strip())
        i += 1
        if not m:
            continue
        while i < len(lines) and not lines[i].strip():
            i += 1
        fence = re.fullmatch(r"```(\w*)", lines[i].strip()) if i < len(lines) else None
        if fence is None:
            out.append((m.group(1), None, None))  # a marker without a block: reported
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        out.append((m.group(1), fence.group(1), "\n".join(lines[i + 1:j]) + "\n"))
        i = j + 1
    return out


# what each shell block prints, by a phrase of its first line: (regexes all found, needs torch)
EXPECT = {
    "build/daemon/shardd --runtime-dir /tmp/shardd": ([r"demo .*finished", r"fetch"], False),
    "tools/local-cluster.sh start --nodes 2 --ranks-per-node 2 --dir /tmp/c   # loopback":
        ([r"cluster of 2 nodes x 2 ranks up", r"demo .*finished"], False),
    "tools/local-cluster.sh start --nodes 2 --dir /tmp/i --independent": ([
        r"2 independent daemons up",
        r"job met: world 4 = 2 nodes x 2 ranks on daemons [0-9a-f]{8},[0-9a-f]{8} "
        r"\(this one its node 1\)"], False),
    "tools/local-cluster.sh start --nodes 3 --open": ([
        r"open cluster of 3 nodes up",
        r"job anywhere: world 4 = 2 nodes x 2 ranks on cluster nodes 2,1 \(this one its node 0\)"],
        False),
    "tools/local-cluster.sh start --nodes 2 --ranks-per-node 2 --dir /tmp/h": ([
        r"job hang: 2 dump\(s\) of 2 node\(s\)",
        r"rank 3 \(node 1\) never called \w+ #\d+",
        r"(?m)^  node 0 \(failed.*\): waiting in$"], False),
    "build/daemon/shardd --runtime-dir /tmp/m --metrics-listen": ([
        r'(?m)^shardd_job_steps_total\{job="demo"\} 5$',
        r'(?m)^shardd_job_operation_seconds_count\{job="demo",op="step"\} 5$'], False),
    "/usr/bin/python3 -m venv": ([r"(?m)^2\.\d+", r"libshard\.so\.0"], True),
    "build/daemon/shardd --runtime-dir /tmp/t": (
        [r"torchrun on one node equals the two-node run: True"], True),
    "tools/local-cluster.sh start --nodes 2 --ranks-per-node 2 --dir /tmp/c\n":
        ([r"step 12: val loss", r"resumed run equals the first: True",
          r"'blocks\.0\.fc\.bias'", r"gpt .*finished"], True),
}


def expectation(body):
    for key, (want, torch_needed) in EXPECT.items():
        if body.startswith(key):
            return want, torch_needed
    return None, False


def run_block(work, n, body, env):
    script = body.replace("/tmp/", work + "/")
    try:
        p = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        try:
            out, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            out += "\n(timed out after 300 s)"
        return p.returncode, out
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # whatever the block left running
        except (ProcessLookupError, PermissionError, UnboundLocalError):
            pass


TINY = """
import os, torch, shard, shard.torch
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
shard.torch.wrap(m, socket=os.environ["SOCK"], job="installed", rank=0, world=1,
                 optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
for _ in range(2):
    m(torch.ones(2, 4)).sum().backward()
    shard.torch.step(m)
print("library", shard.library_path)
"""


def installed(work, env, have_torch):
    """cmake --install --prefix P: P's python3.X/dist-packages imports shard, which loads P's
    libshard (no SHARD_LIBRARY), and trains against P's shardd"""
    prefix = os.path.join(work, "prefix")
    r = subprocess.run(["cmake", "--install", BUILD, "--prefix", prefix], capture_output=True,
                       text=True, timeout=120)
    check(r.returncode == 0, f"cmake --install --prefix: {r.stdout}{r.stderr}")
    pydirs = [os.path.join(prefix, "lib", d, "dist-packages")
              for d in os.listdir(os.path.join(prefix, "lib")) if d.startswith("python3")]
    check(len(pydirs) == 1, f"the package is under {prefix}/lib/python3.X: {pydirs}")
    if not pydirs or not have_torch:
        return
    rdir = os.path.join(work, "inst-run")
    daemon = subprocess.Popen([os.path.join(prefix, "sbin", "shardd"), "--runtime-dir", rdir,
                               "--log-level", "warn"])
    try:
        sock = os.path.join(rdir, "shardd.sock")
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        e = dict(env, PYTHONPATH=pydirs[0], SOCK=sock)
        r = subprocess.run([sys.executable, "-c", TINY], cwd=work, env=e,
                           capture_output=True, text=True, timeout=120)
        check(r.returncode == 0 and f"library {prefix}/lib" in r.stdout,
              f"the installed package loads {prefix}/lib's libshard and trains: {r.stdout}"
              f"{r.stderr}")
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


def torch_site():
    """the site-packages of this interpreter when it imports torch 2.x (the suite's venv), else
    None"""
    try:
        import torch
    except ImportError:
        return None
    if int(torch.__version__.split(".")[0]) < 2 or sys.prefix == sys.base_prefix:
        return None
    import sysconfig
    return sysconfig.get_paths()["purelib"]


def seed_venv(home, site):
    """HOME/venv as the README makes it (Debian's python3 -m venv), with a .pth naming site, the
    suite's venv's site-packages: the README's pip install torch finds torch there"""
    venv = os.path.join(home, "venv")
    subprocess.run(["/usr/bin/python3", "-m", "venv", venv], check=True, capture_output=True,
                   timeout=120)
    r = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                        "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       capture_output=True, text=True, check=True)
    with open(os.path.join(r.stdout.strip(), "shardd-test-torch.pth"), "w") as f:
        f.write(site + "\n")
    # the launcher pip would have put beside it
    torchrun = os.path.join(venv, "bin", "torchrun")
    with open(torchrun, "w") as f:
        f.write(f"#!{venv}/bin/python\nimport sys\nfrom torch.distributed.run import main\n"
                "sys.exit(main())\n")
    os.chmod(torchrun, 0o755)


def pages():
    """README.md, then docs/'s pages in the order docs/README.md lists them ("- `page.md`: ...")"""
    with open(os.path.join(SRC, "docs", "README.md"), encoding="utf-8") as f:
        listed = re.findall(r"^- `([\w.-]+\.md)`", f.read(), re.M)
    there = sorted(n for n in os.listdir(os.path.join(SRC, "docs"))
                   if n.endswith(".md") and n != "README.md")
    check(sorted(listed) == there, f"docs/README.md lists the pages of docs/ once each: it lists "
          f"{listed}, docs/ has {there}")
    return ["README.md"] + [os.path.join("docs", n) for n in listed]


def main():
    found = []
    for page in pages():
        with open(os.path.join(SRC, page), encoding="utf-8") as f:
            found += blocks(f.read())
    check(len(found) >= 5, f"the README marks its runnable blocks: {len(found)} found")
    site = torch_site()
    have_torch = site is not None
    work = tempfile.mkdtemp(prefix="shardd-readme-")
    if have_torch:
        seed_venv(work, site)
    for name, target in (("build", BUILD), ("client", os.path.join(SRC, "client")),
                         ("tools", os.path.join(SRC, "tools"))):
        os.symlink(target, os.path.join(work, name))
    env = {k: v for k, v in os.environ.items()
           if k not in ("SHARD_LIBRARY", "SHARD_SOCKET", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HOME=work, PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    skipped = []
    for n, (name, lang, body) in enumerate(found):
        if body is None:
            check(False, f"marker {n} ('{name}') is not followed by a fenced block")
            continue
        if name == "output":  # "$ COMMAND" and what it prints, exactly (build/tools on PATH)
            cmd, _, want = body.partition("\n")
            r = subprocess.run(["bash", "-c", cmd.removeprefix("$ ")], cwd=work, text=True,
                               capture_output=True, timeout=60,
                               env=dict(env, PATH=os.path.join(BUILD, "tools") + ":" +
                                        env.get("PATH", "")))
            check(r.returncode == 0 and r.stdout == want,
                  f"README block {n}: '{cmd}' prints what the README shows: exit "
                  f"{r.returncode}, got:\n{r.stdout}{r.stderr}\nthe README:\n{want}")
            continue
        if name is not None:  # a file the later blocks use
            with open(os.path.join(work, name), "w") as f:
                f.write(body)
            continue
        first = body.split("\n")[0]
        want, torch_needed = expectation(body)
        if want is None:
            check(False, f"block {n} ({lang}: '{first}') has no expectation in test_readme.py")
            continue
        if lang != "sh":
            check(False, f"block {n}: a runnable block is sh, not {lang}")
            continue
        if torch_needed and not have_torch:
            skipped.append(first)
            continue
        t0 = time.monotonic()
        rc, out = run_block(work, n, body, env)
        took = time.monotonic() - t0
        missing = [w for w in want if not re.search(w, out)]
        check(rc == 0 and not missing, f"README block {n} ('{first}'): exit {rc}, missing "
              f"{missing}:\n{out[-4000:]}")
        print(f"block {n} ('{first[:60]}'): exit {rc} in {took:.0f} s", flush=True)
    installed(work, env, have_torch)
    if counts["failed"] == 0:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"the directory is kept: {work}")
    print(f"test_readme: {counts['passed']} passed, {counts['failed']} failed")
    if counts["failed"]:
        sys.exit(1)
    if skipped:
        print(f"SKIP: {sys.executable} has no torch 2.x: the blocks {skipped} did not run "
              "(tools/torch-venv.sh makes the venv tools/test.sh runs this test under)")
        sys.exit(77)


if __name__ == "__main__":
    main()
