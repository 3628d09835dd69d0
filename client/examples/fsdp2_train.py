#!/usr/bin/env python3
"""A typical FSDP2 training script, and the same script through shardd (--shardd): every line
that differs is marked "shardd:" and is one of docs/pytorch.md's list (FSDP2 and DeepSpeed).

FSDP2 as its tutorials write it: fully_shard on every block and on the root with a
MixedPrecisionPolicy (bf16 compute, fp32 gradient reduction), AdamW built after fully_shard,
gradient accumulation without synchronization on all but the last micro-step, clipping, a
warm-up + cosine schedule, and torch.distributed.checkpoint (get_state_dict / dcp.save /
dcp.load / set_state_dict) to save and resume.

  torchrun --nproc-per-node 4 fsdp2_train.py --steps 20 [--save-every 10 --ckpt DIR] [--resume]
  SHARD_SOCKET=S torchrun --nproc-per-node 4 fsdp2_train.py --shardd --plan zero3 ...
  (or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand, as test_torch_fsdp2 does)

--log-json FILE writes rank 0's loss per step.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))  # the build tree's package

VOCAB, CTX = 64, 32


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers=2, d=64, heads=4):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(CTX, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def batch(step, micro, rank, size):
    g = torch.Generator().manual_seed(step * 1009 + micro * 31 + rank)
    x = torch.randint(0, VOCAB, (size, CTX + 1), generator=g)
    x[:, 1:] = (x[:, :-1] * 5 + 3) % VOCAB  # a learnable sequence
    return x[:, :-1], x[:, 1:]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shardd", action="store_true", help="train through shardd")
    p.add_argument("--plan", default="zero3", help="shardd's plan (--shardd)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ckpt", help="checkpoint directory")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="start from --ckpt's latest")
    p.add_argument("--log-json", help="rank 0's loss per step as JSON")
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = GPT()
    if a.shardd:
        import shard.torch as st
        model = model.to(torch.bfloat16)  # shardd: MixedPrecisionPolicy(param_dtype=bf16)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)  # shardd: before wrap, given to it
        load = a.ckpt if a.resume else None
        st.wrap(model, plan=a.plan, optimizer=opt, units=list(model.blocks),  # shardd: wrap
                max_grad_norm=1.0, load=load)  # shardd: clipping and resume are wrap's
        first = st.start_step(model)
    else:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        dist.init_process_group("gloo")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in model.blocks:
            fully_shard(b, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
        first = 0

    def lr_at(step):
        warm = min(1.0, (step + 1) / 5)
        return warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(step / a.steps, 1))))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)  # its initial_lr in the groups
    if a.resume and not a.shardd:  # shardd: wrap(load=) above
        with open(os.path.join(a.ckpt, "LATEST")) as f:
            first = int(f.read().split("-")[1])
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(a.ckpt, f"step-{first:08d}"))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    for _ in range(first):  # the schedule where the checkpoint left it
        sched.step()
    losses = []
    for step in range(first, a.steps):
        total = 0.0
        for micro in range(a.accum):
            model.set_requires_gradient_sync(micro == a.accum - 1)  # (under shardd too)
            x, y = batch(step, micro, rank, a.batch)
            loss = F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))
            (loss / a.accum).backward()
            total += loss.item() / a.accum
        if not a.shardd:  # shardd: max_grad_norm= of wrap
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if rank == 0:
            print(f"step {step + 1} loss {total:.4f}", flush=True)
        if a.save_every and (step + 1) % a.save_every == 0:
            if a.shardd:
                st.save(a.ckpt, model)  # shardd: shard.torch.save
            else:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd},
                         checkpoint_id=os.path.join(a.ckpt, f"step-{step + 1:08d}"))
                dist.barrier()
                if rank == 0:
                    with open(os.path.join(a.ckpt, "LATEST"), "w") as f:
                        f.write(f"step-{step + 1:08d}\n")
    if a.log_json and rank == 0:
        with open(a.log_json, "w") as f:
            json.dump({"first": first, "loss": losses}, f)
    if a.shardd:
        st.unwrap(model)
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
