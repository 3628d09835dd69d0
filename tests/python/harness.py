"""What the Python tests share: PyTorch or a skip (exit 77), the shard package of this tree with
the libshard under test, pass/fail counting, running processes with a deadline, and the emulated
cluster of tools/local-cluster.sh; and the language-model task the GPT tests train (the
warm-up + cosine schedule, the global micro-batch, the loss).

    from harness import torch, shard, check, raises, run_all, Cluster, finish
"""
import math
import os
import subprocess
import sys

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


def run_all(cmds, timeout=600, env=None):
    """Run the commands at once: [(exit code, output)], killed after timeout seconds."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for c in cmds]
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
