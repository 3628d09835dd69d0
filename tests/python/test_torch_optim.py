#!/usr/bin/env python3
"""shard.torch steps as torch.optim does, against single-process torch on the same global batch,
on a 2-node x 2-rank emulated cluster of real daemons (tools/local-cluster.sh):

  - a small GPT (blocks in a ModuleList, lm_head tied to the token embedding, a frozen position
    embedding, an adapter that the forward takes only in even steps), AdamW with two param
    groups (no weight decay on biases and LayerNorm), a warm-up + cosine LambdaLR schedule,
    clipping at 1.0, accumulation 2, 10 steps, under zero3, mics:2 and topo:1/2/4 (per-state
    factors): each step's loss (the mean of the ranks' losses) within 1e-5 relative of the
    reference's, and every parameter allclose (rtol 1e-5, atol 1e-6) to the reference's at the
    end. The reference steps with zero_grad(set_to_none=True), as torch >= 2.0 does by default:
    the adapter is not updated in odd steps (its moments and step count stay), nor is the
    frozen embedding ever. Under zero3 the torch AdamW built before wrap is stepped and
    scheduled itself; under mics:2 shard.torch.optimizer(model) is; under topo:1/2/4
    shard.torch.step() with a scheduler on the optimizer object;
  - SGD with momentum and a StepLR schedule, groups given as the optimizer dict's param_groups
    by parameter name, a block frozen after wrap from step 4 on (mics:2);
  - torch.optim.Adam (weight decay added to the gradient; zero3) and SGD(nesterov=True)
    (topo:1/2/4), the torch optimizers given to wrap, each saved with shard.torch.save after
    step 5 and resumed in a new job (new model, optimizer and schedule, wrap(load=)): the same
    checks as AdamW's (Adam: at most one element in 10^4 outside that band, none beyond 3e-5:
    Adam's step divides by the gradient's own root), and shardctl jobs names the optimizer;
  - optimizers shardd does not run, run by the ranks on their own shards at each step's
    hand-off: torch.optim.Adadelta (mics:2) and RMSMomentum, an Optimizer subclass written here
    (two states, an int step; topo:1/2/4), saved and resumed the same way, the same checks
    (shardctl jobs names them trainer2); RMSMomentum through torch's own state dicts below;
  - torch's own state dicts: single-process AdamW (zero3, topo:1/2/4) and SGD with momentum
    (mics:2) runs
    save {"model": model.state_dict(), "optimizer": optimizer.state_dict()} after step 5 (as
    nanoGPT's checkpoint); a job that trained 5 steps on other data loads both with the model's
    and the optimizer's load_state_dict on every rank: full_state_dict right after is the
    loaded one bitwise (gathered across the nodes), no key missing or unexpected, the groups'
    lr the loaded ones, and the 5 steps after end as the reference's (the same checks); two
    steps after the load rank 0 alone (the other ranks in the next step meanwhile) takes
    optimizer.state_dict(): torch's layout, the parameters with state, the param groups as
    torch's own state_dict after the same steps, each state within 1e-4 of its largest element;
    after the last step, once every other rank detached, rank 0 reads the optimizer state and
    the full state dict again: the same, bitwise;
  - zeropp saved with torch's state dicts before step 5 by rank 0 alone and resumed from them
    in a new job: the steps after are the uninterrupted run's, bitwise (the dicts hold the fp32
    masters, not the int8-gathered weights);
  - full_state_dict has the tied weight under both names, and loads into an unwrapped model;
  - shardctl's jobs document shows each group's current lr (the schedule's last value);
  - memory: a model of 8 units, 1 MiB of gradient each: during backward the process's heap in
    use (glibc mallinfo2) grows by less than 3 MiB through shardd (each unit's gradients are
    released once pushed) and by at least 90% of the 8 MiB of all gradients without it;
  - per-step hyperparameters that the ranks disagree on (rank 1's lr) fail that step on every
    rank with EMISMATCH, naming the group on rank 1's node and that node elsewhere, and the job
    goes on (the next step is taken);
  - rank 0 alone reads full_state_dict in step 5 and at the end (fetches outside the schedule)
    without failing the job or changing what the other ranks compute;
  - BatchNorm (mics:2, AdamW, accumulation 2): every step sets every rank's buffers (running
    mean and variance, num_batches_tracked) to rank 0's, as DDP's broadcast_buffers does before
    each forward; the reference is single-process torch that runs each rank's micro-batch
    through the model separately (BatchNorm normalizes over the rank's own batch) and keeps
    the running statistics of rank 0's micro-batches alone, as DDP does. Losses within 1e-5,
    parameters and buffers allclose on every rank, the ranks' buffers bitwise equal, and the
    eval output the same on every rank; with broadcast_buffers=False the ranks' buffers differ.

Skipped (exit 77, with the reason) where PyTorch cannot be imported.
usage: test_torch_optim.py SHARDD LIBSHARD
"""
import ctypes
import functools
import json
import os
import sys
import tempfile
import time

import harness
from harness import Cluster, check, finish, run_all, shard, torch

import shard.torch as st  # noqa: E402

nn = torch.nn
VOCAB, CTX, D, RANKS, SEQS, ACCUM, STEPS = 32, 8, 16, 4, 2, 2, 10


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 2 * D)
        self.proj = nn.Linear(2 * D, D)

    def forward(self, h):
        return h + self.proj(torch.relu(self.fc(self.ln(h))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(CTX, D)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.adapter = nn.Linear(D, D)
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.wpe.weight.requires_grad_(False)  # frozen
        self.take_adapter = True

    def forward(self, idx):
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            h = b(h)
        if self.take_adapter:
            h = h + self.adapter(h)
        return self.lm_head(self.ln_f(h))


def model():
    torch.manual_seed(0)
    return GPT()


def groups(m, names=False):
    """AdamW's usual two groups: weight decay on matrices only"""
    decay = [n if names else p for n, p in m.named_parameters() if p.dim() >= 2]
    rest = [n if names else p for n, p in m.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


# the schedule, the global micro-batch (RANKS * SEQS sequences) and the loss (harness)
warmup_cosine = functools.partial(harness.warmup_cosine, steps=STEPS)
data = functools.partial(harness.lm_batch, rows=RANKS * SEQS, ctx=CTX, vocab=VOCAB)
loss_of = functools.partial(harness.lm_loss, vocab=VOCAB)


class RMSMomentum(torch.optim.Optimizer):
    """an optimizer of the user's own (shardd knows nothing of it): momentum on the gradient
    divided by the root of its bias-corrected running square, decoupled weight decay; a
    plain int step count, two per-element states"""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                s = self.state[p]
                if not s:
                    s["step"], s["sq"] = 0, torch.zeros_like(p)
                    s["mom"] = torch.zeros_like(p)
                s["step"] += 1
                s["sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                root = (s["sq"] / (1 - b2 ** s["step"])).sqrt_().add_(g["eps"])
                s["mom"].mul_(b1).add_(p.grad / root)
                p.mul_(1 - g["lr"] * g["weight_decay"]).add_(s["mom"], alpha=-g["lr"])


def build_opt(kind, m):
    """the optimizer of kind and its schedule"""
    if kind in ("adamw", "adam"):
        o = (torch.optim.AdamW if kind == "adamw" else torch.optim.Adam)(groups(m), lr=3e-2)
    elif kind == "adadelta":  # (mnist's; run by the ranks on their shards)
        o = torch.optim.Adadelta(groups(m), lr=1.0)
    elif kind == "custom":
        o = RMSMomentum(groups(m), lr=1e-2)
    else:
        o = torch.optim.SGD(groups(m), lr=5e-2, momentum=0.9, nesterov=kind == "nesterov")
    return o, schedule(kind, o)


def schedule(kind, o, last_epoch=-1):
    """kind's schedule on o (last_epoch: a resumed one's)"""
    if kind in ("adamw", "adam"):
        return torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine, last_epoch=last_epoch)
    return torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5, last_epoch=last_epoch)


def before_step(kind, m, step):
    m.take_adapter = step % 2 == 0
    if kind == "sgd" and step == 4:
        m.blocks[0].fc.weight.requires_grad_(False)


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        # no bias before the norm (it would cancel it: its gradient is rounding noise, which
        # AdamW turns into full steps in any direction)
        self.fc1 = nn.Linear(8, 16, bias=False)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


BN_STEPS, BN_SEQS = 6, 8


def bn_data(step, micro):
    g = torch.Generator().manual_seed(500 + 10 * step + micro)
    x = torch.randn(RANKS * BN_SEQS, 8, generator=g) * (1 + micro)  # the batches' statistics differ
    return x, torch.randn(RANKS * BN_SEQS, 4, generator=g)


def bn_loss(m, x, y):
    return ((m(x) - y) ** 2).mean()


def bn_reference():
    """DDP's semantics in one process: each rank's micro-batch through the model on its own, the
    losses averaged; before each forward every rank has rank 0's buffers, and rank 0's own
    forward is the one that moves them"""
    torch.manual_seed(3)
    m = BNNet()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for step in range(BN_STEPS):
        total = 0.0
        for micro in range(ACCUM):
            x, y = bn_data(step, micro)
            start = {k: v.clone() for k, v in m.named_buffers()}
            after0 = None
            for r in range(RANKS):  # each backward before the buffers are set again
                with torch.no_grad():
                    for k, v in m.named_buffers():
                        v.copy_(start[k])
                lo, hi = r * BN_SEQS, (r + 1) * BN_SEQS
                loss = bn_loss(m, x[lo:hi], y[lo:hi]) / RANKS
                (loss / ACCUM).backward()
                total += loss.item() / ACCUM
                if r == 0:
                    after0 = {k: v.clone() for k, v in m.named_buffers()}
            with torch.no_grad():
                for k, v in m.named_buffers():
                    v.copy_(after0[k])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, m


def micro_steps(m, batch, loss, step, lo, hi):
    """one step's ACCUM micro-steps on this rank's rows [lo, hi) of the global batch: forward
    and backward; the step's loss"""
    total = 0.0
    for micro in range(ACCUM):
        x, y = batch(step, micro)
        loss_m = loss(m, x[lo:hi], y[lo:hi]) / ACCUM
        loss_m.backward()
        total += loss_m.item()
    return total


def launch(cl, work, tag, mode, args):
    """one worker process per rank (args: its dict, given the rank); their outputs"""
    cmds = []
    for r in range(RANKS):
        a = dict(args(r), socket=cl.socket(r // 2), job=tag, rank=r, out=f"{work}/{tag}-{r}")
        cmds.append([sys.executable, os.path.abspath(__file__), sys.argv[1], sys.argv[2], mode,
                     json.dumps(a)])
    outs = run_all(cmds, timeout=300)
    for r, (rc, out) in enumerate(outs):
        check(rc == 0, f"{tag} rank {r} exit code {rc}:\n{out}")
    return outs


def bn_worker(a):
    torch.manual_seed(3)
    m = BNNet()
    st.wrap(m, socket=a["socket"], job=a["job"], rank=a["rank"], world=RANKS, plan="mics:2",
            optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2),
            broadcast_buffers=a["broadcast"])
    opt = st.optimizer(m)
    lo, hi = a["rank"] * BN_SEQS, (a["rank"] + 1) * BN_SEQS
    losses = []
    for step in range(BN_STEPS):
        losses.append(micro_steps(m, bn_data, bn_loss, step, lo, hi))
        opt.step()
    m.eval()
    with torch.no_grad():
        out = m(bn_data(99, 0)[0][:4])
    sd = st.full_state_dict(m)
    torch.save({"params": sd, "eval": out, "losses": losses}, a["out"] + ".pt")
    with open(a["out"] + ".json", "w") as f:
        json.dump({"loss": losses}, f)
    st.unwrap(m)


def batchnorm(cl, work):
    ref_losses, ref = bn_reference()
    ref_sd = ref.state_dict()
    ref.eval()
    with torch.no_grad():
        ref_out = ref(bn_data(99, 0)[0][:4])
    for broadcast in (True, False):
        tag = "bn" if broadcast else "bn-own"
        launch(cl, work, tag, "--bn-worker", lambda r: {"broadcast": broadcast})
        try:
            res = [torch.load(f"{work}/{tag}-{r}.pt") for r in range(RANKS)]
        except OSError as e:
            check(False, f"{tag}: results missing ({e})")
            continue
        bufs = [k for k, _ in ref.named_buffers()]
        same = all(torch.equal(res[r]["params"][k], res[0]["params"][k])
                   for r in range(RANKS) for k in bufs)
        if not broadcast:
            check(not same, "broadcast_buffers=False: the ranks' running statistics differ")
            continue
        losses = [sum(x["losses"][s] for x in res) / RANKS for s in range(BN_STEPS)]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        check(worst <= 1e-5, f"BatchNorm: per-step loss vs DDP's semantics: worst {worst:.3g}")
        maxd = max((res[r]["params"][k].double() - ref_sd[k].double()).abs().max().item()
                   for r in range(RANKS) for k in ref_sd)
        check(all(torch.allclose(res[r]["params"][k].double(), ref_sd[k].double(), rtol=1e-5,
                                 atol=1e-6) for r in range(RANKS) for k in ref_sd),
              f"BatchNorm: parameters and buffers of every rank vs the reference: max |diff| "
              f"{maxd:.3g}")
        check(same, "BatchNorm: every rank's buffers are rank 0's (bitwise)")
        check(int(res[1]["params"]["bn.num_batches_tracked"]) == BN_STEPS * ACCUM,
              f"num_batches_tracked (int64) broadcast: "
              f"{int(res[1]['params']['bn.num_batches_tracked'])}")
        evald = max((res[r]["eval"] - ref_out).abs().max().item() for r in range(RANKS))
        check(all(torch.equal(res[r]["eval"], res[0]["eval"]) for r in range(RANKS)) and
              evald <= 1e-5, f"BatchNorm: the eval output is the same on every rank and "
              f"the reference's within {evald:.3g}")
        print(f"BatchNorm, buffers broadcast from rank 0: loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}, worst relative difference {worst:.2e}, parameters and "
              f"buffers max |diff| {maxd:.2e}, eval max |diff| {evald:.2e}", flush=True)


RESUME_AT = 5  # Adam and Nesterov's SGD: saved after this many steps and resumed


def reference(kind, keep=None):
    """single-process torch on the global batch: per-step losses, final parameters; keep: a
    path where torch.save puts {"model", "optimizer"} state dicts after RESUME_AT steps"""
    m = model()
    opt, sched = build_opt(kind, m)
    losses = []
    for step in range(STEPS):
        if keep is not None and step == RESUME_AT:
            torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, keep)
        if keep is not None and step == RESUME_AT + 2:
            torch.save(opt.state_dict(), keep + ".later")
        before_step(kind, m, step)
        total = micro_steps(m, data, loss_of, step, 0, RANKS * SEQS)  # every rank's rows
        if kind == "adamw":
            torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.grad is not None],
                                           1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(total)
    return losses, m.state_dict()


def worker(a):
    """one rank through shardd"""
    m = model()
    kind = "sgd" if a["form"] == "dict" else "adamw"
    if a["form"].startswith("torchsd-"):  # torch's own state dicts loaded into a running job
        return torchsd_worker(a, m, a["form"][len("torchsd-"):])
    if a["form"].startswith("torch-"):  # Adam, Nesterov's SGD: saved and resumed mid-run
        kind = a["form"][len("torch-"):]
        opt, sched = build_opt(kind, m)
        st.wrap(m, socket=a["socket"], job=a["job"], rank=a["rank"], world=RANKS,
                plan=a["plan"], optimizer=opt)
    elif a["form"] == "dict":  # SGD: the groups as the optimizer dict's, by name
        spec = {"name": "sgd", "lr": 5e-2, "momentum": 0.9, "param_groups": groups(m, True)}
        st.wrap(m, socket=a["socket"], job=a["job"], rank=a["rank"], world=RANKS,
                plan=a["plan"], optimizer=spec)
        opt = st.optimizer(m)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    else:
        torch_opt, _ = build_opt("adamw", m)
        st.wrap(m, socket=a["socket"], job=a["job"], rank=a["rank"], world=RANKS,
                plan=a["plan"], optimizer=torch_opt, max_grad_norm=1.0)
        opt = torch_opt if a["form"] == "torch" else st.optimizer(m)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    lo, hi = a["rank"] * SEQS, (a["rank"] + 1) * SEQS
    losses, errors = [], []
    for step in range(STEPS):
        before_step(kind, m, step)
        total = micro_steps(m, data, loss_of, step, lo, hi)
        if a["form"] == "step":
            st.step(m)
        else:
            opt.step()
            opt.zero_grad()
        sched.step()
        losses.append(total)
        if a["form"].startswith("torch-") and step + 1 == RESUME_AT:
            # every rank: a checkpoint, a new process's state (model, optimizer, schedule), and
            # a new job that resumes it: the optimizer's moments or momentum carry on
            ck = f"{a['out'].rsplit('-', 1)[0]}-ck"
            st.save(ck, m)
            st.unwrap(m)
            m = model()
            opt, _ = build_opt(kind, m)
            st.wrap(m, socket=a["socket"], job=a["job"] + "-resumed", rank=a["rank"],
                    world=RANKS, plan=a["plan"], optimizer=opt, load=ck)
            assert st.start_step(m) == RESUME_AT, f"resumed at step {st.start_step(m)}"
            sched = schedule(kind, opt, last_epoch=RESUME_AT - 1)
        if a["rank"] == 0 and step == 4:  # rank 0 alone reads the weights mid-training
            mid = st.full_state_dict(m)
            check_mid = all(torch.isfinite(v).all() for v in mid.values())
            assert check_mid, "a mid-training full_state_dict is finite"
    out = {"loss": losses, "errors": errors}
    if a["rank"] == 0:
        out["jobs"] = shard.admin("jobs", a["job"], socket=a["socket"])
        torch.save(st.full_state_dict(m), a["out"] + ".pt")
    if a.get("disagree"):  # rank 1 gives another lr: the step fails everywhere, then goes on
        x, y = data(0, 0)
        loss_of(m, x[lo:hi], y[lo:hi]).backward()
        if a["rank"] == 1:
            opt.param_groups[1]["lr"] += 1e-3  # (the schedule ends at lr 0)
        try:
            opt.step()
            errors.append("no error")
        except shard.ShardError as e:
            errors.append([e.status, e.message])
        if a["rank"] == 1:
            opt.param_groups[1]["lr"] -= 1e-3
        loss_of(m, x[lo:hi], y[lo:hi]).backward()
        opt.step()
    with open(a["out"] + ".json", "w") as f:
        json.dump(out, f)
    st.unwrap(m)


def torchsd_worker(a, m, kind):
    """a job that trains RESUME_AT steps on other data, then loads single-process torch's
    state dicts of that step (a torch.save of {"model": model.state_dict(), "optimizer":
    optimizer.state_dict()}, as nanoGPT's resume reads them) with the model's and the
    optimizer's load_state_dict on every rank, and goes on with the reference's data"""
    opt, sched = build_opt(kind, m)
    st.wrap(m, socket=a["socket"], job=a["job"], rank=a["rank"], world=RANKS, plan=a["plan"],
            optimizer=opt, max_grad_norm=1.0 if kind == "adamw" else None)
    lo, hi = a["rank"] * SEQS, (a["rank"] + 1) * SEQS
    other = functools.partial(harness.lm_batch, rows=RANKS * SEQS, ctx=CTX, vocab=VOCAB)
    losses = []
    for step in range(STEPS):
        if step == RESUME_AT:
            ck = torch.load(a["keep"])
            keys = m.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            sched = schedule(kind, opt, last_epoch=RESUME_AT - 1)
            full = st.full_state_dict(m)  # (gathered across the nodes: the written weights)
            exact = all(torch.equal(full[k], v) for k, v in ck["model"].items())
            lr = [g["lr"] for g in opt.param_groups]
            want = [g["lr"] for g in ck["optimizer"]["param_groups"]]
        if a["rank"] == 0 and step == RESUME_AT + 2:  # rank 0 alone, as nanoGPT's checkpoint:
            # the others go on into the step, which waits for it
            torch.save(opt.state_dict(), a["out"] + ".osd")
        before_step(kind, m, step)
        batch = data if step >= RESUME_AT else (lambda s, mi: other(s + 100, mi))
        total = micro_steps(m, batch, loss_of, step, lo, hi)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(total)
    out = {"loss": losses, "errors": [], "exact": exact, "keys": list(keys),
           "lr": [lr, want]}
    if a["rank"] == 0:
        torch.save(st.full_state_dict(m), a["out"] + ".pt")
        # the job's state read again once every other rank detached (the job closing, node 1
        # waiting for node 0's ranks to leave): the same, bitwise
        early = opt.state_dict()
        gone = [a["out"][:-1] + f"{r}.gone" for r in range(1, RANKS)]
        end = time.monotonic() + 60
        while not all(os.path.exists(g) for g in gone) and time.monotonic() < end:
            time.sleep(0.05)
        try:
            late, full = opt.state_dict(), st.full_state_dict(m)
            out["late"] = (all(os.path.exists(g) for g in gone) and
                           all(torch.equal(torch.as_tensor(late["state"][i][k]),
                                           torch.as_tensor(t))
                               for i, s in early["state"].items() for k, t in s.items()) and
                           all(torch.equal(full[k], v) for k, v in
                               torch.load(a["out"] + ".pt").items()))
        except shard.ShardError as e:
            out["late"] = str(e)
    with open(a["out"] + ".json", "w") as f:
        json.dump(out, f)
    st.unwrap(m)
    if a["rank"] != 0:
        open(a["out"][:-1] + f"{a['rank']}.gone", "w").close()


def quantized_worker(a):
    """zeropp through torch's own save and resume: the uninterrupted run's rank 0 saves
    {"model": model.state_dict(), "optimizer": optimizer.state_dict()} before step RESUME_AT
    (alone, as nanoGPT's checkpoint); the resumed run, a new job, loads both on every rank and
    trains the steps after"""
    m = model()
    opt, sched = build_opt("adamw", m)
    st.wrap(m, socket=a["socket"], job=a["job"], rank=a["rank"], world=RANKS, plan="zeropp",
            optimizer=opt, max_grad_norm=1.0)
    first = 0
    if a["resume"]:
        ck = torch.load(a["keep"])
        m.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched, first = schedule("adamw", opt, last_epoch=RESUME_AT - 1), RESUME_AT
    lo, hi = a["rank"] * SEQS, (a["rank"] + 1) * SEQS
    losses = []
    for step in range(first, STEPS):
        if not a["resume"] and step == RESUME_AT and a["rank"] == 0:
            torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, a["keep"])
        before_step("adamw", m, step)
        losses.append(micro_steps(m, data, loss_of, step, lo, hi))
        opt.step()
        opt.zero_grad()
        sched.step()
    if a["rank"] == 0:
        torch.save(st.full_state_dict(m), a["out"] + ".pt")
    with open(a["out"] + ".json", "w") as f:
        json.dump({"loss": losses}, f)
    st.unwrap(m)


def quantized_resume(cl, work):
    """zeropp (int8 weights and gradients on the wire) saved with torch's state dicts mid-run and
    resumed in a new job: the state dicts hold the fp32 masters (not the int8-gathered weights),
    AdamW's moments and the step counts exactly, and zeropp's int8 copies are made from them
    deterministically, so the steps after are the uninterrupted run's, bitwise"""
    keep = f"{work}/zeropp-sd.pt"
    runs = {}
    for tag, resume in (("zeropp-run", False), ("zeropp-resumed", True)):
        launch(cl, work, tag, "--zq-worker", lambda r: {"keep": keep, "resume": resume})
        try:
            logs = [json.load(open(f"{work}/{tag}-{r}.json")) for r in range(RANKS)]
            runs[tag] = ([sum(lg["loss"][s] for lg in logs) / RANKS
                          for s in range(len(logs[0]["loss"]))], torch.load(f"{work}/{tag}-0.pt"))
        except OSError as e:
            check(False, f"{tag}: results missing ({e})")
            return
    (la, pa), (lb, pb) = runs["zeropp-run"], runs["zeropp-resumed"]
    worst = max(abs(x - y) / abs(x) for x, y in zip(la[RESUME_AT:], lb))
    maxd = max((pa[k] - pb[k]).abs().max().item() for k in pa)
    check(len(lb) == STEPS - RESUME_AT and la[RESUME_AT:] == lb and
          all(torch.equal(pa[k], pb[k]) for k in pa),
          f"zeropp resumed from torch's state dicts after step {RESUME_AT}: the steps after "
          f"are the uninterrupted run's bitwise (losses within {worst:.2e} relative, parameters "
          f"max |diff| {maxd:.2e})")
    print(f"zeropp resumed from torch's state dicts: losses within {worst:.2e} relative of the "
          f"uninterrupted run, parameters max |diff| {maxd:.2e}", flush=True)


def torchsd(cl, work, kind, plan):
    """torch's state dicts loaded into a running job (torchsd_worker) against the reference"""
    keep = f"{work}/ref-{kind}.pt"
    ref_losses, ref_params = reference(kind, keep=keep)
    tag = f"torchsd-{kind}-" + plan.replace(":", "").replace("/", "")
    got = run(cl, work, tag, plan, f"torchsd-{kind}", keep=keep)
    if got[0] is None:
        return
    losses, params, logs = got
    for r, lg in enumerate(logs):
        check(lg["exact"] and lg["keys"] == [[], []] and lg["lr"][0] == lg["lr"][1],
              f"{tag} rank {r}: after model.load_state_dict the full state dict is the loaded one "
              f"bitwise, no key missing or unexpected, the groups' lr the loaded ones: "
              f"{lg['exact']} {lg['keys']} {lg['lr']}")
    check(logs[0].get("late") is True,
          f"{tag}: rank 0 reads the optimizer state and the full state dict again after the "
          f"other ranks detached, bitwise as before: {logs[0].get('late')}")
    compare(f"{tag} ({plan}, loaded after step {RESUME_AT} of another run)",
            (losses[RESUME_AT:], params, logs), (ref_losses[RESUME_AT:], ref_params))
    # optimizer.state_dict() of rank 0 alone after 2 more steps, against torch's own
    try:
        got, want = torch.load(f"{work}/{tag}-0.osd"), torch.load(keep + ".later")
    except OSError as e:
        check(False, f"{tag}: optimizer.state_dict() missing ({e})")
        return
    same_keys = (sorted(got["state"]) == sorted(want["state"]) and
                 all(sorted(got["state"][i]) == sorted(want["state"][i]) for i in want["state"]))
    worst = 0.0
    for i, ws in (want["state"].items() if same_keys else []):
        for name, w in ws.items():
            g = got["state"][i][name]
            if name == "step":
                worst = max(worst, float(g != w))
                continue
            scale = w.abs().max().item() or 1.0
            worst = max(worst, (g - w).abs().max().item() / scale)
    groups_ok = all({k: v for k, v in gg.items() if k != "params"} ==
                    {k: v for k, v in wg.items() if k != "params"} and gg["params"] == wg["params"]
                    for gg, wg in zip(got["param_groups"], want["param_groups"]))
    check(same_keys and groups_ok and worst <= 1e-4,
          f"{tag}: optimizer.state_dict() of rank 0 alone (the others in the next step) has "
          f"torch's layout, parameters, states and groups, each state within 1e-4 of its largest "
          f"element of torch's (worst {worst:.2e}; keys {same_keys}, groups {groups_ok})")
    print(f"{tag}: optimizer.state_dict() of rank 0 alone vs torch's: worst {worst:.2e} of the "
          f"largest element, {len(want['state'])} parameters with state", flush=True)


def run(cluster, work, tag, plan, form, disagree=False, keep=None):
    launch(cluster, work, tag, "--worker",
           lambda r: {"plan": plan, "form": form, "disagree": disagree, "keep": keep})
    try:
        logs = [json.load(open(f"{work}/{tag}-{r}.json")) for r in range(RANKS)]
        params = torch.load(f"{work}/{tag}-0.pt")
    except OSError as e:
        check(False, f"{tag}: results missing ({e})")
        return None, None
    losses = [sum(lg["loss"][s] for lg in logs) / RANKS for s in range(STEPS)]
    return (losses, params, logs)


def compare(tag, got, ref, loose=None):
    """got (a run through shardd) vs ref (single-process torch): losses within 1e-5 relative,
    every parameter allclose (rtol 1e-5, atol 1e-6); with loose, a few elements (at most one
    in 10^4) may be outside that band but none beyond atol=loose"""
    losses, params, _ = got
    ref_losses, ref_params = ref
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    check(worst <= 1e-5, f"{tag}: per-step loss vs single-process torch: worst relative {worst:.3g}")
    check(sorted(params) == sorted(ref_params), f"{tag}: full_state_dict has torch's keys "
          f"(the tied weight under both names): {sorted(set(params) ^ set(ref_params))}")
    maxd, outside, numel = 0.0, 0, 0
    for k in ref_params:
        if k in params:
            maxd = max(maxd, (params[k] - ref_params[k]).abs().max().item())
            outside += int((~torch.isclose(params[k], ref_params[k], rtol=1e-5,
                                           atol=1e-6)).sum())
            numel += ref_params[k].numel()
    if loose is None:
        check(outside == 0, f"{tag}: {outside} parameters not allclose, max |diff| {maxd:.3g}")
    else:
        check(outside <= max(1, numel // 10000) and maxd <= loose,
              f"{tag}: {outside} of {numel} parameters not allclose (at most one in 10^4), "
              f"max |diff| {maxd:.3g} (at most {loose:g})")
    print(f"{tag}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, worst relative difference "
          f"{worst:.2e}, parameters max |diff| {maxd:.2e}", flush=True)
    return maxd


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def heap_in_use():
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    mi = libc.mallinfo2()
    return mi.uordblks + mi.hblkhd


def backward_growth(m, wrapped):
    """the heap's growth from before backward to its peak during it (sampled as each parameter's
    gradient arrives, and at the end)"""
    x = torch.randn(4, 512)
    loss = m(x).square().mean()
    base = heap_in_use()
    peak = [base]

    def sample(g):
        peak[0] = max(peak[0], heap_in_use())
    hooks = [p.register_hook(sample) for p in m.parameters()]
    loss.backward()
    peak[0] = max(peak[0], heap_in_use())
    for h in hooks:
        h.remove()
    if wrapped:
        st.step(m)
    return peak[0] - base


def memory(shardd, work):
    """on a daemon of its own: one rank"""
    import subprocess
    import time
    rdir = os.path.join(work, "single")
    os.makedirs(rdir)
    sock = os.path.join(rdir, "shardd.sock")
    daemon = subprocess.Popen([shardd, "--runtime-dir", rdir, "--log-level", "warn"])
    for _ in range(200):
        if os.path.exists(sock):
            break
        time.sleep(0.05)
    try:
        measure_memory(sock)
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


def measure_memory(sock):
    def net():
        torch.manual_seed(1)
        return nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(8)])
    full = 8 * 512 * 512 * 4
    plain = net()
    backward_growth(plain, False)  # warm the allocator up
    for p in plain.parameters():
        p.grad = None
    grow_plain = backward_growth(plain, False)
    m = st.wrap(net(), socket=sock, job="memory", rank=0, world=1, plan="zero3")
    backward_growth(m, True)
    grow = backward_growth(m, True)
    st.unwrap(m)
    check(grow_plain >= 0.9 * full, f"without shardd backward holds every gradient: "
          f"{grow_plain / 2**20:.1f} MiB (the measure sees them)")
    check(grow < 3 * 2**20, f"through shardd each unit's gradients go once pushed: backward grew "
          f"the heap by {grow / 2**20:.2f} MiB of {full / 2**20:.0f} MiB of gradients")
    print(f"memory: backward grows the heap by {grow / 2**20:.2f} MiB through shardd, "
          f"{grow_plain / 2**20:.2f} MiB without (8 MiB of gradients)", flush=True)


def main():
    work = tempfile.mkdtemp(prefix="shardd-torchopt-")
    cl = Cluster(sys.argv[1], os.path.join(work, "cluster"), 2, 2)
    try:
        if cl.ok:
            ref = reference("adamw")
            for tag, plan, form in (("zero3", "zero3", "torch"), ("mics2", "mics:2", "shard"),
                                    ("topo", "topo:1/2/4", "step")):
                got = run(cl, work, tag, plan, form, disagree=(tag == "mics2"))
                if got[0] is None:
                    continue
                compare(tag, got, ref)
                if tag == "mics2":
                    for r, lg in enumerate(got[2]):  # ranks 0 and 1 share node 0
                        e = lg["errors"]
                        words = ["group 1", "lr"] if r < 2 else ["node 0", "hyperparameters"]
                        check(len(e) == 1 and e[0][0] == shard.EMISMATCH and
                              all(w in e[0][1] for w in words), f"rank {r}: hyperparameters "
                              f"that differ between ranks fail the step naming {words}: {e}")
                if tag == "zero3":
                    job = got[2][0]["jobs"]["jobs"][0]["optimizer"]
                    want = 3e-2 * warmup_cosine(STEPS - 1)
                    lrs = [g["lr"] for g in job["groups"]]
                    check(job["name"] == "adamw" and len(lrs) == 2 and
                          all(abs(x - want) <= 1e-6 * want for x in lrs) and
                          job["groups"][0]["weight_decay"] == torch.tensor(0.1).item(),
                          f"jobs shows the groups' last lr {want:.6g}: {job}")
                    back = GPT()
                    back.load_state_dict(got[1])
                    check(torch.equal(back.lm_head.weight, got[1]["wte.weight"]),
                          "the full state dict loads into an unwrapped model")
            sgd_ref = reference("sgd")
            got = run(cl, work, "sgd", "mics:2", "dict")
            if got[0] is not None:
                compare("sgd", got, sgd_ref)
            # torch.optim.Adam (its weight decay in the gradient) and SGD(nesterov=True), run
            # by the daemon, each saved after step 5 and resumed in a new job
            # and optimizers the daemon does not run: Adadelta, and one written here, each run
            # by the ranks on their own shards at the step's hand-off
            for kind, plan in (("adam", "zero3"), ("nesterov", "topo:1/2/4"),
                               ("adadelta", "mics:2"), ("custom", "topo:1/2/4")):
                got = run(cl, work, kind, plan, "torch-" + kind)
                if got[0] is not None:
                    # Adam divides each moment by its own root: where the L2 term cancels the
                    # data gradient (g near 0), the fp32 sums' order (1e-7 relative of each
                    # term) is a relative error of the step itself, up to lr (3e-2) a step in
                    # principle; measured 5.3e-6 on one element of 3.7K, also without the
                    # resume and 2.5e-7 in one process (torch's lerp against b1 m + (1 - b1) g)
                    compare(f"{kind} (resumed at step {RESUME_AT})", got, reference(kind),
                            loose=3e-5 if kind == "adam" else None)
                    job = got[2][0]["jobs"]["jobs"][0]["optimizer"]
                    want = {"adam": "adam", "nesterov": "sgd-nesterov", "adadelta": "trainer2",
                            "custom": "trainer2"}[kind]
                    check(job["name"] == want, f"{kind}: shardctl jobs names it {job['name']}")
            # torch's own state dicts (single-process AdamW and SGD with momentum, after step
            # 5) loaded into running jobs through the model's and optimizer's load_state_dict
            torchsd(cl, work, "adamw", "zero3")
            torchsd(cl, work, "sgd", "mics:2")
            torchsd(cl, work, "adamw", "topo:1/2/4")
            torchsd(cl, work, "custom", "zero3")
            quantized_resume(cl, work)
            batchnorm(cl, work)
            memory(sys.argv[1], work)
    finally:
        cl.stop()
    finish("test_torch_optim", work)


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[3] == "--worker":
        worker(json.loads(sys.argv[4]))
    elif len(sys.argv) > 4 and sys.argv[3] == "--bn-worker":
        bn_worker(json.loads(sys.argv[4]))
    elif len(sys.argv) > 4 and sys.argv[3] == "--zq-worker":
        quantized_worker(json.loads(sys.argv[4]))
    else:
        main()
