#!/usr/bin/env python3
"""A small GPT-style transformer trained through shardd, next to plain PyTorch DDP (gloo).

The task is deterministic and synthetic: sequences over a 64-token vocabulary that follow
x[t+1] = (3 x[t] + x[t-1] + 1) mod 64 from random starts, so the model can learn it and the
loss falls. Every rank draws its micro-batches from (seed, step, micro-step, rank), so shardd and
DDP train on the same global batch.

  one rank through shardd:
    train_gpt.py --socket S --job J --rank R --world W --plan mics:2 [--steps 30] [--accum 2]
  the same under torchrun or srun: socket from $SHARD_SOCKET, rank, world and job from the
  launcher's variables (shard.torch.launcher), one command on every node:
    SHARD_SOCKET=S torchrun --nnodes 2 --node_rank N --master_addr A train_gpt.py
  one rank of the DDP baseline (gloo over loopback):
    train_gpt.py --ddp --rank R --world W --init tcp://127.0.0.1:29500
  the same model in one process on every rank's micro-batches at once (the reference on a GPU):
    train_gpt.py --single --world W [--device cuda]
  both, on an emulated cluster started by tools/local-cluster.sh (sockets DIR/node<i>/...):
    train_gpt.py --launch --cluster-dir DIR --nodes 2 --ranks-per-node 2 [--plot loss.png]
  on a GPU: daemons started with --backend cuda, the model on their GPU, against --single:
    train_gpt.py --launch --device cuda --cluster-dir DIR --nodes 1 --ranks-per-node 4

Both train as an LLM run does: torch's AdamW with two parameter groups (weight decay on the
matrices, none on biases, LayerNorms and embeddings) and a LambdaLR schedule of linear warm-up
(--warmup steps) then cosine decay to --min-lr-ratio of the peak. Through shardd the same torch
AdamW is handed to shard.torch.wrap, which translates its groups; its step() then steps in
shardd with each group's current lr, so the scheduler is torch's own, unchanged.

Rank 0 prints a progress line per step (step, loss, lr, tokens/s, bytes shardd moved on its
node); --log FILE writes the losses, lr and timings as JSON, --dump FILE the final parameters
(torch.save). --launch runs both, prints their throughput side by side and, with --plot FILE,
draws the two loss curves and the lr schedule with matplotlib (Debian's python3-matplotlib).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))  # the build tree's package

VOCAB = 64


class Embed(nn.Module):
    def __init__(self, width, seq):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)

    def forward(self, idx):
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)  # a key bias gets no gradient
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (C // self.heads) ** 0.5)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.lm = nn.Linear(width, VOCAB)

    def forward(self, x):
        return self.lm(self.ln(x))


class GPT(nn.Module):
    def __init__(self, layers=4, width=128, heads=4, seq=32, tie=False):
        super().__init__()
        self.embed = Embed(width, seq)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = Head(width)
        if tie:  # the output layer reads the token embedding (GPT-2's tied weights)
            self.head.lm.weight = self.embed.tok.weight

    def units(self):
        """The submodules that become shardd units, in forward order."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def batch(seed, step, micro, rank, size, seq):
    g = torch.Generator().manual_seed(seed * 1000003 + step * 1009 + micro * 31 + rank)
    x = torch.empty(size, seq + 1, dtype=torch.long)
    x[:, :2] = torch.randint(0, VOCAB, (size, 2), generator=g)
    for t in range(2, seq + 1):
        x[:, t] = (3 * x[:, t - 1] + x[:, t - 2] + 1) % VOCAB
    return x[:, :-1], x[:, 1:]


def build(a):
    torch.manual_seed(a.seed)
    model = GPT(a.layers, a.width, a.heads, a.seq, tie=a.tie)
    if a.dtype in ("bf16", "fp16") and not (a.ddp or a.single):
        model = model.to(torch.bfloat16 if a.dtype == "bf16" else torch.float16)
    return model.to(a.device)


def micro_batch(a, step, micro):
    """this rank's micro-batch on a.device; --single: every rank's, concatenated in rank order
    (the global batch, whose mean loss is the mean of the ranks' as DDP averages them)"""
    ranks = range(a.world) if a.single else [a.rank]
    xs, ys = zip(*(batch(a.seed, step, micro, r, a.batch, a.seq) for r in ranks))
    return torch.cat(xs).to(a.device), torch.cat(ys).to(a.device)


def no_syncs(a):
    """where --check-syncs makes torch raise on any operation that waits for the GPU (torch's
    sync debug mode): the micro-steps, fetches and pushes of every unit included"""
    if not a.check_syncs or not a.device.startswith("cuda"):
        return _nullcontext()
    return _SyncDebug()


class _SyncDebug:
    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        return False


def param_groups(model, a):
    """Weight decay on the matrices of the linear layers only: biases, LayerNorms and the
    embeddings go without, as GPT-2 and most LLM recipes do."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        matrix = p.dim() >= 2 and not name.startswith("embed.")
        (decay if matrix else no_decay).append(p)
    return [{"params": decay, "weight_decay": a.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(a):
    """Linear warm-up over a.warmup steps, then cosine decay to a.min_lr_ratio of the peak."""
    def f(step):  # step: how many optimizer steps were taken before this one
        if step < a.warmup:
            return (step + 1) / a.warmup
        t = (step - a.warmup) / max(1, a.steps - a.warmup)
        return a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1)))
    return f


def node_bytes(shard, a):
    try:
        st = shard.admin("stats", job=a.job, socket=a.socket)["jobs"][0]["bytes"]
        return st["intra_package"] + st["intra_node"], st["inter_node_sent"] + st["inter_node_recv"]
    except Exception:
        return 0, 0


def train(a):
    torch.set_num_threads(1)
    model = build(a)
    mode = "ddp" if a.ddp else "single" if a.single else "shardd"
    log = {"mode": mode, "plan": a.plan, "dtype": a.dtype, "device": a.device,
           "params": sum(p.numel() for p in model.parameters()), "steps": [],
           "loss": [], "norm": [], "lr": [], "step_s": [], "skipped": [], "loss_scale": []}
    shardd = mode == "shardd"
    if a.ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=a.world)
        net = DDP(model)
    if a.single:
        net = model
    opt_class = AdamWInTrainers if a.optimizer == "adamw-in-trainers" else torch.optim.AdamW
    opt = opt_class(param_groups(model, a), lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    if shardd:
        import shard
        import shard.torch as st
        # the torch AdamW is translated group by group; its step() steps in shardd from now on
        net = st.wrap(model, socket=a.socket, job=a.job, rank=a.rank, world=a.world, plan=a.plan,
                      optimizer=opt, units=model.units(), max_grad_norm=a.clip)
        if a.check_zero_copy:
            checked = zero_copy_checks(model, st)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(a))
    # fp16 weights: torch's own loss scaler, as an fp16 run with torch.amp does
    scaler = torch.amp.GradScaler(torch.device(a.device).type,
                                  enabled=shardd and a.dtype == "fp16")
    tokens = a.batch * a.seq * a.accum * a.world
    syncs0 = shard.device_syncs() if shardd else 0
    t_start = time.time()
    for step in range(a.steps):
        t0 = time.time()
        data = [micro_batch(a, step, micro) for micro in range(a.accum)]
        total = 0.0  # a tensor on the model's device: read once a step (no sync per micro-step)
        with no_syncs(a):
            for micro, (x, y) in enumerate(data):
                sync = not a.ddp or micro == a.accum - 1
                ctx = net.no_sync() if a.ddp and not sync else _nullcontext()
                with ctx:
                    logits = net(x)
                    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
                    poison = (a.nan_step == step + 1 and micro == 0 and a.rank == 0 and
                              not a.single)
                    scaler.scale(loss * (float("nan") if poison else 1.0) / a.accum).backward()
                if a.single:  # rank 0's share of the global batch: its log is rank 0's curve
                    loss = F.cross_entropy(logits[:a.batch].detach().float().reshape(-1, VOCAB),
                                           y[:a.batch].reshape(-1))
                total = total + loss.detach() / a.accum
        total = float(total)
        lr = opt.param_groups[0]["lr"]
        if a.single:
            if a.nan_step == step + 1:  # the step shardd skips (rank 0's NaN): skipped here too
                log["skipped"].append([step + 1, "the step the ranks skip"])
            else:
                if a.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
                opt.step()
            opt.zero_grad(set_to_none=True)
            norm = float("nan")
        elif a.ddp:
            finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                         if p.grad is not None)
            if finite:
                if a.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
                opt.step()
            else:  # as shardd does: the step is skipped, its gradients dropped
                log["skipped"].append([step + 1, "non-finite gradient"])
            opt.zero_grad(set_to_none=True)
            norm = float("nan")
        elif scaler.is_enabled():  # a step with an overflow is skipped and the scale lowered
            scale = scaler.get_scale()
            norm = scaler.step(opt)  # shardd's step with the scaler's scale
            scaler.update()
            if norm is None:
                log["skipped"].append([step + 1, f"non-finite gradient at loss scale {scale:g}"])
                norm = float("nan")
                if a.rank == 0 and not a.quiet:
                    print(f"step {step + 1} skipped at loss scale {scale:g}", flush=True)
            log["loss_scale"].append(scale)
        else:
            try:
                norm = opt.step()  # shardd's step, with each group's current lr
            except shard.ShardError as e:
                if e.status != shard.ENONFINITE:
                    raise
                log["skipped"].append([step + 1, e.message])  # the job goes on
                norm = float("nan")
                if a.rank == 0 and not a.quiet:
                    print(f"step {step + 1} skipped: {e.message}", flush=True)
        sched.step()
        dt = time.time() - t0
        log["steps"].append(step + 1)
        log["loss"].append(total)
        log["norm"].append(norm)
        log["lr"].append(lr)
        log["step_s"].append(dt)
        if a.rank == 0 and not a.quiet:
            line = (f"{log['mode']} step {step + 1:3d} loss {total:.6f} lr {lr:.2e} "
                    f"tokens/s {tokens / dt:9.0f}")
            if shardd:
                intra, inter = node_bytes(shard, a)
                line += (f"  grad_norm {norm:.4f}  node 0 moved {inter / 1e6:.2f} MB inter-node,"
                         f" {intra / 1e6:.2f} MB intra-node")
            print(line, flush=True)
    log["total_s"] = time.time() - t_start
    if shardd:  # libshard's own waits for the device (its copies); the hot path makes none
        log["device_syncs"] = shard.device_syncs() - syncs0
    if shardd and a.check_zero_copy:
        print(f"rank {a.rank} zero-copy: {checked[0]} parameter views checked, "
              f"{checked[1]} outside the shared slot", flush=True)
        if checked[1] or not checked[0]:
            sys.exit(3)
    log["tokens_per_s"] = tokens * a.steps / log["total_s"]
    if shardd:
        state = st.full_state_dict(model, device="cpu")
    else:
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    if a.dump:
        torch.save(state, a.dump)
    if a.log:
        with open(a.log, "w") as f:
            json.dump(log, f)
    if a.ddp:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    elif shardd:
        st.unwrap(model)


def zero_copy_checks(model, st):
    """A forward pre-hook after the wrapper's: every parameter's data must lie inside the
    shared slot its unit was fetched into (no copy on the fetch path). Returns [checked, bad]."""
    counts = [0, 0]

    def check(module, inputs, u):
        # a tied parameter views the slot of the unit that owns it: any slot held now
        slots = [s for s in (st.slot_of(model, v) for v in range(len(model.units()))) if s]
        for p in module.parameters(recurse=True):
            if p.numel() == 0:
                continue
            counts[0] += 1
            end = p.data_ptr() + p.numel() * p.element_size()
            counts[1] += not any(s[0] <= p.data_ptr() and end <= s[0] + s[1] for s in slots)

    for u, m in enumerate(model.units()):
        m.register_forward_pre_hook(lambda mod, inp, u=u: check(mod, inp, u))
    return counts


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- --launch: both trainings on an emulated cluster, throughput and a plot of the curves

def plot(path, s, d, plan, name="DDP (gloo)"):
    """The two loss curves and the lr schedule, with matplotlib (python3-matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"== no plot: matplotlib is not installed (apt-get install python3-matplotlib); "
              f"the curves are in {os.path.dirname(path) or '.'}/shardd-0.json and ddp-0.json")
        return False
    fig, (ax, axl) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1]})
    ax.plot(s["steps"], s["loss"], lw=4, alpha=0.6, label=f"shardd ({plan})")
    ax.plot(d["steps"], d["loss"], lw=1.2, label=name)
    ax.set_ylabel("training loss")
    ax.set_title(f"GPT: shardd vs {name} on the same global batch")
    ax.legend()
    ax.grid(alpha=0.3)
    axl.plot(s["steps"], s["lr"], color="tab:green")
    axl.set_ylabel("lr")
    axl.set_xlabel("step")
    axl.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


class AdamWInTrainers(torch.optim.AdamW):
    """torch's AdamW as an optimizer shardd does not run itself (a subclass of it): shard.torch
    runs it in the trainers, each rank on its own shard (--optimizer adamw-in-trainers: what an
    optimizer run in the trainers costs against shardd's own AdamW, the same arithmetic)"""


def launch(a):
    world = a.nodes * a.ranks_per_node
    out = a.out or a.cluster_dir
    common = ["--world", str(world), "--steps", str(a.steps), "--accum", str(a.accum),
              "--seed", str(a.seed), "--layers", str(a.layers), "--width", str(a.width),
              "--batch", str(a.batch), "--dtype", a.dtype, "--lr", str(a.lr), "--warmup",
              str(a.warmup), "--min-lr-ratio", str(a.min_lr_ratio), "--weight-decay",
              str(a.weight_decay), "--device", a.device, "--seq", str(a.seq), "--heads",
              str(a.heads)]
    if a.check_syncs:
        common.append("--check-syncs")
    if a.optimizer != "adamw":
        common += ["--optimizer", a.optimizer]
    if a.tie:
        common.append("--tie")
    if a.clip:
        common += ["--clip", str(a.clip)]
    if a.nan_step:
        common += ["--nan-step", str(a.nan_step)]
    procs = []
    for r in range(world):
        sock = os.path.join(a.cluster_dir, f"node{r // a.ranks_per_node}", "shardd.sock")
        cmd = [sys.executable, __file__, "--socket", sock, "--job", a.job, "--rank", str(r),
               "--plan", a.plan, "--log", os.path.join(out, f"shardd-{r}.json")] + common
        if a.check_zero_copy:
            cmd.append("--check-zero-copy")
        if r == 0 and a.dump:
            cmd += ["--dump", os.path.join(out, "shardd-params.pt")]
        procs.append(subprocess.Popen(cmd, stdout=None if r == 0 else subprocess.DEVNULL))
    rc = [p.wait() for p in procs]
    if any(rc):
        sys.exit(f"train_gpt: a shardd rank failed (exit codes {rc})")
    # the baseline: DDP (gloo) on the CPU; on a GPU the same model in one process on the global
    # batch (one GPU has no second device for DDP's ranks)
    ref = a.baseline or ("single" if a.device.startswith("cuda") else "ddp")
    if ref == "single":
        cmd = [sys.executable, __file__, "--single", "--log",
               os.path.join(out, "single-0.json")] + common
        if a.dump:
            cmd += ["--dump", os.path.join(out, "single-params.pt")]
        if subprocess.call(cmd) != 0:
            sys.exit("train_gpt: the single-process reference failed")
    else:
        port = 29500 + os.getpid() % 1000
        procs = []
        for r in range(world):
            cmd = [sys.executable, __file__, "--ddp", "--rank", str(r), "--init",
                   f"tcp://127.0.0.1:{port}", "--log", os.path.join(out, f"ddp-{r}.json")] + common
            procs.append(subprocess.Popen(cmd, stdout=None if r == 0 else subprocess.DEVNULL))
        rc = [p.wait() for p in procs]
        if any(rc):
            sys.exit(f"train_gpt: a DDP rank failed (exit codes {rc})")
    s = json.load(open(os.path.join(out, "shardd-0.json")))
    d = json.load(open(os.path.join(out, f"{ref}-0.json")))
    worst = max(abs(x - y) / abs(y) for x, y in zip(s["loss"], d["loss"]))
    final = (s["loss"][-1] - d["loss"][-1]) / d["loss"][-1]
    name = "DDP (gloo)" if ref == "ddp" else "one process"
    print(f"== {a.steps} steps, {world} ranks, plan {a.plan}, {a.dtype} on {a.device}: shardd "
          f"{s['tokens_per_s']:.0f} tokens/s, {name} {d['tokens_per_s']:.0f} tokens/s "
          f"({s['tokens_per_s'] / d['tokens_per_s']:.2f}x); loss {s['loss'][0]:.4f} -> "
          f"{s['loss'][-1]:.4f} ({name} {d['loss'][-1]:.4f}, final difference {final:+.2%}); "
          f"largest relative loss difference over the run {worst:.2e}; libshard's device "
          f"waits: {s.get('device_syncs', 0)}")
    if a.plot and plot(a.plot, s, d, a.plan, name):
        print(f"== loss curves and lr schedule: {a.plot}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--socket", default=os.environ.get("SHARD_SOCKET"),
                   help="shardd socket of this rank's node (default $SHARD_SOCKET)")
    p.add_argument("--job", help="the job's name (default: torchrun's or Slurm's, as "
                   "shard.torch.launcher gives it, else gpt)")
    p.add_argument("--rank", type=int,
                   help="default: torchrun's RANK or Slurm's SLURM_PROCID, else 0")
    p.add_argument("--world", type=int,
                   help="default: torchrun's WORLD_SIZE or Slurm's SLURM_NTASKS, else 1")
    p.add_argument("--plan", default="mics:2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch per rank")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=5, help="steps of linear lr warm-up")
    p.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="the cosine decay ends at this fraction of the peak lr")
    p.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW's, on the matrices (none on biases, norms, embeddings)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--optimizer", choices=["adamw", "adamw-in-trainers"], default="adamw",
                   help="adamw: run by shardd; adamw-in-trainers: torch's AdamW run by each rank "
                        "on its own shard (shardd's path for any other torch optimizer)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="bf16, fp16: the weights shardd hands out (the DDP baseline stays "
                        "fp32); fp16 trains with torch.amp.GradScaler (dynamic loss scaling)")
    p.add_argument("--ddp", action="store_true", help="the DDP (gloo) baseline instead")
    p.add_argument("--single", action="store_true",
                   help="the same model in one process on every rank's micro-batches at once "
                        "(the baseline on one GPU)")
    p.add_argument("--device", default="cpu",
                   help="where the model is: cpu, or cuda (cuda:K) with daemons on that GPU "
                        "(shardd --backend cuda)")
    p.add_argument("--baseline", choices=["ddp", "single"],
                   help="--launch: the reference run (default: ddp on the CPU, single on a GPU)")
    p.add_argument("--tie", action="store_true",
                   help="the output layer shares the token embedding's weight (GPT-2's tying)")
    p.add_argument("--clip", type=float, default=0.0,
                   help="clip the global gradient norm to this (0: no clipping)")
    p.add_argument("--check-syncs", action="store_true",
                   help="on a GPU: torch raises on any wait for the device in the micro-steps "
                        "(torch.cuda.set_sync_debug_mode)")
    p.add_argument("--init", default="tcp://127.0.0.1:29500", help="DDP rendezvous")
    # --log-json under torchrun >= 2.x, whose parser takes a script's "--log" for an
    # abbreviation of its own --log-dir ("ambiguous option")
    p.add_argument("--log-json", "--log", dest="log", help="write losses and timings as JSON")
    p.add_argument("--dump", help="write the final parameters (torch.save)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--nan-step", type=int, default=0,
                   help="rank 0's loss is NaN in this step's first micro-step: the step fails "
                        "with shard.ENONFINITE and is skipped (DDP skips it alike)")
    p.add_argument("--check-zero-copy", action="store_true",
                   help="check that every parameter views the shared slot (exit 3 if not)")
    p.add_argument("--launch", action="store_true", help="run shardd and DDP on a cluster")
    p.add_argument("--cluster-dir", help="--launch: tools/local-cluster.sh's --dir")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--out", help="--launch: where the logs go (default the cluster dir)")
    p.add_argument("--plot", help="--launch: an image of the loss curves and the lr schedule "
                                  "(matplotlib)")
    a = p.parse_args()
    launched = any(os.environ.get(v) for v in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"))
    if a.job is None and not launched:
        a.job = "gpt"
    if a.launch or a.ddp or a.single:  # explicit numbers (--launch starts the ranks itself)
        a.rank = a.rank if a.rank is not None else 0
        a.world = a.world if a.world is not None else 1
    else:  # a rank through shardd: what the arguments leave out, from torchrun or Slurm
        import shard.torch as st
        try:
            a.job, a.rank, a.world = st.launcher(a.job, a.rank, a.world)
        except ValueError as e:
            p.error(str(e))
    if a.launch:
        if not a.cluster_dir:
            p.error("--launch needs --cluster-dir")
        launch(a)
    else:
        if not a.ddp and not a.single and not a.socket:
            p.error("--socket is required (or --ddp, --single)")
        train(a)


if __name__ == "__main__":
    main()
