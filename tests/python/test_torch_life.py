#!/usr/bin/env python3
"""What a PyTorch job meets around its training loop, on a 2-node x 2-rank emulated cluster of
real daemons (tools/local-cluster.sh), with test_torch_optim's GPT (tied lm_head, frozen
position embedding, the adapter taken in every step, two AdamW groups, warm-up + cosine
LambdaLR, clipping, accumulation 2):

  - the end of a job: ranks that simply exit after their last step (no unwrap, no detach) leave
    it `finished` in `shardctl jobs` on both nodes, with its memory released (memory_bytes 0)
    and its end in "ended", not "error"; the same with resume_timeout_ms; a rank killed
    (SIGKILL) mid-run leaves it `failed` (without resume_timeout_ms) or `paused` (with), and a
    rank that dies of an uncaught exception (also under an excepthook of the script's own), or
    calls sys.exit(3), leaves it `failed`;
  - evaluation on rank 0 alone (under torch.no_grad(), as `if rank == 0: evaluate()`) before
    the first step, between steps and after the last, under zero3, mics:2 and topo:1/2/4: the
    job goes on, every rank's per-step loss and the final parameters are bitwise those of the
    same run without evaluation, and each evaluation's output equals single-process torch's
    at that point within 1e-5; the run without evaluation keeps to its schedule (frozen once,
    no invalidation: backward's fetches are not taken for evaluation), and under mics:2 so does
    a run that calls every block through torch.utils.checkpoint (whose first forward runs
    under no_grad on every rank), bitwise equal to the plain run;
  - a resume with the scheduler, as docs/pytorch.md does it: 3 steps, shard.torch.save after
    sched.step(), exit; wrap(load=) and a LambdaLR built with last_epoch=start_step - 1, 3 more
    steps: each step's lr equals an uninterrupted run's, and the final parameters and losses are
    bitwise the uninterrupted run's (zero3);
  - the checkpoint of that save read by shard.checkpoint.load_state_dict loads strictly into an
    unwrapped GPT (the tied lm_head.weight under both names) and equals full_state_dict at the
    save bitwise.

Skipped (exit 77, with the reason) where PyTorch cannot be imported.
usage: test_torch_life.py SHARDD LIBSHARD
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import types

from harness import Cluster, check, finish, run_all, shard, spawn, torch

import shard.checkpoint  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
import shard.torch as st  # noqa: E402
from test_torch_optim import (RANKS, SEQS, GPT, build_opt, data, groups,  # noqa: E402
                              loss_of, micro_steps, model, warmup_cosine)

STEPS = 6
EVAL_AT = (0, 3, STEPS)  # before step 0, between steps 2 and 3, after the last


def eval_batch():
    g = torch.Generator().manual_seed(4242)
    return torch.randint(0, 32, (3, 8), generator=g)


def evaluate(m):
    was = m.training
    m.eval()
    with torch.no_grad():
        out = m(eval_batch())
    m.train(was)
    return out


def reference():
    """single-process torch: per-step lr, the evaluations at EVAL_AT"""
    m = model()
    opt, sched = build_opt("adamw", m)
    evals, lrs = {}, []
    for step in range(STEPS + 1):
        if step in EVAL_AT:
            evals[step] = evaluate(m)
        if step == STEPS:
            break
        micro_steps(m, data, loss_of, step, 0, RANKS * SEQS)
        torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.grad is not None], 1.0)
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return evals, lrs


def checkpointed_forward(self, idx):
    """GPT.forward with each block called through torch.utils.checkpoint, as transformers'
    gradient checkpointing does: the block's hooks (its fetch) run inside the checkpoint,
    under no_grad in forward and again with autograd in backward"""
    h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
    for b in self.blocks:
        h = torch.utils.checkpoint.checkpoint(b, h)
    if self.take_adapter:
        h = h + self.adapter(h)
    return self.lm_head(self.ln_f(h))


def worker(a):
    """one rank: a["mode"] train (with "eval" on rank 0), part1 (save and exit), part2 (resume),
    exit (steps, then simply ends), die (raises in step 2; die-hooked: under its own excepthook),
    exit3 (sys.exit(3) in step 2), hang
    (sleeps in step 2: killed)"""
    mode, rank = a["mode"], a["rank"]
    m = model()
    opt = torch.optim.AdamW(groups(m), lr=3e-2)  # as build_opt's, without its scheduler
    if a.get("checkpointing"):  # every block called inside torch.utils.checkpoint (reentrant)
        m.forward = types.MethodType(checkpointed_forward, m)
    load = a["ckpt"] if mode == "part2" else None
    st.wrap(m, socket=a["socket"], job=a["job"], rank=rank, world=RANKS, plan=a["plan"],
            optimizer=opt, max_grad_norm=1.0, load=load,
            resume_timeout_ms=a.get("resume_timeout_ms", 0))
    start = st.start_step(m)
    # docs/pytorch.md's resume: the scheduler picks up at the checkpoint's step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine, last_epoch=start - 1)
    end = 3 if mode == "part1" else STEPS
    lo, hi = rank * SEQS, (rank + 1) * SEQS
    out = {"loss": [], "lr": [], "start": start}
    evals = {}
    for step in range(start, end + 1):
        if a.get("eval") and rank == 0 and step in EVAL_AT:
            evals[step] = evaluate(m)
        if step == end:
            break
        if step == 2 and mode in ("die", "die-hooked"):
            if mode == "die-hooked":  # a script's own excepthook (rich, IPython) replaces ours
                sys.excepthook = lambda *exc: sys.__excepthook__(*exc)
            raise RuntimeError("a bug in the training script")
        if step == 2 and mode == "exit3":
            sys.exit(3)  # a script that gives up, saying so in its status
        if step == 2 and mode == "hang" and rank == 1:
            with open(a["out"] + ".ready", "w") as f:
                f.write("in step 2\n")
            time.sleep(600)
        out["loss"].append(micro_steps(m, data, loss_of, step, lo, hi))
        out["lr"].append([g["lr"] for g in opt.param_groups])
        opt.step()
        opt.zero_grad()
        sched.step()
    if mode == "part1":
        st.save(a["ckpt"], m)
        if rank == 0:
            torch.save(st.full_state_dict(m), a["out"] + "-saved.pt")
    if rank == 0:
        sched_doc = shard.admin("schedule", a["job"], socket=a["socket"])["jobs"][0]
        out["invalidations"] = sched_doc["invalidations"]
        out["freezes"] = sched_doc["freezes"]
    if rank == 0 and mode != "exit":
        torch.save({"params": st.full_state_dict(m), "evals": evals}, a["out"] + ".pt")
    with open(a["out"] + ".json", "w") as f:
        json.dump(out, f)
    # no unwrap, no detach: the process ends as a script does


def launch(cl, work, tag, args, wait=True):
    cmds = []
    for r in range(RANKS):
        a = dict(args, socket=cl.socket(r // 2), job=tag, rank=r, out=f"{work}/{tag}-{r}")
        cmds.append([sys.executable, os.path.abspath(__file__), sys.argv[1], sys.argv[2],
                     "--worker", json.dumps(a)])
    if not wait:
        return [spawn(c) for c in cmds]
    return run_all(cmds, timeout=300)


def all_ok(tag, outs):
    ok = all(rc == 0 for rc, _ in outs)
    for r, (rc, out) in enumerate(outs):
        check(rc == 0, f"{tag} rank {r} exit code {rc}:\n{out[-3000:]}")
    return ok


def job_on(cl, node, name):
    doc = shard.admin("jobs", name, socket=cl.socket(node))
    return doc["jobs"][0] if doc.get("jobs") else {}


def wait_state(cl, name, states, timeout=20.0):
    """the job's document on each node once its state is one of states (or at the timeout)"""
    deadline = time.time() + timeout
    while True:
        docs = [job_on(cl, n, name) for n in (0, 1)]
        if all(d.get("state") in states for d in docs) or time.time() > deadline:
            return docs


def results(work, tag):
    logs = [json.load(open(f"{work}/{tag}-{r}.json")) for r in range(RANKS)]
    return logs, torch.load(f"{work}/{tag}-0.pt")


def job_end(cl, work):
    for timeout_ms in (0, 60000):
        tag = f"exit-{timeout_ms}"
        if not all_ok(tag, launch(cl, work, tag, {"mode": "exit", "plan": "mics:2",
                                                   "resume_timeout_ms": timeout_ms})):
            continue
        docs = wait_state(cl, tag, ("finished",))
        for n, d in enumerate(docs):
            check(d.get("state") == "finished" and d.get("memory_bytes") == 0 and
                  d.get("steps") == STEPS and d.get("error") == "" and
                  "detached" in d.get("ended", ""),
                  f"ranks that exit after the last step (resume_timeout_ms {timeout_ms}): node "
                  f"{n} has the job finished, its memory released, its end not an error: "
                  f"{ {k: d.get(k) for k in ('state', 'memory_bytes', 'steps', 'error', 'ended')} }")
    for timeout_ms, want in ((0, "failed"), (60000, "paused")):
        tag = f"kill-{timeout_ms}"
        procs = launch(cl, work, tag, {"mode": "hang", "plan": "mics:2",
                                       "resume_timeout_ms": timeout_ms}, wait=False)
        deadline = time.time() + 120
        while not os.path.exists(f"{work}/{tag}-1.ready") and time.time() < deadline:
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGKILL)
        for p in procs:
            try:
                p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
        docs = wait_state(cl, tag, (want,))
        check(all(d.get("state") == want and "rank 1" in d.get("error", "") for d in docs),
              f"rank 1 killed in step 3 (resume_timeout_ms {timeout_ms}): the job is {want} on "
              f"both nodes naming rank 1: {[(d.get('state'), d.get('error')) for d in docs]}")
    for tag in ("die", "die-hooked"):
        outs = launch(cl, work, tag, {"mode": tag, "plan": "mics:2"})
        check(all(rc != 0 and "a bug in the training script" in out for rc, out in outs),
              f"{tag}: an uncaught exception ends every rank with its traceback")
        docs = wait_state(cl, tag, ("failed",))
        check(all(d.get("state") == "failed" for d in docs),
              f"{tag}: ranks that die of an uncaught exception leave the job failed, not "
              f"finished: {[(d.get('state'), d.get('error')) for d in docs]}")
    tag = "exit3"
    outs = launch(cl, work, tag, {"mode": "exit3", "plan": "mics:2"})
    check(all(rc == 3 for rc, _ in outs), f"sys.exit(3) exits 3: {[rc for rc, _ in outs]}")
    docs = wait_state(cl, tag, ("failed",))
    check(all(d.get("state") == "failed" for d in docs),
          f"ranks that call sys.exit(3) leave the job failed, not finished: "
          f"{[(d.get('state'), d.get('error')) for d in docs]}")


def evaluation(cl, work, ref_evals):
    for plan in ("zero3", "mics:2", "topo:1/2/4"):
        tags = {}
        variants = ("plain", "eval", "checkpointing") if plan == "mics:2" else ("plain", "eval")
        for v in variants:
            tag = tags[v] = f"eval-{plan.replace(':', '').replace('/', '')}-{v}"
            all_ok(tag, launch(cl, work, tag, {"mode": "train", "plan": plan,
                                               "eval": v == "eval",
                                               "checkpointing": v == "checkpointing"}))
        try:
            base_logs, base = results(work, tags["plain"])
            logs, got = results(work, tags["eval"])
            if "checkpointing" in tags:
                ck_logs, ck = results(work, tags["checkpointing"])
        except OSError as e:
            check(False, f"{plan}: results missing ({e})")
            continue
        check(base_logs[0]["invalidations"] == 0 and base_logs[0]["freezes"] == 1,
              f"{plan}: a training loop's fetches (forward and backward) keep to the schedule: "
              f"{base_logs[0]['invalidations']} invalidations, {base_logs[0]['freezes']} freezes")
        if "checkpointing" in tags:
            check(ck_logs[0]["invalidations"] == 0 and
                  [lg["loss"] for lg in ck_logs] == [lg["loss"] for lg in base_logs] and
                  all(torch.equal(ck["params"][k], base["params"][k]) for k in base["params"]),
                  f"{plan}: with torch.utils.checkpoint the schedule holds "
                  f"({ck_logs[0]['invalidations']} invalidations) and training is bitwise the "
                  f"same")
        check([lg["loss"] for lg in logs] == [lg["loss"] for lg in base_logs],
              f"{plan}: every rank's per-step loss with rank-0 evaluation is bitwise the run "
              f"without")
        check(sorted(got["params"]) == sorted(base["params"]) and
              all(torch.equal(got["params"][k], base["params"][k]) for k in base["params"]),
              f"{plan}: the final parameters with rank-0 evaluation are bitwise the run without")
        worst = max((got["evals"][s] - ref_evals[s]).abs().max().item() for s in EVAL_AT) \
            if sorted(got["evals"]) == sorted(EVAL_AT) else float("inf")
        check(worst <= 1e-5, f"{plan}: rank 0's evaluations before, between and after the "
              f"steps ({sorted(got['evals'])}) equal single-process torch's: max |diff| {worst:.3g}")
        print(f"{plan}: rank-0 evaluation at steps {list(EVAL_AT)}: max |diff| vs torch "
              f"{worst:.2e}; training bitwise the run without", flush=True)


def resume(cl, work, ref_lrs):
    # the uninterrupted run: evaluation()'s zero3 run without evaluation
    full, ckpt = "eval-zero3-plain", os.path.join(work, "ckpt")
    all_ok("part1", launch(cl, work, "part1", {"mode": "part1", "plan": "zero3", "ckpt": ckpt}))
    all_ok("part2", launch(cl, work, "part2", {"mode": "part2", "plan": "zero3", "ckpt": ckpt}))
    try:
        whole_logs, whole = results(work, full)
        p1 = [json.load(open(f"{work}/part1-{r}.json")) for r in range(RANKS)]
        p2_logs, p2 = results(work, "part2")
        saved = torch.load(f"{work}/part1-0-saved.pt")
    except OSError as e:
        check(False, f"resume: results missing ({e})")
        return
    lrs = p1[0]["lr"] + p2_logs[0]["lr"]
    check(p2_logs[0]["start"] == 3 and
          all(abs(a - b) <= 1e-7 * abs(b) for x, y in zip(lrs, ref_lrs) for a, b in zip(x, y))
          and len(lrs) == STEPS and lrs == whole_logs[0]["lr"],
          f"resume with the scheduler: each step's lr is the uninterrupted run's:\n {lrs}\n "
          f"{whole_logs[0]['lr']}")
    check(all(p1[r]["loss"] + p2_logs[r]["loss"] == whole_logs[r]["loss"] for r in range(RANKS)),
          "resume: every rank's per-step loss is bitwise the uninterrupted run's")
    check(all(torch.equal(p2["params"][k], whole["params"][k]) for k in whole["params"]),
          "resume (zero3): the final parameters are bitwise the uninterrupted run's")
    sd = shard.checkpoint.load_state_dict(ckpt)
    back = GPT()
    try:
        back.load_state_dict(sd, strict=True)
        strict = True
    except RuntimeError as e:
        strict = str(e)
    check(strict is True, f"shard.checkpoint.load_state_dict of a tied GPT loads strictly: {strict}")
    check(sorted(sd) == sorted(saved) and all(torch.equal(sd[k], saved[k]) for k in saved),
          f"the checkpoint's state dict is full_state_dict at the save, bitwise: keys "
          f"{sorted(set(sd) ^ set(saved))}")
    check(back.lm_head.weight is back.wte.weight and torch.equal(back.lm_head.weight,
                                                                 saved["wte.weight"]),
          "the tied weight loaded is one tensor, the saved one")
    print(f"resume at step 3 with LambdaLR(last_epoch=2): lr {lrs[3][0]:.6g} in step 4 as "
          f"uninterrupted; parameters bitwise", flush=True)


def main():
    work = tempfile.mkdtemp(prefix="shardd-torchlife-")
    cl = Cluster(sys.argv[1], os.path.join(work, "cluster"), 2, 2)
    try:
        if cl.ok:
            ref_evals, ref_lrs = reference()
            job_end(cl, work)
            evaluation(cl, work, ref_evals)
            resume(cl, work, ref_lrs)
    finally:
        cl.stop()
    finish("test_torch_life", work)


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[3] == "--worker":
        worker(json.loads(sys.argv[4]))
    else:
        main()
