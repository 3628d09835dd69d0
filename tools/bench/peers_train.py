#!/usr/bin/env python3
"""One rank of tools/bench/peers.sh: the GPT of client/examples/train_gpt.py trained by one
system, the same global batch, accumulation, AdamW (two groups), schedule and steps for all.

  peers_train.py --system ddp|fsdp2|hsdp|deepspeed|shardd [--plan P] [--ds-stage 3]
                 [--ds-mics N] [--ds-zeropp S] --rank R --world W --ranks-per-node K
                 --master ADDR:PORT [--socket S] --out FILE [model and run options]

Each system as its documentation recommends for speed on CPUs (one thread per rank for all):
DDP with no_sync on the micro-steps before the last; FSDP2 fully_shard on every block, the
embedding and the head, then the root, with explicit forward and backward prefetch of the next
block and set_requires_gradient_sync(False) on the micro-steps before the last (shardd the same
call: its last backward then overlaps the boundary hop); HSDP the same on
a 2-D mesh (nodes, ranks per node); DeepSpeed's engine (ZeRO stage 3, MiCS with its shard size
and hierarchical gather, ZeRO++'s hpZ/qwZ/qgZ) with overlap_comm and prefetching; shardd through
shard.torch.wrap with the plan. Rank 0 writes FILE: the loss of every step (rank 0's micro-
batches, the same data for every system), tokens/s over the steps after the first, the peak
resident memory of the process, and for shardd the daemon's bytes of the job on its node.
"""
import argparse
import json
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import train_gpt as tg  # noqa: E402


def args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", required=True,
                   choices=["ddp", "fsdp2", "hsdp", "deepspeed", "shardd"])
    p.add_argument("--plan", default="zero3", help="shardd's plan")
    p.add_argument("--ds-stage", type=int, default=3)
    p.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the gradients' reduction dtype: FSDP2's MixedPrecisionPolicy "
                        "reduce_dtype, DeepSpeed's communication_data_type, shardd's "
                        "wrap(reduce_dtype=) (,gwire=)")
    p.add_argument("--ds-mics", type=int, default=0, help="DeepSpeed mics_shard_size")
    p.add_argument("--ds-zeropp", type=int, default=0,
                   help="DeepSpeed ZeRO++: zero_hpz_partition_size (with qwZ and qgZ)")
    p.add_argument("--ds-hpz", type=int, default=0,
                   help="DeepSpeed ZeRO++'s hpZ alone: zero_hpz_partition_size (qwZ and qgZ "
                        "need DeepSpeed's QuantizerBuilder, which has no CPU implementation)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--master", default="127.0.0.1:29500")
    p.add_argument("--socket")
    p.add_argument("--job", default="peers")
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--clip", type=float, default=1.0)
    return p.parse_args()


def model_of(a):
    torch.manual_seed(a.seed)
    return tg.GPT(a.layers, a.width, a.heads, a.seq)


def init_dist(a):
    import torch.distributed as dist
    host, port = a.master.rsplit(":", 1)
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, RANK=str(a.rank),
                      WORLD_SIZE=str(a.world), LOCAL_RANK=str(a.rank % a.ranks_per_node),
                      LOCAL_WORLD_SIZE=str(a.ranks_per_node))
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    return dist


def fsdp2(a, m, hsdp):
    from torch.distributed.fsdp import fully_shard
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (a.world // a.ranks_per_node, a.ranks_per_node),
                                mesh_dim_names=("replicate", "shard"))
    mp = {}
    if a.reduce_dtype == "bf16":  # gradients reduced in bf16, parameters fp32
        from torch.distributed.fsdp import MixedPrecisionPolicy
        mp = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)}
    units = m.units()
    for u in units:
        fully_shard(u, mesh=mesh, **mp)
    fully_shard(m, mesh=mesh, **mp)
    for i, u in enumerate(units if os.environ.get("PEERS_PREFETCH", "1") == "1" else []):  # explicit prefetch: the next unit's all-gather early
        if i + 1 < len(units):
            u.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 0:
            u.set_modules_to_backward_prefetch([units[i - 1]])
    return m


def deepspeed_engine(a, m, opt):
    import deepspeed
    zero = {"stage": a.ds_stage, "overlap_comm": True, "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e9}
    if a.ds_mics:
        zero.update(mics_shard_size=a.ds_mics, mics_hierarchical_params_gather=True)
    if a.ds_zeropp:
        zero.update(zero_hpz_partition_size=a.ds_zeropp, zero_quantized_weights=True,
                    zero_quantized_gradients=True)
    if a.ds_hpz:
        zero.update(zero_hpz_partition_size=a.ds_hpz)
    cfg = {"train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": a.accum,
           "gradient_clipping": a.clip, "zero_optimization": zero,
           "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if a.reduce_dtype == "bf16":
        cfg["communication_data_type"] = "bf16"
    engine, opt, _, _ = deepspeed.initialize(model=m, optimizer=opt, config=cfg)
    return engine, opt


def main():
    a = args()
    torch.set_num_threads(1)
    m = model_of(a)

    def adamw():  # after fully_shard, whose DTensor parameters replace the module's
        return torch.optim.AdamW(tg.param_groups(m, a), lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    opt = adamw()
    engine = None
    if a.system == "shardd":
        import shard.torch as st
        st.wrap(m, socket=a.socket, job=a.job, rank=a.rank, world=a.world, plan=a.plan,
                optimizer=opt, units=m.units(), max_grad_norm=a.clip,
                ranks_per_node=a.ranks_per_node,
                reduce_dtype=torch.bfloat16 if a.reduce_dtype == "bf16" else None)
        net = m
    elif a.system == "deepspeed":
        import deepspeed
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        host, port = a.master.rsplit(":", 1)
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, RANK=str(a.rank),
                          WORLD_SIZE=str(a.world), LOCAL_RANK=str(a.rank % a.ranks_per_node),
                          LOCAL_SIZE=str(a.ranks_per_node))
        deepspeed.init_distributed(dist_backend="gloo")
        engine, opt = deepspeed_engine(a, m, opt)
        net = engine
    else:
        init_dist(a)
        if a.system == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(m)
        else:
            net = fsdp2(a, m, a.system == "hsdp")
            opt = adamw()
    sched = None
    if engine is None:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, tg.lr_lambda(a))
    tokens = a.batch * a.seq * a.accum * a.world
    losses, times = [], []
    for step in range(a.steps):
        if engine is not None:  # DeepSpeed steps its own optimizer: the lr set by hand
            for g in opt.param_groups:
                g["lr"] = a.lr * tg.lr_lambda(a)(step)
        t0 = time.time()
        total = 0.0
        for micro in range(a.accum):
            x, y = tg.batch(a.seed, step, micro, a.rank, a.batch, a.seq)
            last = micro == a.accum - 1
            if a.system in ("fsdp2", "hsdp", "shardd"):  # shardd: the last backward overlaps
                m.set_requires_gradient_sync(last)     # its boundary hop (FSDP2's call)
            ctx = net.no_sync() if a.system == "ddp" and not last else tg._nullcontext()
            with ctx:
                loss = F.cross_entropy(net(x).float().reshape(-1, tg.VOCAB), y.reshape(-1))
                if engine is not None:
                    engine.backward(loss)
                    engine.step()
                else:
                    (loss / a.accum).backward()
            total += loss.item() / a.accum
        if a.system in ("ddp", "fsdp2", "hsdp"):
            nrm = torch.nn.utils.clip_grad_norm_(m.parameters(), a.clip)
            if os.environ.get("PEERS_DEBUG") and a.rank == 0:
                print("norm", float(nrm.full_tensor() if hasattr(nrm, "full_tensor") else nrm), flush=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        elif a.system == "shardd":
            opt.step()
        if sched is not None:
            sched.step()
        times.append(time.time() - t0)
        losses.append(total)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    daemon = 0
    if a.system == "shardd":
        import shard
        try:
            job = shard.admin("jobs", job=a.job, socket=a.socket)["jobs"][0]
            daemon = job["memory_bytes"] // a.ranks_per_node
        except (shard.ShardError, KeyError, IndexError) as e:
            print(f"peers_train: the daemon's memory of the job: {e}", file=sys.stderr)
            daemon = 0
    if a.rank == 0:
        timed = times[1:] or times
        with open(a.out, "w") as f:
            json.dump({"system": a.system, "plan": a.plan, "reduce_dtype": a.reduce_dtype,
                       "loss": losses, "step_s": times,
                       "tokens_per_s": tokens * len(timed) / sum(timed), "peak_rss": peak,
                       "daemon_bytes_per_rank": daemon,
                       "params": sum(p.numel() for p in model_of(a).parameters())}, f)
    if a.system == "shardd":
        import shard.torch as st
        st.unwrap(m)
    else:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
