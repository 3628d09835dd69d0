#!/usr/bin/env python3
"""torch's AdamW on a CUDA device, the baseline of shard-bench kernels' AdamW (issue 40): the
fused and the foreach implementation on --params fp32 parameters, and a device-to-device copy
of --copy-bytes in the same run, each best of --iters, timed with CUDA events.
Bytes counted for torch's AdamW: 28 a parameter (parameter, exp_avg and exp_avg_sq read and
written, gradient read). Prints one JSON object with --json."""
import argparse
import json
import sys


def best_ms(torch, fn, iters):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, default=64 << 20)
    ap.add_argument("--copy-bytes", type=int, default=256 << 20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("torch_adamw: skipped: no torch in this Python", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("torch_adamw: skipped: torch sees no CUDA device", file=sys.stderr)
        return 77
    src = torch.empty(a.copy_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = best_ms(torch, lambda: dst.copy_(src), a.iters)
    copy_Bps = 2 * a.copy_bytes / (copy_ms / 1e3)
    del src, dst
    out = {"name": "torch_adamw", "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "params": a.params, "copy_GBps": copy_Bps / 1e9}
    for impl in ("fused", "foreach"):
        p = torch.nn.Parameter(torch.randn(a.params, device="cuda"))
        p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **{impl: True})
        ms = best_ms(torch, opt.step, a.iters)
        out[impl + "_us"] = ms * 1e3
        out[impl + "_ratio_to_copy"] = 28 * a.params / (ms / 1e3) / copy_Bps
        del p, opt
        torch.cuda.empty_cache()
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{out['device']}, torch {out['torch']}: copy {out['copy_GBps']:.0f} GB/s; AdamW on "
              f"{a.params} params: fused {out['fused_us']:.0f} us ({out['fused_ratio_to_copy']:.3f} "
              f"of the copy), foreach {out['foreach_us']:.0f} us "
              f"({out['foreach_ratio_to_copy']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
