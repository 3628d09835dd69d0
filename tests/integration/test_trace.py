"""The flight recorder (trace_ops, shardctl trace), against real daemons and real trainers:

  - a healthy job on a 2x2 cluster: shardctl trace of the finished job has nothing waiting,
    every call completed, and each rank's calls taken equal to what mlp_train was asked for
    (20 steps; 4 units fetched twice, pushed once a micro-step);
  - a job hung on purpose (rank 3 stopped with SIGSTOP mid-training, op_timeout_ms 3000): every
    other rank fails with a message naming its node's dump, the dumps are there (0600), and
    shardctl trace --merge of both names rank 3 on node 1 as the rank that never made the call
    the others wait in, and what each node was waiting in (text and --json);
  - the link between the two nodes of a netns cluster cut mid-training: every rank fails naming
    its node's dump (shardctl jobs has it whole), and the merge names no rank but the transfers
    between node 0 and node 1
    still open (verdict "transfers"; a rank that never called is verdict "rank");
  - trace_ops 0: no dump, no word of one in the failure, an empty trace;
  - --merge of something that is not a dump, or of nothing, fails saying so.

usage: test_trace.py SHARDD MLP_TRAIN SHARDCTL
"""
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

SHARDD, MLP, SHARDCTL = sys.argv[1:4]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "tools", "local-cluster.sh")
sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
from checks import check, run_parts  # noqa: E402


def ctl(*args):
    return subprocess.run([SHARDCTL, *args], capture_output=True, text=True, timeout=60)


def cluster(cdir, *extra, netns=False):
    r = subprocess.run(["bash", CLUSTER, "start", "--nodes", "2", "--ranks-per-node", "2",
                        "--dir", cdir, *(["--netns"] if netns else []), "--shardd", SHARDD, "--",
                        "--log-level", "warn", *extra],
                       capture_output=True, text=True, timeout=120)
    check(r.returncode == 0, f"cluster start{' (netns)' if netns else ''}: {r.stdout}{r.stderr}")
    return r.returncode == 0


def stop(cdir):
    r = subprocess.run(["bash", CLUSTER, "stop", "--dir", cdir], capture_output=True, text=True,
                       timeout=120)
    check(r.returncode == 0, f"cluster stop (every daemon clean): {r.stdout}{r.stderr}")


def ranks(socks, job, world, k, args):
    return [subprocess.Popen([MLP, "--socket", socks[r // k], "--job", job, "--rank", str(r),
                              "--world", str(world), "--ranks-per-node", str(k), *args],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(world)]


def training(cdir, job, what):
    """the 4 ranks of a long zero3 job on the 2x2 cluster at cdir, after 3 s of training"""
    socks = [os.path.join(cdir, f"node{i}", "shardd.sock") for i in (0, 1)]
    procs = ranks(socks, job, 4, 2, ["--plan", "zero3", "--steps", "100000", "--compute-ms", "10",
                                     "--quiet"])
    time.sleep(3)
    check(all(p.poll() is None for p in procs), f"the job trains before {what}")
    return socks, procs


def healthy(work):
    cdir = os.path.join(work, "ok")
    if not cluster(cdir):
        return
    try:
        socks = [os.path.join(cdir, f"node{i}", "shardd.sock") for i in (0, 1)]
        procs = ranks(socks, "fine", 4, 2, ["--plan", "zero3", "--steps", "20", "--accum", "2",
                                            "--quiet"])
        outs = [p.communicate(timeout=300)[0] for p in procs]
        check(all(p.returncode == 0 for p in procs), f"the healthy job: {outs}")
        for i, s in enumerate(socks):
            r = ctl("--socket", s, "--job", "fine", "--json", "trace")
            docs = json.loads(r.stdout).get("jobs", []) if r.returncode == 0 else []
            check(len(docs) == 1, f"node {i}: the finished job's trace: {r.stdout}{r.stderr}")
            if not docs:
                continue
            d = docs[0]
            ents = d["entries"]
            check(d["version"] == "shardd-trace-1" and d["node"] == i and ents,
                  f"node {i}: a document with records")
            check(all(e["state"] == "completed" for e in ents),
                  f"node {i}: every record completed: "
                  f"{[e for e in ents if e['state'] != 'completed'][:3]}")
            # 20 steps of 2 micro-steps over 4 units: 20 steps, 160 pushes, 320 fetches a rank
            for c in d["calls_taken"]:
                check(c["step"] == 20 and c["push"] == 160 and c["fetch"] == 320,
                      f"node {i} rank {c['rank']}: calls taken {c}")
            # each rank's records of an op count up by one
            for rank in (2 * i, 2 * i + 1):
                seqs = [e["collective_seq_id"] for e in ents
                        if e["kind"] == "call" and e["rank"] == rank and e["op"] == "step"]
                check(seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else False,
                      f"node {i} rank {rank}: steps recorded in order: {seqs}")
            xfers = [e for e in ents if e["kind"] != "call"]
            check(xfers and all(e["peer_node"] == 1 - i for e in xfers),
                  f"node {i}: its transfers are with the other node")
            r = ctl("--socket", s, "--job", "fine", "trace")
            check(r.returncode == 0 and "nothing waiting" in r.stdout,
                  f"node {i}: shardctl trace says nothing waits: {r.stdout[:300]}")
    finally:
        stop(cdir)


def hung(work):
    cdir = os.path.join(work, "hung")
    if not cluster(cdir, "--op-timeout-ms", "3000"):
        return
    procs = []
    try:
        socks, procs = training(cdir, "hang", "the stop")
        procs[3].send_signal(signal.SIGSTOP)
        outs = [procs[r].communicate(timeout=120)[0] for r in range(3)]
        check(all(procs[r].returncode != 0 for r in range(3)),
              f"ranks 0-2 fail once rank 3 stopped: {[p.returncode for p in procs[:3]]}")
        dumps = {}
        for r, out in enumerate(outs):
            m = re.search(r"flight recorder: (\S+\.json)", out)
            check(m is not None, f"rank {r}'s failure names its node's dump: {out[-400:]}")
            if m:
                dumps[r // 2] = m.group(1)
        for n, path in sorted(dumps.items()):
            st = os.stat(path) if os.path.exists(path) else None
            check(st is not None and stat.S_IMODE(st.st_mode) == 0o600 and
                  path.startswith(os.path.join(cdir, f"node{n}", "trace")),
                  f"node {n}'s dump {path}: {oct(st.st_mode) if st else 'missing'}")
            r = ctl("--socket", socks[n], "--json", "jobs")
            err = [j.get("error", "") for j in json.loads(r.stdout).get("jobs", [])]
            check(any(path in e for e in err), f"shardctl jobs on node {n} names it: {err}")
        check(len(dumps) == 2, f"a dump of each node: {dumps}")
        r = ctl("trace", "--merge", *dumps.values())
        print(r.stdout)
        check(r.returncode == 0 and re.search(r"rank 3 \(node 1\) never called \w+ #\d+",
                                              r.stdout) is not None,
              f"the merge names rank 3 on node 1: {r.stdout}{r.stderr}")
        check(re.search(r"(?m)^  node 0 \(failed.*\): waiting in$", r.stdout) and
              re.search(r"(?m)^  node 1 \(failed.*\): waiting in$", r.stdout),
              "the merge says what each node waited in")
        r = ctl("trace", "--merge", "--json", os.path.dirname(dumps[0]),
                os.path.dirname(dumps[1]))
        doc = json.loads(r.stdout) if r.returncode == 0 else {}
        culprits = [(c["rank"], c["node"]) for c in doc.get("culprits", [])]
        check(culprits == [(3, 1)] and doc.get("verdict") == "rank",
              f"--json: the culprits {culprits}, verdict {doc.get('verdict')}")
        waited = doc.get("waited_in", {})
        check(waited.get("ranks") == 3 and waited.get("op") in ("push", "step", "fetch"),
              f"--json: 3 ranks wait in one call: {waited}")
        nodes = {n["node"]: n["waiting"] for n in doc.get("nodes_waiting", [])}
        check(nodes.get(0) and nodes.get(1) and
              any("recv" in w or "send" in w for w in nodes[0]),
              f"--json: node 0 waited on a transfer with node 1: {nodes}")
        # the dump's own records: rank 3 took fewer calls of that op than the others
        with open(dumps[1]) as f:
            d1 = json.load(f)
        taken = {c["rank"]: c[waited.get("op", "push")] for c in d1["calls_taken"]}
        check(taken.get(3, 0) < taken.get(2, 0), f"node 1's calls taken: {taken}")
        for p in procs:
            p.kill()
            p.wait()
        procs = relayed(cdir)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        stop(cdir)


def relayed(cdir):
    """a failure node 0 learns from node 1 (its rank 3 killed): node 0 still dumps its own
    recorder and names it as its flight recorder, node 1's as its dump"""
    socks, procs = training(cdir, "relay", "the kill")
    procs[3].kill()
    outs = [procs[r].communicate(timeout=120)[0] for r in range(3)]
    r = ctl("--socket", socks[0], "--json", "jobs")
    err = [j.get("error", "") for j in json.loads(r.stdout).get("jobs", [])
           if j.get("name") == "relay"] if r.returncode == 0 else []
    err = err[0] if err else ""
    own = re.search(r"flight recorder: (\S+\.json)", err)
    theirs = re.search(r"the failing node.s: (\S+\.json)\)", err)
    check("on another node" in err and own is not None and theirs is not None and
          own.group(1).startswith(os.path.join(cdir, "node0", "trace")) and
          os.path.exists(own.group(1)) and
          theirs.group(1).startswith(os.path.join(cdir, "node1", "trace")),
          f"node 0's failure, told by node 1, names node 0's dump and node 1's: {err}")
    m = re.search(r"flight recorder: (\S+\.json)", outs[0])
    check(procs[0].returncode != 0 and (m is None and len(outs[0]) > 250 or
                                        m is not None and "/node0/" in m.group(1)),
          f"rank 0's failure names its own node's dump first: {outs[0][-400:]}")
    return procs


def cut(work):
    """the link between two netns nodes cut mid-training: no rank is missing, the transfers are"""
    cdir = os.path.join(work, "cut")
    if not cluster(cdir, "--op-timeout-ms", "3000", netns=True):
        return
    procs, down = [], False
    try:
        _, procs = training(cdir, "cut", "the cut")
        r = subprocess.run(["bash", CLUSTER, "link", "--dir", cdir, "--node", "1", "down"],
                           capture_output=True, text=True, timeout=60)
        down = r.returncode == 0
        check(down, f"node 1's link cut: {r.stdout}{r.stderr}")
        outs = [p.communicate(timeout=120)[0] for p in procs]
        check(all(p.returncode != 0 for p in procs),
              f"every rank fails once the link is cut: {[p.returncode for p in procs]}")
        # the job's whole message (a rank's is cut where it is longer than a completion
        # carries: the cause first, the path where it fits)
        dumps = {}
        for n in (0, 1):
            r = ctl("--socket", os.path.join(cdir, f"node{n}", "shardd.sock"), "--json", "jobs")
            for j in json.loads(r.stdout).get("jobs", []) if r.returncode == 0 else []:
                m = re.search(r"flight recorder: (\S+\.json)", j.get("error", ""))
                if m:
                    dumps[n] = m.group(1)
        check(len(dumps) == 2 and all(os.path.exists(p) for p in dumps.values()),
              f"a dump of each node named in its job's failure: {dumps} "
              f"{[o[-300:] for o in outs]}")
        check(all("flight recorder" in o or len(o) > 250 for o in outs),
              f"each rank's failure names the recorder, or is one cut: {[o[-300:] for o in outs]}")
        r = ctl("trace", "--merge", "--json", *dumps.values())
        doc = json.loads(r.stdout) if r.returncode == 0 else {}
        pairs = {(t["node"], t["peer_node"]) for t in doc.get("stuck_transfers", [])}
        check(doc.get("verdict") == "transfers" and doc.get("culprits") == [] and
              pairs and pairs <= {(0, 1), (1, 0)},
              f"--merge: no culprit rank, transfers between node 0 and node 1 stuck: "
              f"{ {k: doc.get(k) for k in ('verdict', 'culprits', 'stuck_transfers')} } "
              f"{r.stderr}")
        r = ctl("trace", "--merge", *dumps.values())
        print(r.stdout)
        check(r.returncode == 0 and "no rank holds the others back" in r.stdout and
              re.search(r"node [01] with node [01]: \d+ send\(s\), \d+ receive\(s\) open",
                        r.stdout) and "never called" not in r.stdout,
              f"the merge's text says the same: {r.stdout}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if down:
            subprocess.run(["bash", CLUSTER, "link", "--dir", cdir, "--node", "1", "up"],
                           capture_output=True, timeout=60)
        stop(cdir)


def off(work):
    run = os.path.join(work, "off")
    os.makedirs(run)
    d = subprocess.Popen([SHARDD, "--runtime-dir", run, "--trace-ops", "0", "--op-timeout-ms",
                          "2000", "--log-level", "warn"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    sock = os.path.join(run, "shardd.sock")
    for _ in range(500):
        if os.path.exists(sock):
            break
        time.sleep(0.02)
    procs = ranks([sock], "quiet", 2, 2, ["--steps", "100000", "--compute-ms", "5", "--quiet"])
    try:
        time.sleep(1.5)
        procs[1].send_signal(signal.SIGSTOP)
        out = procs[0].communicate(timeout=60)[0]
        check(procs[0].returncode != 0 and "flight recorder" not in out,
              f"trace_ops 0: a failure without a dump: {out[-300:]}")
        check(not os.path.exists(os.path.join(run, "trace")), "trace_ops 0: no trace directory")
        r = ctl("--socket", sock, "--json", "trace")
        docs = json.loads(r.stdout).get("jobs", []) if r.returncode == 0 else [None]
        check(len(docs) == 1 and docs[0]["entries"] == [], f"trace_ops 0: no records: {docs}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        d.send_signal(signal.SIGTERM)
        check(d.wait(60) == 0, "trace_ops 0: the daemon stops cleanly")


def bad_merge(work):
    junk = os.path.join(work, "junk.json")
    with open(junk, "w") as f:
        json.dump({"jobs": []}, f)
    r = ctl("trace", "--merge", junk)
    check(r.returncode == 1 and "not a shardd flight recorder dump" in r.stderr,
          f"a foreign JSON: {r.returncode} {r.stderr}")
    empty = os.path.join(work, "empty")
    os.makedirs(empty)
    r = ctl("trace", "--merge", empty)
    check(r.returncode == 1 and "no dump found" in r.stderr, f"nothing to merge: {r.stderr}")
    r = ctl("trace", "--merge")
    check(r.returncode == 2 and "needs the dumps" in r.stderr, f"no path: {r.stderr}")


run_parts("test_trace", healthy, hung, cut, off, bad_merge)
