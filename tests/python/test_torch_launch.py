#!/usr/bin/env python3
"""The GPT example launched as schedulers launch it, on two nodes that are network namespaces
(tools/local-cluster.sh --netns --independent: daemons with no cluster arguments at all, no node
count, index, ranks per node or coordinator; a job's daemons meet through its leader):

- torchrun on each node (static rendezvous at node 0's address, --rdzv_id naming the run), the
  same command everywhere: the example takes its socket from $SHARD_SOCKET, its rank, world
  and job from torchrun's variables (shard.torch.launcher), the job's ranks per node from
  LOCAL_WORLD_SIZE, and libshard the job's leader from MASTER_ADDR (shardd's port 7701);
- an srun-style launch: each node's process with Slurm's variables (SLURM_PROCID, SLURM_NTASKS,
  SLURM_NTASKS_PER_NODE, SLURM_JOB_ID, SLURM_STEP_ID, SLURM_STEP_NODELIST: its leader is the
  list's first node) set as srun sets them.
Both give the job's secret in a file every rank reads ($SHARD_JOB_SECRET_FILE): the job forms of
the daemons that prove it.

Each trains to the reference, the same model in one process on both ranks' micro-batches
(train_gpt.py --single): losses within 1e-5 relative, parameters allclose (rtol 1e-5, atol 1e-5),
the loss falling. Node 0's daemon lists both jobs by their launchers' names (torch-<run id>,
slurm-<job>.<step>), finished, on the two daemons (their ids, the same on both), with bytes sent
between the namespaces.
Skipped (exit 77, with the reason) without PyTorch or where namespaces cannot be made.

Usage: test_torch_launch.py SHARDD LIBSHARD SHARDCTL"""
import json
import os
import subprocess
import sys
import tempfile

from harness import ROOT, torch, check, run_all, finish

SHARDD, SHARDCTL = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[3])
GPT = os.path.join(ROOT, "client", "examples", "train_gpt.py")
SCRIPT = os.path.join(ROOT, "tools", "local-cluster.sh")
STEPS = 8
COMMON = ["--steps", str(STEPS), "--accum", "2", "--quiet"]

probe = f"sdlaunch{os.getpid()}"
if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
    print("SKIP: cannot create network namespaces here (needs root and CAP_SYS_ADMIN)")
    sys.exit(77)
subprocess.run(["ip", "netns", "del", probe], capture_output=True)

work = tempfile.mkdtemp(prefix="shardd-launch-")
cdir = os.path.join(work, "cluster")
env = dict(os.environ, PYTHONUNBUFFERED="1")
for v in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID",
          "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_ID", "SLURM_STEP_ID"):
    env.pop(v, None)


def netns(node):
    r = subprocess.run(["bash", SCRIPT, "netns", "--dir", cdir, "--node", str(node)],
                       capture_output=True, text=True)
    return r.stdout.strip()


def address(ns):
    """the namespace's address on the cluster's bridge"""
    r = subprocess.run(["ip", "-n", ns, "-4", "-o", "addr", "show"], capture_output=True,
                       text=True)
    for line in r.stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            a = fields[fields.index("inet") + 1].split("/")[0]
            if not a.startswith("127."):
                return a
    return None


def compare(tag, log, dump, ref):
    try:
        s, d = json.load(open(log)), json.load(open(ref + ".json"))
    except OSError as e:
        check(False, f"{tag}: logs missing ({e})")
        return
    check(len(s["loss"]) == STEPS and len(d["loss"]) == STEPS, f"{tag}: {STEPS} steps logged")
    worst = max(abs(a - b) / abs(b) for a, b in zip(s["loss"], d["loss"]))
    check(worst <= 1e-5, f"{tag}: loss differs from one process by {worst:.3g} relative")
    check(s["loss"][-1] < s["loss"][0], f"{tag}: the loss falls "
          f"({s['loss'][0]:.4f} -> {s['loss'][-1]:.4f})")
    a, b = torch.load(dump), torch.load(ref + ".pt")
    outside, maxd = 0, 0.0
    for k in b:
        x, y = a[k].float(), b[k].float()
        maxd = max(maxd, (x - y).abs().max().item())
        outside += int((~torch.isclose(x, y, rtol=1e-5, atol=1e-5)).sum())
    check(sorted(a) == sorted(b) and outside == 0,
          f"{tag}: {outside} parameters not allclose to one process (max |diff| {maxd:.3g})")
    print(f"{tag}: loss {s['loss'][0]:.4f} -> {s['loss'][-1]:.4f}, worst relative difference "
          f"{worst:.2e}, parameters max |diff| {maxd:.2e}", flush=True)


started = False
try:
    r = subprocess.run(["bash", SCRIPT, "start", "--nodes", "2", "--dir", cdir, "--netns",
                        "--independent", "--shardd", SHARDD, "--shardctl", SHARDCTL,
                        "--", "--log-level", "warn"],
                       capture_output=True, text=True, timeout=120)
    started = r.returncode == 0
    check(started, f"independent netns daemons' start: {r.stdout}{r.stderr}")
    ns = [netns(0), netns(1)]
    master = address(ns[0]) if started else None
    check(master is not None, f"node 0's address in {ns[0]}")
    if started and master:
        # the reference: one process, both ranks' micro-batches
        ref = os.path.join(work, "single")
        outs = run_all([[sys.executable, GPT, "--single", "--world", "2", "--plan", "mics:2",
                         "--log", ref + ".json", "--dump", ref + ".pt"] + COMMON], env=env)
        check(outs[0][0] == 0, f"the single-process reference: {outs[0][1]}")

        # the job's secret in a file every rank reads (as on a shared filesystem)
        key = os.path.join(work, "job.key")
        with open(key, "wb") as f:
            f.write(os.urandom(32))
        # torchrun on each node, the same command
        cmds = []
        for n in range(2):
            cmds.append(["ip", "netns", "exec", ns[n], "env", f"SHARD_JOB_SECRET_FILE={key}",
                         f"SHARD_SOCKET={cdir}/node{n}/shardd.sock", sys.executable, "-m",
                         "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                         # torch 1.13 (Debian 12) under Python 3.11 cannot parse its default
                         # "0" for these (meta-llama/llama#86); 2 works on every torch
                         "--redirects", "2", "--tee", "2",
                         "--node_rank", str(n), "--master_addr", master, "--master_port",
                         "29400", "--rdzv_id", "gpt7", GPT, "--plan", "mics:2", "--log-json",
                         f"{work}/torchrun{n}.json", "--dump", f"{work}/torchrun{n}.pt"] +
                        COMMON)
        for n, (rc, out) in enumerate(run_all(cmds, env=env)):
            check(rc == 0, f"torchrun on node {n}: exit {rc}:\n{out}")
        compare("torchrun", f"{work}/torchrun0.json", f"{work}/torchrun0.pt", ref)

        # srun: Slurm's variables, as it sets them for task n of 2, one a node (the step's
        # node list: the two namespaces' addresses, the leader first)
        nodelist = ",".join(address(x) or "" for x in ns)
        cmds = []
        for n in range(2):
            cmds.append(["ip", "netns", "exec", ns[n], "env", f"SHARD_JOB_SECRET_FILE={key}",
                         f"SHARD_SOCKET={cdir}/node{n}/shardd.sock", f"SLURM_PROCID={n}",
                         "SLURM_NTASKS=2", "SLURM_NTASKS_PER_NODE=1", "SLURM_LOCALID=0",
                         "SLURM_JOB_ID=4242", "SLURM_STEP_ID=0",
                         f"SLURM_STEP_NODELIST={nodelist}", sys.executable, GPT, "--plan",
                         "mics:2", "--log", f"{work}/srun{n}.json", "--dump",
                         f"{work}/srun{n}.pt"] + COMMON)
        for n, (rc, out) in enumerate(run_all(cmds, env=env)):
            check(rc == 0, f"srun-style rank {n}: exit {rc}:\n{out}")
        compare("srun", f"{work}/srun0.json", f"{work}/srun0.pt", ref)

        # node 0's daemon: both jobs, by their launchers' names, across both namespaces
        r = subprocess.run([SHARDCTL, "--socket", f"{cdir}/node0/shardd.sock", "jobs", "--json"],
                           capture_output=True, text=True)
        jobs = {}
        try:
            jobs = {j["name"]: j for j in json.loads(r.stdout)["jobs"]}
        except (ValueError, KeyError) as e:
            check(False, f"shardctl jobs --json: {e}: {r.stdout}{r.stderr}")
        for name in ("torch-gpt7", "slurm-4242.0"):
            j = jobs.get(name)
            ids = j.get("node_daemons", []) if j else []
            check(j is not None and j.get("state") == "finished" and j.get("world") == 2 and
                  len(ids) == 2 and all(ids) and ids[0] != ids[1] and j.get("secret") is True,
                  f"{name}: finished, world 2, on two daemons, with its secret: {j}")
            s = subprocess.run([SHARDCTL, "--socket", f"{cdir}/node0/shardd.sock", "--job", name,
                                "stats", "--json"], capture_output=True, text=True)
            try:
                sent = json.loads(s.stdout)["jobs"][0]["bytes"]["inter_node_sent"]
            except (ValueError, KeyError, IndexError):
                sent = 0
            check(sent > 0, f"{name}: bytes sent between the namespaces ({sent})")
finally:
    if started or os.path.exists(cdir):
        subprocess.run(["bash", SCRIPT, "stop", "--dir", cdir], capture_output=True, text=True,
                       timeout=120)
finish("test_torch_launch", work)
