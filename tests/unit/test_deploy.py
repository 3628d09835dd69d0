"""deploy/ checked offline, as far as tools without a cluster or a systemd can:

  k8s      every manifest in deploy/k8s/ valid against a current Kubernetes release's schemas
           (kubernetes-validate --strict, its newest bundled release; a copy with a misspelt
           field is refused, so the check can fail; deploy/k8s/examples/ too), and what the
           validator cannot see: the namespace applied before the objects in it, the DaemonSet without hostIPC, all
           capabilities dropped but SETUID and SETGID, the metrics port the same in the
           arguments, the annotations, the container port and the liveness probe on /healthz,
           and the trainer Job mounting the socket directory the DaemonSet shares.
  systemd  systemd-analyze security --offline=yes deploy/shardd.service: its score is the one
           deploy/README.md states, and the unit is Type=notify with a watchdog.

Exit 77 (skipped, saying why) where the tool is missing: kubernetes-validate (tools/test.sh
installs it into the suite's venv with pip) or systemd-analyze.

usage: test_deploy.py ROOT k8s|systemd
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT, MODE = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402


def k8s():
    try:
        import yaml
        import kubernetes_validate  # noqa: F401
    except ImportError as e:
        print(f"SKIP: {e}: tools/test.sh installs kubernetes-validate into the suite's venv")
        sys.exit(77)
    exe = shutil.which("kubernetes-validate", path=os.path.dirname(sys.executable))
    kdir = os.path.join(ROOT, "deploy", "k8s")
    files = sorted(os.path.join(d, f) for d in (kdir, os.path.join(kdir, "examples"))
                   for f in os.listdir(d) if f.endswith(".yaml"))
    r = subprocess.run([exe, "--strict", *files], capture_output=True, text=True, timeout=120)
    ok = re.findall(r"passed for resource (\S+) against version (\S+)", r.stdout + r.stderr)
    print(f"kubernetes-validate: {len(ok)} objects against version {ok[0][1] if ok else '?'}")
    check(r.returncode == 0 and len(ok) >= 6, f"every manifest valid: {r.stdout}{r.stderr}")
    # the validator can fail: a misspelt field of the DaemonSet
    with tempfile.TemporaryDirectory() as d:
        bad = os.path.join(d, "daemonset.yaml")
        with open(os.path.join(kdir, "daemonset.yaml")) as f:
            text = f.read()
        with open(bad, "w") as f:
            f.write(text.replace("hostNetwork: true", "hostNetwrok: true"))
        r = subprocess.run([exe, "--strict", bad], capture_output=True, text=True, timeout=120)
        check(r.returncode != 0 and "hostNetwrok" in r.stdout + r.stderr,
              f"a misspelt field refused: {r.returncode} {r.stdout}{r.stderr}")
    docs = {}
    for path in files:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    docs.setdefault(doc["kind"], []).append((os.path.basename(path), doc))
    ns = [d["metadata"]["name"] for _, d in docs.get("Namespace", [])]
    check(ns == ["shardd"], f"a namespace manifest: {ns}")
    # kubectl apply -f deploy/k8s/ goes in file order (configmap before namespace): the steps
    # the docs give apply the namespace first
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        ops = f.read()
    a, b = ops.find("kubectl apply -f deploy/k8s/namespace.yaml"), ops.find(
        "kubectl apply -f deploy/k8s/\n")
    check(0 <= a < b, "docs/operations.md applies the namespace before the rest")
    ds = docs["DaemonSet"][0][1]
    spec = ds["spec"]["template"]["spec"]
    c = spec["containers"][0]
    check(not spec.get("hostIPC") and spec.get("hostNetwork") is True,
          "the DaemonSet: no hostIPC, the host's network (the fabric)")
    caps = c["securityContext"]["capabilities"]
    check(caps.get("drop") == ["ALL"] and sorted(caps.get("add", [])) == ["SETGID", "SETUID"] and
          c["securityContext"].get("allowPrivilegeEscalation") is False,
          f"capabilities: {caps}")
    args = " ".join(c.get("args", []))
    m = re.search(r"--metrics-listen \"?\$POD_IP:(\d+)", args)
    port = m.group(1) if m else None
    ann = ds["spec"]["template"]["metadata"].get("annotations", {})
    probe = c.get("livenessProbe", {}).get("httpGet", {})
    check(port is not None and ann.get("prometheus.io/port") == port and
          ann.get("prometheus.io/scrape") == "true" and
          {p["containerPort"] for p in c.get("ports", [])} == {int(port)} and
          probe.get("path") == "/healthz" and str(probe.get("port")) == port,
          f"one metrics port in the arguments, annotations, ports and probe: {port} {ann} "
          f"{probe}")
    check(not any(r.get("limits", {}).get("nvidia.com/gpu") for r in [c.get("resources", {})]),
          "the daemon takes no GPU from the device plugin")
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    job = docs["Job"][0][1]["spec"]["template"]["spec"]
    jhost = {v["name"]: v["hostPath"]["path"] for v in job["volumes"] if "hostPath" in v}
    check("/run/shardd" in host.values() and "/run/shardd" in jhost.values(),
          f"the trainer Job mounts the daemons' socket directory: {host} {jhost}")
    env = {e["name"]: e.get("value") for e in job["containers"][0].get("env", [])}
    check(env.get("SHARD_SOCKET") == "/run/shardd/shardd.sock" and
          "SHARD_JOB_SECRET_FILE" in env and "--master_addr" in
          " ".join(job["containers"][0]["args"]),
          f"the trainers name the socket, the job's secret and the leader: {env}")


def systemd():
    exe = shutil.which("systemd-analyze")
    if exe is None:
        print("SKIP: systemd-analyze is not installed (Debian's systemd package has it)")
        sys.exit(77)
    unit = os.path.join(ROOT, "deploy", "shardd.service")
    r = subprocess.run([exe, "security", "--offline=yes", unit], capture_output=True, text=True,
                       timeout=120)
    m = re.search(r"Overall exposure level for shardd\.service: (\d+\.\d+)", r.stdout + r.stderr)
    score = m.group(1) if m else None
    print(f"systemd-analyze security: {score}")
    with open(os.path.join(ROOT, "deploy", "README.md")) as f:
        readme = f.read()
    stated = re.search(r"systemd-analyze security --offline=yes deploy/shardd\.service` "
                       r"\(systemd \d+\): exposure \*\*(\d+\.\d+)\*\*", readme)
    check(score is not None and stated is not None and stated.group(1) == score,
          f"the score {score} is the one deploy/README.md states "
          f"({stated.group(1) if stated else 'none'})")
    with open(unit) as f:
        text = f.read()
    check(re.search(r"(?m)^Type=notify$", text) and re.search(r"(?m)^WatchdogSec=\d+", text),
          "Type=notify with a watchdog")


if MODE == "k8s":
    k8s()
else:
    systemd()
sys.exit(finish(f"test_deploy {MODE}"))
