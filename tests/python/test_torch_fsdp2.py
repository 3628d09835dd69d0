#!/usr/bin/env python3
"""shardd beside PyTorch's FSDP2 (fully_shard on gloo, CPU), the independent reference a user
would pick instead, on a 2-node x 2-rank emulated cluster of real daemons:

  - the same training three ways: a small GPT (lm_head tied to the token embedding, two
    blocks), AdamW with two param groups (no weight decay on vectors), a warm-up + cosine
    LambdaLR, clipping at 1.0, accumulation 2, 20 steps, one global batch: FSDP2 at world 4
    (fully_shard per block and on the root, set_requires_gradient_sync(False) on the micro-steps
    before the last, clip_grad_norm_ on the DTensor gradients), shardd zero3 and mics:2 at
    world 4, and one plain process. Tolerance: the three differ only in the order the
    gradients' fp32 sums are taken (over ranks and micro-steps), a relative 4 u = 4.8e-7 of each
    gradient element per step (u = 2^-24); AdamW turns the moments' ratio into the update, which
    is then off by about that relative amount of lr (3e-2 at most) per step: over 20 steps
    20 x 3e-2 x 4.8e-7 = 2.9e-7 for the bulk of the elements. Where an element's gradient is
    not much larger than its rounding, the ratio itself moves by more; such elements are few and
    AdamW's moments damp them. The test asserts allclose(rtol=1e-4, atol=2e-6) (atol 7x the
    bulk bound) for each pair, and that shardd's distance to FSDP2 is within 4x the band of
    FSDP2's to the single process (measured 2026-11-28, torch 2.15: 1.7e-6 and 2.0e-6);
  - checkpoints both ways: shardd's (mics:2, world 4, after step 10) through
    shard.dcp.from_shardd, then dcp.load into FSDP2 at world 2 (2 shards per tensor where the
    save had 4 ranks): the weights and AdamW's exp_avg, exp_avg_sq and step equal the shardd
    checkpoint's bitwise; FSDP2's dcp.save (world 4, after step 10) through shard.dcp.to_shardd,
    then shardd zero3 at world 2 resumes it (its scheduler from start_step) and trains steps
    11..20: equal to FSDP2's run continuing within the tolerance above;
  - client/examples/fsdp2_train.py, a typical FSDP2 script (bf16 MixedPrecisionPolicy,
    accumulation without sync, clipping, DCP), and the same file with --shardd (the README's
    list of changes): rank 0's losses per step within 2e-2 relative (bf16 compute), both learn;
  - refusals: a truncated chunk file, a .metadata that names a class DCP's metadata never holds
    (it is not run), a model whose shape differs, a shardd checkpoint given as a DCP directory,
    and wrap(load=) of a DCP directory: each a clear error naming the file or tensor.

Skipped (exit 77, with the reason) where PyTorch or FSDP2 (torch >= 2.6) cannot be imported.
usage: test_torch_fsdp2.py SHARDD LIBSHARD
"""
import functools
import json
import os
import pickle
import socket as _socket
import sys
import tempfile

import harness
from harness import Cluster, check, finish, raises, run_all, shard, torch

import shard.torch as st  # noqa: E402
from shard import dcp as sdcp  # noqa: E402

try:
    from torch.distributed.fsdp import fully_shard
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
except ImportError as e:
    print(f"SKIP: FSDP2 cannot be imported from torch {torch.__version__} ({e}); "
          "tools/torch-venv.sh installs torch 2.x")
    sys.exit(77)

nn = torch.nn
VOCAB, CTX, D, SEQS, ACCUM, STEPS, SAVE_AT, LR = 64, 16, 32, 4, 2, 20, 10, 3e-2
RANKS = 4  # the global batch: RANKS * SEQS sequences a micro-step, whatever the world
RTOL, ATOL = 1e-4, 2e-6


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, h):
        return h + self.proj(torch.nn.functional.gelu(self.fc(self.ln(h))))


class GPT(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(CTX, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx):
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            h = b(h)
        return self.lm_head(self.ln_f(h))


def model(d=D):
    torch.manual_seed(0)
    return GPT(d)


def optim(m):
    decay = [p for p in m.parameters() if p.dim() >= 2]
    rest = [p for p in m.parameters() if p.dim() < 2]
    o = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                           {"params": rest, "weight_decay": 0.0}], lr=LR)
    return o


# the schedule, the global micro-batch (RANKS * SEQS sequences) and the loss (harness)
warmup_cosine = functools.partial(harness.warmup_cosine, steps=STEPS)
data = functools.partial(harness.lm_batch, rows=RANKS * SEQS, ctx=CTX, vocab=VOCAB)
loss_of = functools.partial(harness.lm_loss, vocab=VOCAB)


def rows(rank, world):
    per = RANKS * SEQS // world
    return rank * per, (rank + 1) * per


def micro_steps(m, step, lo, hi, fsdp2=False):
    """one step's ACCUM forwards and backwards on rows [lo, hi) of the global batch (FSDP2:
    no gradient sync but on the last); the step's loss"""
    total = 0.0
    for micro in range(ACCUM):
        if fsdp2:
            m.set_requires_gradient_sync(micro == ACCUM - 1)
        x, y = data(step, micro)
        loss = loss_of(m, x[lo:hi], y[lo:hi]) / ACCUM
        loss.backward()
        total += loss.item()
    return total


def torch_step(m, o, sched):
    """clipping, the step, the schedule, the gradients dropped: as torch scripts do"""
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    o.step()
    sched.step()
    o.zero_grad(set_to_none=True)


# ---- the single process

def single():
    m = model()
    o = optim(m)
    sched = torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine)
    losses = []
    for step in range(STEPS):
        losses.append(micro_steps(m, step, 0, RANKS * SEQS))
        torch_step(m, o, sched)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, losses


# ---- FSDP2 workers (one process per rank, gloo)

def fsdp2_setup(a):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["port"]), RANK=str(a["rank"]),
                      WORLD_SIZE=str(a["world"]))
    dist.init_process_group("gloo")
    m = model()
    for b in m.blocks:
        fully_shard(b)
    fully_shard(m)
    o = optim(m)
    return dist, m, o


def full_states(m, o):
    """rank 0's full model and optimizer state dicts (FSDP2 gathers them)"""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(m, o, options=opts)
    return msd, osd


def fsdp2_worker(a):
    dist, m, o = fsdp2_setup(a)
    rank, world = a["rank"], a["world"]
    sched = torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine)  # before a load: DCP loads
    first = 0  # the entries the groups have (initial_lr among them)
    if a.get("load"):  # FSDP2's own resume: get_state_dict, dcp.load, set_state_dict
        msd, osd = get_state_dict(m, o)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=a["load"])
        set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"])
        first = a.get("first", STEPS)
    lo, hi = rows(rank, world)
    losses = []
    for step in range(first, a.get("steps", STEPS)):
        losses.append(micro_steps(m, step, lo, hi, fsdp2=True))
        torch_step(m, o, sched)
        if a.get("save") and step + 1 == SAVE_AT:
            msd, osd = get_state_dict(m, o)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=a["save"])
    msd, osd = full_states(m, o)
    with open(f"{a['out']}-{rank}.json", "w") as f:
        json.dump(losses, f)
    if rank == 0:
        torch.save({"params": msd, "optim": osd}, a["out"] + ".pt")
    dist.destroy_process_group()


# ---- shardd workers

def shard_worker(a):
    m = model()
    o = optim(m)
    st.wrap(m, socket=a["socket"], job=a["job"], rank=a["rank"], world=a["world"],
            plan=a["plan"], optimizer=o, max_grad_norm=1.0, ranks_per_node=a["k"],
            load=a.get("load"))
    first = st.start_step(m)
    sched = torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine, last_epoch=first - 1) \
        if first else torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine)
    lo, hi = rows(a["rank"], a["world"])
    losses = []
    for step in range(first, STEPS):
        losses.append(micro_steps(m, step, lo, hi))
        o.step()
        sched.step()
        if a.get("save") and step + 1 == SAVE_AT:
            st.save(a["save"], m)
    sd = st.full_state_dict(m)
    with open(f"{a['out']}-{a['rank']}.json", "w") as f:
        json.dump(losses, f)
    if a["rank"] == 0:
        torch.save({"params": sd, "first": first}, a["out"] + ".pt")
    st.unwrap(m)


def free_port():
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(work, tag, mode, world, args):
    """one process per rank; rank 0's results with "losses": each step's loss, the mean of the
    ranks' (the loss of the global batch); None where a rank failed"""
    port = free_port()
    cmds = []
    for r in range(world):
        a = dict(args(r), rank=r, world=world, port=port, job=tag, out=f"{work}/{tag}")
        cmds.append([sys.executable, os.path.abspath(__file__), sys.argv[1], sys.argv[2], mode,
                     json.dumps(a)])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outs = run_all(cmds, timeout=300, env=env)
    ok = True
    for r, (rc, out) in enumerate(outs):
        ok = ok and rc == 0
        check(rc == 0, f"{tag} rank {r} exit code {rc}:\n{out[-3000:]}")
    if not ok:
        return None
    res = torch.load(f"{work}/{tag}.pt", weights_only=False)
    per = []
    for r in range(world):
        with open(f"{work}/{tag}-{r}.json") as f:
            per.append(json.load(f))
    res["losses"] = [sum(x) / world for x in zip(*per)]
    return res


def dist(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def close(a, b):
    return all(torch.allclose(a[k].double(), b[k].double(), rtol=RTOL, atol=ATOL) for k in b)


def side_by_side(cl, work, ref):
    fs = launch(work, "fsdp2", "--fsdp2", 4, lambda r: {"save": f"{work}/dcp-fsdp2"})
    if fs is None:
        return None
    band = dist(fs["params"], ref)
    check(close(fs["params"], ref), f"FSDP2 vs one process: {band:.3g}")
    print(f"FSDP2 (world 4) vs one process: max |diff| {band:.3g}")
    for plan in ("zero3", "mics:2"):
        tag = "shard-" + plan.replace(":", "")
        extra = {"save": f"{work}/ck-shard"} if plan == "mics:2" else {}
        sh = launch(work, tag, "--shard", 4,
                    lambda r: dict(extra, socket=cl.socket(r // 2), plan=plan, k=2))
        if sh is None:
            continue
        d_fs, d_ref = dist(sh["params"], fs["params"]), dist(sh["params"], ref)
        print(f"shardd {plan} (world 4): vs FSDP2 {d_fs:.3g}, vs one process {d_ref:.3g}")
        check(close(sh["params"], fs["params"]) and close(sh["params"], ref),
              f"shardd {plan} vs FSDP2 {d_fs:.3g}, vs one process {d_ref:.3g}")
        check(d_fs <= 4 * max(band, ATOL), f"shardd {plan}: {d_fs:.3g} from FSDP2, outside 4x "
              f"the band of FSDP2 to one process ({band:.3g})")
        worst = max(abs(a - b) / abs(b) for a, b in zip(sh["losses"], fs["losses"]))
        check(worst <= 1e-4, f"shardd {plan}: per-step loss vs FSDP2: worst relative {worst:.3g}")
    return fs


def shard_to_fsdp2(work):
    """shardd's mics:2 checkpoint (world 4) -> DCP -> FSDP2 at world 2, bitwise"""
    out = f"{work}/dcp-from-shard"
    step = sdcp.from_shardd(f"{work}/ck-shard", out)
    check(step == SAVE_AT, f"from_shardd: step {step}, saved after {SAVE_AT}")
    fs = launch(work, "fsdp2-load", "--fsdp2", 2, lambda r: {"load": out, "first": STEPS})
    if fs is None:
        return
    want = shard.checkpoint.load_state_dict(f"{work}/ck-shard", optimizer_states=True)
    got_m, got_o = fs["params"], fs["optim"]
    names = [k for k in got_m]
    check(names and all(torch.equal(got_m[k], want[k]) for k in names),
          "shardd -> DCP -> FSDP2 (world 2): the weights differ from the checkpoint's: " +
          ", ".join(k for k in names if not torch.equal(got_m[k], want[k])))
    check("lm_head.weight" in got_m, "the tied lm_head.weight is in FSDP2's state dict")
    bad = []
    for k, s in got_o["state"].items():
        w = want["optimizer"][k]
        for n in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(s[n], w[n]):
                bad.append(f"{k}.{n}")
        if int(float(s["step"])) != SAVE_AT:
            bad.append(f"{k}.step={float(s['step'])}")
    check(len(got_o["state"]) == len([t for t in want["optimizer"]]) and not bad,
          f"shardd -> DCP -> FSDP2: optimizer states differ: {bad[:5]} "
          f"({len(got_o['state'])} states)")
    lrs = [g["lr"] for g in got_o["param_groups"]]
    check(all(abs(lr - LR * warmup_cosine(SAVE_AT)) < 1e-12 for lr in lrs),
          f"shardd -> DCP -> FSDP2: the groups' lr {lrs}, the schedule's at step {SAVE_AT} "
          f"{LR * warmup_cosine(SAVE_AT)}")


def fsdp2_to_shard(cl, work, fs):
    """FSDP2's dcp.save (world 4) -> shardd zero3 at world 2 resumes -> FSDP2's own run"""
    m = model()
    res = sdcp.to_shardd(f"{work}/dcp-fsdp2", f"{work}/ck-from-dcp", m, optim(m))
    check(res["step"] == SAVE_AT and res["buffers"] == {}, f"to_shardd: {res}")
    sh = launch(work, "shard-from-dcp", "--shard", 2,
                lambda r: {"socket": cl.socket(0), "plan": "zero3", "k": 2,
                           "load": f"{work}/ck-from-dcp"})
    if sh is None:
        return
    check(sh["first"] == SAVE_AT, f"shardd resumed at step {sh['first']}, not {SAVE_AT}")
    d = dist(sh["params"], fs["params"])
    print(f"FSDP2 save -> shardd (world 2, zero3) -> step {STEPS}: vs FSDP2 {d:.3g}")
    check(close(sh["params"], fs["params"]), f"FSDP2 -> shardd resume vs FSDP2 going on: {d:.3g}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(sh["losses"], fs["losses"][SAVE_AT:]))
    check(worst <= 1e-4, f"FSDP2 -> shardd resume: per-step loss vs FSDP2: worst {worst:.3g}")


def refusals(work):
    src = f"{work}/dcp-fsdp2"
    m = model()
    m48 = model(48)
    ok, msg = raises(lambda: sdcp.to_shardd(src, f"{work}/x1", m48, optim(m48)),
                     "wte.weight", "(64, 48)", "(64, 32)", kinds=(ValueError,))
    check(ok, f"a model of another width: {msg}")
    ok, msg = raises(lambda: sdcp.to_shardd(f"{work}/ck-shard", f"{work}/x2", m, optim(m)),
                     "shardd checkpoint, not a DCP", kinds=(ValueError,))
    check(ok, f"a shardd checkpoint as DCP: {msg}")
    ok, msg = raises(lambda: sdcp.to_shardd(f"{work}/nothing", f"{work}/x3", m, optim(m)),
                     "no .metadata", kinds=(ValueError,))
    check(ok, f"no checkpoint: {msg}")
    # a truncated chunk file
    bad = f"{work}/dcp-truncated"
    os.system(f"cp -r {src} {bad}")
    f = sorted(n for n in os.listdir(bad) if n.endswith(".distcp"))[-1]
    with open(f"{bad}/{f}", "r+b") as fh:
        fh.truncate(os.path.getsize(f"{bad}/{f}") // 2)
    ok, msg = raises(lambda: sdcp.to_shardd(bad, f"{work}/x4", m, optim(m)), f,
                     kinds=(ValueError,))
    check(ok and ("truncated" in msg or "corrupt" in msg), f"a truncated {f}: {msg}")
    # a .metadata that would run os.system when unpickled with pickle.load
    evil = f"{work}/dcp-evil"
    os.makedirs(evil)
    marker = f"{work}/pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    with open(f"{evil}/.metadata", "wb") as fh:
        pickle.dump(Evil(), fh)
    ok, msg = raises(lambda: sdcp.to_shardd(evil, f"{work}/x5", m, optim(m)), "system",
                     "refused", kinds=(ValueError,))
    check(ok and not os.path.exists(marker), f"a crafted .metadata: {msg}")
    # the other systems' names, each answered with shardd's
    for kw, words in (({"plan": "FULL_SHARD"}, ("'zero3'",)),
                      ({"plan": "ShardingStrategy.HYBRID_SHARD"}, ("'mics:P'",)),
                      ({"plan": "hsdp"}, ("mics_shard_size",)),
                      ({"mics_shard_size": 2}, ("mics_shard_size=", "'mics:P'")),
                      ({"zero_hpz_partition_size": 2}, ("zeropp,sec=S",)),
                      ({"mesh": None}, ("'mics:P'", "ranks_per_node")),
                      ({"reshard_after_forward": False}, ("'zero2'",))):
        ok, msg = raises(lambda: st.wrap(model(), socket="/nonexistent", **kw), *words,
                         kinds=(ValueError,))
        check(ok, f"wrap(**{kw}): {msg}")
    # FSDP2's reduce_dtype: the plan's ,gwire= option, refused where it contradicts the plan
    check(st._with_reduce_dtype("mics:2", torch.bfloat16) == "mics:2,gwire=bf16" and
          st._with_reduce_dtype("zero3", torch.float16) == "zero3,gwire=fp16" and
          st._with_reduce_dtype("zero3", torch.float32) == "zero3" and
          st._with_reduce_dtype("zero3,gwire=bf16", torch.bfloat16) == "zero3,gwire=bf16",
          "reduce_dtype becomes the plan's gwire option")
    ok, msg = raises(lambda: st.wrap(model(), socket="/nonexistent", plan="zero3,gwire=fp16",
                                     reduce_dtype=torch.bfloat16), "gwire=fp16", "one of them",
                     kinds=(ValueError,))
    check(ok, f"wrap(reduce_dtype=bf16) under gwire=fp16: {msg}")
    ok, msg = raises(lambda: st.wrap(model(), socket="/nonexistent", reduce_dtype=torch.int8),
                     "torch.bfloat16, torch.float16 or torch.float32", kinds=(ValueError,))
    check(ok, f"wrap(reduce_dtype=torch.int8): {msg}")
    ok, msg = raises(lambda: st.wrap(model(), socket="/nonexistent", mp_policy=None),
                     "reduce_dtype=torch.bfloat16", kinds=(ValueError,))
    check(ok, f"wrap(mp_policy=) names reduce_dtype=: {msg}")
    ok, msg = raises(lambda: st.wrap(model(), socket="/nonexistent", colour=2), "colour",
                     kinds=(TypeError,))
    check(ok, f"wrap(colour=2): {msg}")
    ok, msg = raises(lambda: st.wrap(model(), socket="/nonexistent", plan="zero3", load=src),
                     "torch.distributed.checkpoint", "shard.dcp.to_shardd",
                     kinds=(ValueError,))
    check(ok, f"wrap(load=<a DCP directory>): {msg}")


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "client", "examples", "fsdp2_train.py")


def typical_script(cl, work):
    """client/examples/fsdp2_train.py, a typical FSDP2 script (per-block fully_shard with a bf16
    MixedPrecisionPolicy, accumulation without sync, clipping, DCP), and the same file with
    --shardd (docs/pytorch.md's changes): the per-step losses of rank 0 agree within bf16's
    rounding of the compute (2^-8 relative per element; 2e-2 on the loss), and both learn"""
    runs = {}
    for tag, extra in (("fsdp2", []), ("shardd", ["--shardd", "--plan", "mics:2"])):
        port = free_port()
        cmds = []
        for r in range(RANKS):
            cmds.append(["env", f"RANK={r}", f"WORLD_SIZE={RANKS}", "MASTER_ADDR=127.0.0.1",
                         f"MASTER_PORT={port}", "LOCAL_WORLD_SIZE=2", "LOCAL_RANK=0",
                         f"TORCHELASTIC_RUN_ID=example-{tag}", f"SHARD_SOCKET={cl.socket(r // 2)}",
                         sys.executable, EXAMPLE, "--steps", "16", "--log-json",
                         f"{work}/example-{tag}.json"] + extra)
        outs = run_all(cmds, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
        for r, (rc, out) in enumerate(outs):
            check(rc == 0, f"fsdp2_train.py {tag} rank {r}: exit {rc}:\n{out[-3000:]}")
        if all(rc == 0 for rc, _ in outs):
            with open(f"{work}/example-{tag}.json") as f:
                runs[tag] = json.load(f)["loss"]
    if len(runs) == 2:
        a, b = runs["fsdp2"], runs["shardd"]
        worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
        print(f"fsdp2_train.py: FSDP2 (bf16 mixed precision) vs shardd mics:2 (bf16 weights): "
              f"losses {a[0]:.4f} -> {a[-1]:.4f} and {b[0]:.4f} -> {b[-1]:.4f}, worst relative "
              f"step difference {worst:.3g}")
        check(len(a) == len(b) == 16 and worst <= 2e-2,
              f"fsdp2_train.py: per-step losses differ by {worst:.3g} relative")
        check(a[-1] < 0.9 * a[0] and b[-1] < 0.9 * b[0],
              f"fsdp2_train.py: both learn ({a[0]:.4f} -> {a[-1]:.4f}, {b[0]:.4f} -> {b[-1]:.4f})")


def trainer_dcp(work):
    """an optimizer run in the trainers (Adadelta) through DCP both ways: torch's own state
    after 3 steps, saved with dcp.save under get_state_dict's keys, into a shardd checkpoint
    (to_shardd: its states under shard.torch's order), and back out (from_shardd): the weights,
    square_avg, acc_delta and step equal torch's bitwise each way"""
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(7)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    o = torch.optim.Adadelta(m.parameters(), lr=0.5)
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        ((m(torch.randn(4, 6, generator=g)) - 1.0) ** 2).mean().backward()
        o.step()
        o.zero_grad()
    names = [n for n, _ in m.named_parameters()]
    osd = o.state_dict()
    state = {names[i]: s for i, s in osd["state"].items()}
    groups = [dict({k: v for k, v in g.items() if k != "params"},
                   params=[names[i] for i in g["params"]]) for g in osd["param_groups"]]
    src, ck, back = f"{work}/dcp-adadelta", f"{work}/ck-adadelta", f"{work}/dcp-adadelta-back"
    dcp.save({"model": m.state_dict(), "optim": {"state": state, "param_groups": groups}},
             storage_writer=dcp.FileSystemWriter(src), no_dist=True)
    m2 = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    res = sdcp.to_shardd(src, ck, m2, torch.optim.Adadelta(m2.parameters(), lr=0.5))
    got = shard.checkpoint.load_state_dict(ck, optimizer_states=True)
    man = shard.checkpoint.info(ck)
    bad = [n for n in names if not torch.equal(got[n], dict(m.named_parameters())[n].detach())]
    bad += [f"{n}.{k}" for n in names for k, c in (("square_avg", "state1"),
                                                  ("acc_delta", "state2"))
            if not torch.equal(got["optimizer"][n][c], state[n][k])]
    check(res["step"] == 3 and man["optimizer"]["kind"] == "trainer2" and not bad and
          all(t["steps"] == 3 for t in man["tensors"]),
          f"DCP -> shardd of Adadelta: the checkpoint's kind {man['optimizer']['kind']}, step "
          f"{res['step']}, states as torch's bitwise (differ: {bad})")
    sdcp.from_shardd(ck, back)
    out = sdcp.read(back)
    bad = [f"{n}.{k}" for n in names for k in ("square_avg", "acc_delta", "step")
           if not torch.equal(torch.as_tensor(out.get(("optim", "state", n, k))).float(),
                              torch.as_tensor(state[n][k]).float())]
    check(not bad and all(torch.equal(out[("model", n)], dict(m.named_parameters())[n].detach())
                          for n in names),
          f"shardd -> DCP of Adadelta: the weights and torch's state names and values: {bad}")


def main():
    work = tempfile.mkdtemp(prefix="shard-fsdp2-")
    print(f"torch {torch.__version__}")
    cl = Cluster(sys.argv[1], f"{work}/cluster", 2, 2)
    try:
        if cl.ok:
            ref, _ = single()
            fs = side_by_side(cl, work, ref)
            if os.path.exists(f"{work}/ck-shard/LATEST"):
                shard_to_fsdp2(work)
            else:
                check(False, "no shardd checkpoint to convert")
            if fs is not None and os.path.exists(f"{work}/dcp-fsdp2/.metadata"):
                fsdp2_to_shard(cl, work, fs)
                refusals(work)
            typical_script(cl, work)
            trainer_dcp(work)
    finally:
        cl.stop()
    finish("test_torch_fsdp2", work)


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[3] == "--fsdp2":
        fsdp2_worker(json.loads(sys.argv[4]))
    elif len(sys.argv) > 4 and sys.argv[3] == "--shard":
        shard_worker(json.loads(sys.argv[4]))
    else:
        main()
