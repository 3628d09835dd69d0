"""What the Python tests share: PyTorch or a skip (exit 77), the shard package of this tree with
the libshard under test, pass/fail counting, running processes with a deadline, and the emulated
cluster of tools/local-cluster.sh; and the language-model task the GPT tests train (the
warm-up + cosine schedule, the global micro-batch, the loss).

    from harness import torch, shard, check, raises, run_all, spawn, Cluster, finish

The rank processes a test starts (run_all, spawn) are forked from tests/python/zygote.py, which
imported torch once, instead of each importing it again.
"""
import json
import math
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import torch  # noqa: F401
except ImportError as e:
    print(f"SKIP: PyTorch cannot be imported ({e}); tools/torch-venv.sh makes the venv with "
          "torch 2.x that tools/test.sh runs the Python tests under")
    sys.exit(77)

if len(sys.argv) >= 3 and "SHARD_LIBRARY" not in os.environ:
    os.environ["SHARD_LIBRARY"] = os.path.abspath(sys.argv[2])
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
import shard  # noqa: E402,F401

counts = {"passed": 0, "failed": 0}


def check(cond, what):
    if cond:
        counts["passed"] += 1
    else:
        counts["failed"] += 1
        print(f"FAIL: {what}", flush=True)


def raises(fn, *words, kinds=(ValueError, TypeError)):
    """(fn() raised one of kinds with a message naming every word, the message)"""
    try:
        fn()
    except kinds as e:
        return all(w in str(e) for w in words), str(e)
    return False, "(nothing raised)"


class _Zygote:
    """tests/python/zygote.py, started once per test: forks the test's Python processes from an
    interpreter that imported torch already (zygote.py says why and how)."""

    def __init__(self):
        import socket
        import threading
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(
            os.path.abspath(__file__)), "zygote.py"), str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock, self.lock, self.cond = ours, threading.Lock(), threading.Condition()
        self.answers, self.codes = [], {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        while True:
            msg = self.sock.recv(1 << 16)
            with self.cond:
                if not msg:
                    self.answers.append({"error": "the zygote ended"})
                    self.cond.notify_all()
                    return
                doc = json.loads(msg)
                if "pid" in doc:  # a pid used again: the earlier process's end is not its
                    self.codes.pop(doc["pid"], None)
                if "exit" in doc:
                    self.codes[doc["exit"]] = doc["code"]
                else:
                    self.answers.append(doc)
                self.cond.notify_all()

    def start(self, argv, env, cwd, out_fd):
        import socket
        with self.lock:  # one request at a time: the answers come in order
            socket.send_fds(self.sock, [json.dumps({"argv": argv, "env": env,
                                                    "cwd": cwd}).encode()], [out_fd])
            with self.cond:
                while not self.answers:
                    self.cond.wait()
                doc = self.answers.pop(0)
        if "pid" not in doc:
            raise OSError(f"the zygote did not start {argv[:2]}: {doc.get('error')}")
        return doc["pid"]

    def wait(self, pid, timeout=None):
        with self.cond:
            if not self.cond.wait_for(lambda: pid in self.codes, timeout):
                raise subprocess.TimeoutExpired(str(pid), timeout)
            return self.codes[pid]


_zygote = None


class Forked:
    """A process the zygote forked, with what the tests use of subprocess.Popen: pid, returncode,
    poll, wait, communicate (text output; stderr into stdout), send_signal, kill, terminate."""

    def __init__(self, argv, env, cwd):
        global _zygote
        if _zygote is None:
            _zygote = _Zygote()
        r, w = os.pipe()
        try:
            self.pid = _zygote.start(argv, env, cwd, w)
        finally:
            os.close(w)
        self.args, self.returncode, self._out, self._r = argv, None, [], r

    def poll(self):
        if self.returncode is None:
            try:
                self.returncode = _zygote.wait(self.pid, 0)
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def _drain(self, deadline):
        import select
        while self._r is not None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, 0)
            if not select.select([self._r], [], [], left)[0]:
                continue
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                os.close(self._r)
                self._r = None
            else:
                self._out.append(chunk)

    def communicate(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._drain(deadline)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return b"".join(self._out).decode(errors="replace"), None

    def wait(self, timeout=None):
        if self.returncode is None:
            try:
                self.returncode = _zygote.wait(self.pid, timeout)
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)


def spawn(argv, env=None):
    """subprocess.Popen(argv, stdout=PIPE, stderr=STDOUT, text=True, env=env), forked by the
    zygote where argv is this interpreter running a script or -c (the same process a new
    interpreter would be, without importing torch again), else started as Popen does. Setting
    SHARD_TEST_NO_ZYGOTE=1 starts every process anew."""
    env = dict(os.environ if env is None else env)
    same = (len(argv) >= 2 and argv[0] == sys.executable and
            (argv[1].endswith(".py") or (argv[1] == "-c" and len(argv) >= 3)) and
            os.environ.get("SHARD_TEST_NO_ZYGOTE") != "1" and
            all(env.get(k) == os.environ.get(k) for k in set(env) | set(os.environ)
                if k.startswith(("LD_", "PYTHONHOME", "PYTHONNOUSERSITE", "ASAN", "UBSAN"))))
    if same:
        return Forked(list(argv), env, os.getcwd())
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


def run_all(cmds, timeout=600, env=None):
    """Run the commands at once: [(exit code, output)], killed after timeout seconds."""
    procs = [spawn(c, env=env) for c in cmds]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n(timed out)"
        outs.append((p.returncode, out))
    return outs


class Cluster:
    """nodes x ranks_per_node daemons on loopback (tools/local-cluster.sh)."""

    def __init__(self, shardd, cdir, nodes, ranks_per_node):
        self.cdir, self.script = cdir, os.path.join(ROOT, "tools", "local-cluster.sh")
        r = subprocess.run(["bash", self.script, "start", "--nodes", str(nodes),
                            "--ranks-per-node", str(ranks_per_node), "--dir", cdir, "--shardd",
                            shardd, "--", "--log-level", "warn"],
                           capture_output=True, text=True, timeout=120)
        self.ok = r.returncode == 0
        check(self.ok, f"cluster start: {r.stdout}{r.stderr}")

    def socket(self, node):
        return f"{self.cdir}/node{node}/shardd.sock"

    def stop(self):
        subprocess.run(["bash", self.script, "stop", "--dir", self.cdir], capture_output=True,
                       text=True, timeout=120)


def finish(name, work=None):
    """Print the counts and exit: 0 when nothing failed (work removed), else 1 (work kept)."""
    import shutil
    if work is not None:
        if counts["failed"] == 0:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs kept in {work}")
    print(f"{name}: {counts['passed']} passed, {counts['failed']} failed")
    sys.exit(1 if counts["failed"] else 0)


def warmup_cosine(step, steps):
    """the schedule's factor at step of steps: 3 steps of warm-up, then a cosine"""
    return min(1.0, (step + 1) / 3) * 0.5 * (1 + math.cos(math.pi * step / steps))


def lm_batch(step, micro, rows, ctx, vocab):
    """the global micro-batch of step and micro: rows random sequences, each next token the
    target"""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(0, vocab, (rows, ctx), generator=g)
    return x, torch.roll(x, -1, 1)


def lm_loss(m, x, y, vocab):
    return torch.nn.functional.cross_entropy(m(x).reshape(-1, vocab), y.reshape(-1))
