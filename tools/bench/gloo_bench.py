#!/usr/bin/python3
"""The gloo baseline of tools/bench/compare.sh: torch.distributed (Debian's python3-torch) with
the gloo backend, N processes on this machine, the sizes and conventions of shard-bench.

size is the gathered output (allgather), the input per rank (reducescatter, allreduce). gloo has
no reduce_scatter: reducescatter is an all_reduce of the input and a slice of it, which is what a
gloo user gets. Prints one JSON object per measurement."""
import argparse, json, os, sys, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, args):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=args.nprocs)
    n = args.nprocs
    size = args.min
    while size <= args.max:
        count = size // 4
        iters = max(3, min(args.iters, (1 << 30) // size))
        if args.op == "allgather":
            x = torch.full((count // n,), float(rank))
            out = [torch.empty(count // n) for _ in range(n)]
            op = lambda: dist.all_gather(out, x)
        elif args.op == "reducescatter":
            x = torch.full((count,), float(rank + 1))
            op = lambda: (dist.all_reduce(x), x[rank * (count // n):(rank + 1) * (count // n)])
        else:
            x = torch.full((count,), float(rank + 1))
            op = lambda: dist.all_reduce(x)
        for _ in range(args.warmup):
            op()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        t = (time.perf_counter() - t0) / iters
        worst = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if rank == 0:
            t = worst.item()
            algbw = size / t / 1e9
            factor = 2 * (n - 1) / n if args.op == "allreduce" else (n - 1) / n
            print(json.dumps({"name": args.op, "impl": "gloo", "size_bytes": size, "ranks": n,
                              "time_s": t, "algbw_GBps": algbw, "busbw_GBps": algbw * factor}),
                  flush=True)
        size *= 2
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("op", choices=["allgather", "reducescatter", "allreduce"])
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--min", type=int, default=4096)
    p.add_argument("--max", type=int, default=64 << 20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--port", type=int, default=29500 + os.getpid() % 1000)
    args = p.parse_args()
    torch.set_num_threads(1)
    mp.spawn(run, args=(args,), nprocs=args.nprocs)


if __name__ == "__main__":
    main()
