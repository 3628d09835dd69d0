#!/usr/bin/env python3
"""fp16 training with dynamic loss scaling through shardd, against single-process torch, on a
2-node x 2-rank emulated cluster of real daemons (tools/local-cluster.sh):

  - an fp16 MLP (weights fp16 in the forward, fp32 masters in shardd) learns a fixed teacher
    with a loss multiplied by 2^-24 (a loss whose gradients lie below fp16's smallest
    subnormal, 6e-8, unless scaled): AdamW (eps 1e-12, so that the update does not depend on
    the gradients' size), accumulation 2, 14 steps, world 4, under mics:2 (the sums cross the
    nodes). Each rank keeps torch's own torch.amp.GradScaler (init_scale 2^46, growth_interval
    3, so that the run both overflows on its own and grows) and steps with
    scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update(); rank 2 multiplies
    its loss by inf in step 7 (an overflow injected on one rank). The job is saved after step
    10 with the scaler's state and resumed in a new job whose new GradScaler loads it
    (shard.torch.grad_scaler_state_dict); before, scaler.step gets shard.torch.optimizer(m),
    after, the torch AdamW given to wrap.
  - The reference is single-process torch doing what mixed precision with fp32 masters does:
    each rank's micro-batch through an fp16 copy of the model (the same bits as the ranks'),
    the fp16 gradients summed in fp32, the sums given to an fp32 AdamW whose own GradScaler
    unscales them, finds the overflows and updates the scale; the masters cast back to fp16.
    Checks: every rank's scale after every step equal to the reference scaler's (the same
    trajectory, bitwise), the same steps skipped (step 7, and overflows of the scale itself),
    at least one growth; the moments and step counts unchanged across step 7 (rank 0 reads
    the optimizer's state dict alone after steps 6 and 7); losses within 2e-4 relative of the
    reference's and the fp16 weights within two fp16 roundings of each tensor's largest
    weight (the fp32 sums of the same fp16 gradients are exact; the daemon's AdamW and torch's
    foreach AdamW round apart by about 1e-7 relative a step, which an fp16 cast turns into
    one-ulp flips: bitwise equal through step 8, 3e-5 relative in the loss at the end);
    shardctl stats counts the skipped steps in steps_nonfinite_scaled and shows the last
    loss_scale.
  - The same model in fp32 without loss scaling (single-process torch, the steps the fp16 run
    skipped skipped alike): the fp16 run's loss curve stays within 0.5% of it (fp16's rounding
    of weights and activations, 2^-11 = 4.9e-4 relative each, through three layers and the
    loss, and the masters' drifting apart by it over the steps; measured 2e-4).
  - The fp16 run through shardd without loss scaling (GradScaler(enabled=False)): every
    gradient underflows to zero, and the weights end bitwise where they began (the loss does
    not move), while the scaled run's loss falls by more than a third: the test can tell.
  - libshard's shard_scaler_update (the C API's scaler) against torch._amp_update_scale_ on 200
    random outcomes with factors that round (growth 1.7, backoff 0.37, interval 3): the same
    float32 scale and growth tracker after every one, also where growth would reach infinity.

Skipped (exit 77, with the reason) where PyTorch cannot be imported.
usage: test_torch_amp.py SHARDD LIBSHARD
"""
import json
import math
import os
import random
import sys
import tempfile

import harness
from harness import Cluster, check, finish, run_all, shard, torch

import shard.torch as st  # noqa: E402

nn = torch.nn
RANKS, ROWS, ACCUM, STEPS, RESUME_AT, INJECT = 4, 8, 2, 14, 10, 7
TINY = 2.0 ** -24
INIT_SCALE, GROWTH_INTERVAL = 2.0 ** 41, 3


def model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def teacher():
    g = torch.Generator().manual_seed(9)
    return torch.randn(16, 8, generator=g), torch.randn(8, 4, generator=g)


def batch(step, micro, rank):
    """rank's rows of the global micro-batch (fp32 inputs and targets)"""
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(RANKS * ROWS, 16, generator=g)
    a, b = teacher()
    y = torch.tanh(x @ a) @ b
    lo = rank * ROWS
    return x[lo:lo + ROWS], y[lo:lo + ROWS]


def loss_of(m, step, micro, rank, dtype):
    """the rank's micro-batch loss (fp32, times TINY), injected with inf where the test says"""
    x, y = batch(step, micro, rank)
    loss = (m(x.to(dtype)).float() - y).square().mean() * TINY
    if step + 1 == INJECT and rank == 2 and micro == 1:
        loss = loss * math.inf
    return loss


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-12, weight_decay=0.0)


def worker(a):
    m = model().half()
    scaled = a["scaled"]
    st.wrap(m, socket=a["socket"], job=a["job"], rank=a["rank"], world=RANKS, plan=a["plan"],
            optimizer=adamw(m.parameters()))
    opt = st.optimizer(m)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL,
                                  enabled=scaled)
    out = {"loss": [], "scale": [], "skipped": [], "state": {}}
    for step in range(STEPS if scaled else 5):
        total = 0.0
        for micro in range(ACCUM):
            loss = loss_of(m, step, micro, a["rank"], torch.float16)
            scaler.scale(loss).backward()
            total += loss.item() / TINY / ACCUM
        norm = scaler.step(opt)
        scaler.update()
        out["loss"].append(total)
        out["scale"].append(scaler.get_scale())
        out["skipped"].append(scaled and norm is None)
        if a["rank"] == 0 and step + 1 in (INJECT - 1, INJECT):
            sd = opt.state_dict()["state"]
            out["state"][step + 1] = {str(i): {k: (v.tolist() if isinstance(v, torch.Tensor)
                                                   else v) for k, v in s.items()}
                                      for i, s in sd.items()}
        if scaled and step + 1 == RESUME_AT:  # saved with the scaler, resumed in a new job
            ck = f"{a['out'].rsplit('-', 1)[0]}-ck"
            st.save(ck, m)
            st.unwrap(m)
            m = model().half()
            opt = adamw(m.parameters())  # from here on the torch optimizer itself is stepped
            st.wrap(m, socket=a["socket"], job=a["job"] + "-resumed", rank=a["rank"],
                    world=RANKS, plan=a["plan"], optimizer=opt, load=ck)
            scaler = torch.amp.GradScaler("cpu")
            saved = st.grad_scaler_state_dict(m)
            out["saved_scaler"] = saved
            scaler.load_state_dict(saved)
    out["stats"] = shard.admin("stats", a["job"] + ("-resumed" if scaled else ""),
                               socket=a["socket"])
    if a["rank"] == 0:
        torch.save({k: v.clone() for k, v in st.full_state_dict(m).items()}, a["out"] + ".pt")
    with open(a["out"] + ".json", "w") as f:
        json.dump(out, f)


def ulps(a, b):
    """how far apart two fp16 tensors are, in units in the last place of b's largest element"""
    top = b.float().abs().max().item()
    ulp = 2.0 ** (math.floor(math.log2(top)) - 10) if top > 0 else 2.0 ** -24
    return (a.float() - b.float()).abs().max().item() / ulp


def reference():
    """single-process mixed precision with fp32 masters and torch's GradScaler"""
    master = model().half().float()  # the masters shardd starts from: the fp16 weights
    opt = adamw(master.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    losses, scales, skipped = [], [], []
    for step in range(STEPS):
        half = model().half()
        half.load_state_dict({k: v.half() for k, v in master.state_dict().items()})
        sums = [torch.zeros_like(p) for p in master.parameters()]
        total = 0.0
        for r in range(RANKS):
            for micro in range(ACCUM):
                half.zero_grad(set_to_none=True)
                loss = loss_of(half, step, micro, r, torch.float16)
                scaler.scale(loss).backward()
                total += loss.item() / TINY / ACCUM / RANKS
                for s, p in zip(sums, half.parameters()):
                    s += p.grad.float()
        for s, p in zip(sums, master.parameters()):
            p.grad = s / RANKS  # the mean over the ranks, still scaled
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        losses.append(total)
        scales.append(scaler.get_scale())
        skipped.append(scaler.get_scale() < before)
    final = {k: v.half() for k, v in master.state_dict().items()}
    return losses, scales, skipped, final


def fp32_losses(skipped):
    """the same model and data in fp32, no loss scaling, the steps the fp16 run skipped skipped
    alike: the losses fp16's should follow"""
    m = model()
    opt = adamw(m.parameters())
    losses = []
    for step in range(STEPS):
        total = 0.0
        for r in range(RANKS):
            for micro in range(ACCUM):
                loss = loss_of(m, step, micro, r, torch.float32)
                if not math.isfinite(loss.item()):
                    loss = loss.detach() * 0  # the injected step: skipped as the others do
                    continue
                (loss / RANKS).backward()
                total += loss.item() / TINY / ACCUM / RANKS
        if skipped[step]:
            opt.zero_grad(set_to_none=True)
            losses.append(None)
            continue
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def launch(cl, work, tag, plan, scaled):
    cmds = []
    for r in range(RANKS):
        a = {"socket": cl.socket(r // 2), "job": tag, "rank": r, "plan": plan, "scaled": scaled,
             "out": f"{work}/{tag}-{r}"}
        cmds.append([sys.executable, os.path.abspath(__file__), sys.argv[1], sys.argv[2],
                     "--worker", json.dumps(a)])
    for r, (rc, out) in enumerate(run_all(cmds, timeout=300)):
        check(rc == 0, f"{tag} rank {r} exit code {rc}:\n{out}")
    try:
        logs = [json.load(open(f"{work}/{tag}-{r}.json")) for r in range(RANKS)]
        return logs, torch.load(f"{work}/{tag}-0.pt")
    except OSError as e:
        check(False, f"{tag}: results missing ({e})")
        return None, None


def scaled_run(cl, work, ref, fp32):
    logs, params = launch(cl, work, "amp", "mics:2", True)
    if logs is None:
        return None
    ref_losses, ref_scales, ref_skipped, ref_final = ref
    for r, lg in enumerate(logs):
        check(lg["scale"] == ref_scales, f"rank {r}: the scale after each step is torch's "
              f"GradScaler's fed the same gradients:\n  {lg['scale']}\n  {ref_scales}")
        check(lg["skipped"] == ref_skipped, f"rank {r}: the same steps skipped: "
              f"{lg['skipped']} vs {ref_skipped}")
    skipped = [s + 1 for s, k in enumerate(ref_skipped) if k]
    grew = sum(1 for a, b in zip(ref_scales, ref_scales[1:]) if b > a)
    check(INJECT in skipped and len(skipped) >= 3 and grew >= 1,
          f"the run exercises the scaler: steps {skipped} skipped (the injected {INJECT} "
          f"among them, and overflows of the scale itself), {grew} growths")
    losses = [sum(lg["loss"][s] for lg in logs) / RANKS for s in range(STEPS)]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)
                if math.isfinite(b))
    check(worst <= 2e-4, f"per-step loss vs the reference: worst relative {worst:.3g}")
    apart = {k: ulps(params[k], ref_final[k]) for k in ref_final}
    check(max(apart.values()) <= 2, f"the fp16 weights within two fp16 roundings (of each "
          f"tensor's largest weight) of the reference's: {apart}")
    state = logs[0]["state"]
    check(state.get(str(INJECT - 1)) == state.get(str(INJECT)) and state.get(str(INJECT)),
          f"the moments and step counts unchanged across the skipped step {INJECT}")
    saved = logs[0].get("saved_scaler") or {}
    check(saved.get("scale") == ref_scales[RESUME_AT - 1] and
          saved.get("growth_interval") == GROWTH_INTERVAL,
          f"the checkpoint holds the scaler's state after step {RESUME_AT}: {saved}")
    stats = logs[0]["stats"]["jobs"][0]
    after = sum(1 for s in skipped if s > RESUME_AT)  # the resumed job's own counters
    check(stats.get("steps_nonfinite_scaled") == after and
          stats.get("steps_nonfinite") == after and
          stats.get("loss_scale") == logs[0]["scale"][-2],
          f"shardctl stats counts the {after} steps skipped since the resume and shows the "
          f"last step's loss scale {logs[0]['scale'][-2]}: {stats}")
    band = max(abs(a - b) / abs(b) for a, b in zip(losses, fp32) if b is not None)
    check(band <= 5e-3, f"the fp16 run's losses within 0.5% of fp32's: worst {band:.3g}")
    print(f"amp: loss {losses[0]:.4f} -> {losses[-1]:.4f} (fp32 {fp32[1]:.4f} -> "
          f"{fp32[-1]:.4f}; worst relative {band:.2e}), steps skipped {skipped}, scales "
          f"{ref_scales[0]:.3g} .. {ref_scales[-1]:.3g}", flush=True)
    return losses


def unscaled_run(cl, work, scaled_losses):
    logs, params = launch(cl, work, "noscale", "mics:2", False)
    if logs is None:
        return
    start = {k: v.half() for k, v in model().state_dict().items()}
    moved = [k for k in start if not torch.equal(params[k], start[k])]
    check(not moved, f"without loss scaling every fp16 gradient underflows: no weight moves "
          f"({moved})")
    first = sum(lg["loss"][0] for lg in logs) / RANKS
    ends = scaled_losses and [round(scaled_losses[0], 4), round(scaled_losses[-1], 4)]
    check(scaled_losses is None or scaled_losses[-1] < 2 / 3 * scaled_losses[0],
          f"with loss scaling the loss falls by more than a third ({ends}); without, it stays at "
          f"{first:.4f}")


def scaler_rule():
    """libshard's shard_scaler_update against torch._amp_update_scale_"""
    rnd = random.Random(3)
    for init in (1000.3, 3.0e38):
        mine = shard.Scaler(init, growth_factor=1.7, backoff_factor=0.37, growth_interval=3)
        scale = torch.full((), init, dtype=torch.float32)
        tracker = torch.zeros((), dtype=torch.int32)
        for i in range(200):
            found = rnd.random() < 0.2 if init < 1e38 else i % 7 == 6
            torch._amp_update_scale_(scale, tracker, torch.full((), float(found)), 1.7, 0.37, 3)
            mine.update(found)
            if mine.scale != scale.item() or mine.growth_tracker != tracker.item():
                check(False, f"scaler after outcome {i} (from {init}): libshard {mine.scale} "
                      f"tracker {mine.growth_tracker}, torch {scale.item()} tracker "
                      f"{tracker.item()}")
                return
        check(math.isfinite(mine.scale), f"from {init}: the scale equals torch's after 200 "
              f"outcomes ({mine.scale}, {mine.skipped} skipped) and stays finite")


def main():
    scaler_rule()
    work = tempfile.mkdtemp(prefix="shardd-torchamp-")
    cl = Cluster(sys.argv[1], os.path.join(work, "cluster"), 2, 2)
    try:
        if cl.ok:
            ref = reference()
            losses = scaled_run(cl, work, ref, fp32_losses(ref[2]))
            unscaled_run(cl, work, losses)
    finally:
        cl.stop()
    finish("test_torch_amp", work)


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[3] == "--worker":
        worker(json.loads(sys.argv[4]))
    else:
        main()
