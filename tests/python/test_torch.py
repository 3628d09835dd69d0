#!/usr/bin/env python3
"""PyTorch through shardd vs DistributedDataParallel (gloo), on a 2-node x 2-rank emulated
cluster of real daemons (tools/local-cluster.sh, loopback):

  - the example trains as an LLM run does (two AdamW param groups, warm-up + cosine LambdaLR)
    with the same torch code under DDP and through shardd: the lr of every step is the
    schedule's formula in both, and the plot of the curves (matplotlib) is written;
  - mics:2 and zero3, fp32, AdamW, accumulation 2, 30 steps: rank 0's loss of every step equals
    DDP's within 1e-5 relative; the final parameters are allclose with rtol 1e-5 and atol 1e-5:
    an element whose gradient is pure rounding noise (near zero) takes AdamW steps of up to lr =
    1e-3 in a direction set by that noise, so when DDP (gloo) and shardd sum the same gradients
    in a different order such elements drift apart by a small fraction of one step; atol allows
    1% of one step (observed at most 3e-6 on 1 or 2 of 800k elements);
  - bf16 weights through shardd (mics:2) vs fp32 DDP: loss within 2% relative every step;
  - fp16 weights through shardd with torch's GradScaler (mics:2, 12 steps, rank 0's loss NaN in
    step 4) vs fp32 DDP skipping the same step: loss within 1e-3 relative every step (fp16's
    rounding of weights and activations, 2^-11 each; measured 2e-5 over 30 steps without the
    NaN), step 4 skipped on every rank as a GradScaler's overflow (no exception) and every
    rank's scale 2^16 up to it and 2^15 after;
  - a NaN loss on rank 0 in step 4 of 12 (zero3): every rank's shard.torch.step raises
    ShardError ENONFINITE naming the unit, training goes on, and it ends where DDP skipping the
    same step ends (the same tolerances as above);
  - no copy on the fetch path: every parameter views the shared slot of its unit;
  - libshard errors become shard.ShardError with the status and the message; the package
    installs with pip without network.

Skipped (exit 77, with the reason) where PyTorch cannot be imported.
usage: test_torch.py SHARDD LIBSHARD
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile

from harness import ROOT, check, finish, run_all, shard, torch

shardd = sys.argv[1]
GPT = os.path.join(ROOT, "client", "examples", "train_gpt.py")
CLUSTER = os.path.join(ROOT, "tools", "local-cluster.sh")
work = tempfile.mkdtemp(prefix="shardd-torch-")
cdir = os.path.join(work, "cluster")
port = str(20000 + os.getpid() % 12000)  # below the kernel's ephemeral ports


def train(tag, plan, dtype, extra=(), steps=30):
    common = ["--world", "4", "--steps", str(steps), "--accum", "2", "--dtype", dtype, "--quiet"]
    cmds = []
    for r in range(4):
        cmds.append([sys.executable, GPT, "--socket", f"{cdir}/node{r // 2}/shardd.sock",
                     "--job", tag, "--rank", str(r), "--plan", plan, "--log",
                     f"{work}/{tag}-{r}.json", "--dump", f"{work}/{tag}-{r}.pt"] + common +
                    list(extra))
    outs = run_all(cmds)
    for r, (rc, out) in enumerate(outs):
        check(rc == 0, f"{tag} rank {r} exit code {rc}:\n{out}")
    return outs


def ddp(tag, dtype="fp32", extra=(), steps=30):
    cmds = [[sys.executable, GPT, "--ddp", "--rank", str(r), "--world", "4", "--steps",
             str(steps), "--accum", "2", "--quiet", "--init", f"tcp://127.0.0.1:{int(port) + 7}",
             "--log", f"{work}/{tag}-{r}.json", "--dump", f"{work}/{tag}-{r}.pt"] + list(extra)
            for r in range(4)]
    for r, (rc, out) in enumerate(run_all(cmds)):
        check(rc == 0, f"DDP rank {r} exit code {rc}:\n{out}")


def compare(tag, ref, loss_rtol, params, steps=30):
    try:
        s = json.load(open(f"{work}/{tag}-0.json"))
        d = json.load(open(f"{work}/{ref}-0.json"))
    except OSError as e:
        check(False, f"{tag}: logs missing ({e})")
        return
    check(len(s["loss"]) == steps and len(d["loss"]) == steps, f"{tag}: {steps} steps logged")
    # the schedule: warm-up over 5 steps to 1e-3, then cosine to 1e-4 (train_gpt's defaults)
    want = [1e-3 * ((i + 1) / 5 if i < 5 else
                    0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (i - 5) / (steps - 5))))
            for i in range(steps)]
    check(all(abs(a - w) <= 1e-12 for a, w in zip(s["lr"], want)) and s["lr"] == d["lr"],
          f"{tag}: the lr of every step follows warm-up + cosine, as DDP's: {s['lr'][:7]}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(s["loss"], d["loss"]))
    check(worst <= loss_rtol, f"{tag}: loss differs from DDP by {worst:.3g} relative "
          f"(tolerance {loss_rtol})")
    check(s["loss"][-1] < s["loss"][0] - 0.1, f"{tag}: the loss falls "
          f"({s['loss'][0]:.4f} -> {s['loss'][-1]:.4f})")
    line = f"{tag}: loss {s['loss'][0]:.4f} -> {s['loss'][-1]:.4f}, worst relative " \
           f"difference to DDP {worst:.2e}"
    if params:
        a = torch.load(f"{work}/{tag}-0.pt")
        b = torch.load(f"{work}/{ref}-0.pt")
        check(sorted(a) == sorted(b), f"{tag}: the same parameter names as DDP")
        maxd, outside = 0.0, 0
        for k in b:
            x, y = a[k].float(), b[k].float()
            maxd = max(maxd, (x - y).abs().max().item())
            outside += int((~torch.isclose(x, y, rtol=1e-5, atol=1e-5)).sum())
        check(outside == 0, f"{tag}: {outside} parameters not allclose (rtol 1e-5, atol 1e-5), "
              f"max |diff| {maxd:.3g}")
        line += f"; parameters max |diff| {maxd:.2e}"
        for r in range(1, 4):  # every rank's full_state_dict is the same
            c = torch.load(f"{work}/{tag}-{r}.pt")
            check(all(torch.equal(c[k], a[k]) for k in a), f"{tag}: rank {r}'s parameters")
    print(line, flush=True)


try:
    # errors become exceptions with the status and the message
    try:
        shard.Context(os.path.join(work, "nothing.sock"))
        check(False, "attach to a missing socket raises")
    except shard.ShardError as e:
        check(e.status < 0 and "nothing.sock" in e.message, f"ShardError carries status and "
              f"message: {e.status} {e.message}")

    # the package installs with pip, without network access
    target = os.path.join(work, "site")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--quiet",
                        "--target", target, os.path.join(ROOT, "client", "python")],
                       capture_output=True, text=True, timeout=300)
    check(r.returncode == 0, f"pip install client/python: {r.stdout}{r.stderr}")
    r = subprocess.run([sys.executable, "-c", "import shard, shard.torch; print(shard.__file__)"],
                       capture_output=True, text=True, cwd=work,
                       env=dict(os.environ, PYTHONPATH=target))
    check(r.returncode == 0 and r.stdout.startswith(target), f"import the installed package: "
          f"{r.stdout}{r.stderr}")

    st = subprocess.run(["bash", CLUSTER, "start", "--nodes", "2", "--ranks-per-node", "2",
                         "--dir", cdir, "--shardd", shardd, "--",
                         "--log-level", "warn"], capture_output=True, text=True, timeout=120)
    check(st.returncode == 0, f"cluster start: {st.stdout}{st.stderr}")
    if st.returncode == 0:
        ddp("ddp")
        outs = train("mics2", "mics:2", "fp32", ["--check-zero-copy"])
        for r, (_, out) in enumerate(outs):
            check("parameter views checked, 0 outside the shared slot" in out,
                  f"rank {r}: every parameter views the shared slot:\n{out}")
        compare("mics2", "ddp", 1e-5, True)
        train("zero3", "zero3", "fp32")
        compare("zero3", "ddp", 1e-5, True)
        train("bf16", "mics:2", "bf16")
        compare("bf16", "ddp", 2e-2, False)
        # a NaN loss on rank 0 in step 4: shard.torch.step raises ENONFINITE naming a unit on
        # every rank, the step is skipped, and training goes on to where DDP that skips the
        # same step ends
        ddp("ddpnan", extra=["--nan-step", "4"], steps=12)
        train("nan", "zero3", "fp32", ["--nan-step", "4"], steps=12)
        compare("nan", "ddpnan", 1e-5, True, steps=12)
        for r in range(4):
            try:
                sk = json.load(open(f"{work}/nan-{r}.json"))["skipped"]
            except OSError:
                sk = []
            check(len(sk) == 1 and sk[0][0] == 4 and "unit " in sk[0][1] and
                  "non-finite" in sk[0][1], f"rank {r}: step 4 failed with ENONFINITE naming "
                  f"the unit, alone: {sk}")
        d = json.load(open(f"{work}/ddpnan-0.json"))["skipped"]
        check([x[0] for x in d] == [4], f"DDP skipped step 4: {d}")
        # fp16 with torch's GradScaler: the NaN step is an overflow the scaler backs off from
        train("fp16", "mics:2", "fp16", ["--nan-step", "4"], steps=12)
        compare("fp16", "ddpnan", 1e-3, False, steps=12)
        for r in range(4):
            try:
                lg = json.load(open(f"{work}/fp16-{r}.json"))
            except OSError:
                lg = {"skipped": [], "loss_scale": []}
            want = [2.0 ** 16] * 4 + [2.0 ** 15] * 8
            check([x[0] for x in lg["skipped"]] == [4] and lg["loss_scale"] == want,
                  f"rank {r}: fp16 step 4 skipped by the GradScaler and the scale halved after "
                  f"it: {lg['skipped']}, {lg['loss_scale']}")
        # the example's plot of the loss curves and the schedule (matplotlib)
        spec = importlib.util.spec_from_file_location("train_gpt", GPT)
        gpt = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gpt)
        png = os.path.join(work, "gpt.png")
        drawn = gpt.plot(png, json.load(open(f"{work}/mics2-0.json")),
                         json.load(open(f"{work}/ddp-0.json")), "mics:2")
        check(drawn and open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n",
              "train_gpt.py's plot writes a PNG with matplotlib (python3-matplotlib)")
finally:
    subprocess.run(["bash", CLUSTER, "stop", "--dir", cdir], capture_output=True, text=True,
                   timeout=120)
finish("test_torch", work)
