#!/usr/bin/env python3
"""shard.torch's behaviour where training scripts rely on torch's, against single-process torch
on one real daemon (world 1 in this process; world 2 in two launched processes):

  - default units descend into ModuleList (a GPT's blocks): a model whose blocks sit in a
    ModuleList trains, and ends allclose to plain torch AdamW after 6 steps (per-step losses too);
  - optimizer=torch.optim.AdamW(model.parameters(), lr=...) is accepted and translated with
    torch's defaults (weight decay 0.01), the same run as the reference's;
  - a dict with an unknown key ('weight_decy', also inside a param group), an optimizer keeping
    state shardd cannot hold (a list per parameter), AdamW(amsgrad=True) run in the trainers,
    a parameter left out of the torch optimizer's groups (and not frozen), a parameter in two
    param groups, an optimizer of another kind: refused naming the key, option, parameter or
    class, before anything is registered (the same job name registers right after);
  - a wrap that fails half-way (a hook that cannot be installed) leaves no hook, puts the
    parameters' values back, and leaves no job: wrapping again under the same name works;
  - model.state_dict() of a wrapped model returns the full tensors (FSDP's full state dict):
    the keys of the unwrapped model, the values of full_state_dict;
  - clip_grad_norm_ on a wrapped model warns once, pointing to max_grad_norm;
  - an in-place write into the gathered weights (p.data.add_ in a forward hook, a hand-written
    update between backward and the step) raises a ShardError naming the parameter and the
    optimizer to use, the process lives on, and no parameter changed; a torch optimizer that
    was not given to wrap raises at its step(), pointing to wrap(optimizer=), while the torch
    optimizers given to wrap step as before;
  - the job's secret: given to wrap (rank 0's random bytes broadcast by the script), both ranks
    register with it (shardctl jobs' secret); ranks of one node whose $SHARD_JOB_SECRET_FILE
    differ refused, saying so; a secret of 8 bytes refused;
  - RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID (torchrun's variables) set rank, world and the job
    name ("torch-<id>") when wrap is not given them, else SLURM_PROCID, SLURM_NTASKS and
    SLURM_JOB_ID.SLURM_STEP_ID (Slurm's: "slurm-<id>.<step>"); a RANK outside WORLD_SIZE and a
    SLURM_PROCID that is not a number are refused;
  - checkpoints: shard.torch.save after 3 steps, wrap(load=) in a new job resumes at step 3 with
    the saved parameters (and the checkpoint's lr in the optimizer's param_groups), and 3 more
    steps end bitwise equal to 6 uninterrupted ones; shard.checkpoint.load_state_dict reads
    the same parameters without a daemon (and the moments and step counts), and refuses a
    flipped byte naming the file and the extent;
  - a rank SIGKILLed mid-step (wrap(resume_timeout_ms=)): the other rank's step raises
    ShardError EPAUSED naming the rank and the step; both processes started again wrap the same
    job, start at that step, and end bitwise equal to an uninterrupted run (zero3);
  - installs as Debian users do it: cmake --install into a prefix puts the package in that
    prefix's lib/python3.X/dist-packages, where it loads the libshard installed beside it
    (SHARD_LIBRARY unset, run outside the source tree) (the README's venv, which takes the
    package with pip offline: test_readme);
  - optimizer.state_dict() of the wrapped model is torch's layout with the moments and step
    counts of a checkpoint at the same step bitwise, its load_state_dict back changes nothing
    (also through torch.distributed.checkpoint's get/set_optimizer_state_dict, keyed by name),
    and a nanoGPT-style torch.save({"model", "optimizer"}) holds both; what cannot work on a
    wrapped model raises ShardError naming the call and the fix, nothing written or changed:
    torch.save(model), copy.deepcopy; optimizer.load_state_dict of a dict that is not torch's
    is refused; load_state_dict() on the model refuses a missing
    key, an unexpected one, another shape as torch does, writing nothing, then writes every
    parameter into shardd bitwise, with strict=False what the dict has (reporting the missing
    keys), on a submodule under its own names, and the saved state dict back restores every
    parameter; a submodule's state_dict() is its full
    tensors under its own names; under zeropp, state_dict() returns the fp32 masters (a
    checkpoint's at the same step, bitwise), not the int8-gathered weights; SGD with lr=20 trains as torch's, a negative lr is
    refused.

Skipped (exit 77, with the reason) where PyTorch cannot be imported.
usage: test_torch_api.py SHARDD LIBSHARD
"""
import copy
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings

from harness import ROOT, check, finish, raises, shard, spawn, torch  # noqa: F401

import shard.torch as st  # noqa: E402

nn = torch.nn
shardd, libshard = sys.argv[1], sys.argv[2]


class Net(nn.Module):
    """embedding, blocks in a ModuleList (called in a loop, as GPTs do), head"""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(h)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def train(model, steps, opt=None, start=0):
    """losses of steps start .. steps - 1; through shardd when opt is None"""
    losses = []
    for s in range(start, steps):
        x, y = batch(s)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        losses.append(loss.item())
        if opt is None:
            st.step(model)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses


work = tempfile.mkdtemp(prefix="shardd-torchapi-")
sock = os.path.join(work, "shardd.sock")
daemon = subprocess.Popen([shardd, "--runtime-dir", work, "--log-level", "warn"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
os.environ["SHARD_SOCKET"] = sock
for _ in range(200):
    if os.path.exists(sock):
        break
    time.sleep(0.05)
try:
    check(os.path.exists(sock), "shardd started")
    # the binding's stream push: a stream on host memory is refused by name; None pushes
    raw = shard.Context(sock)
    raw.register(job="stream-api", rank=0, world=1, plan="zero3",
                 tensors=[shard.Tensor("a", (10,))], optimizer={"name": "sgd", "lr": 0.5})
    buf = (ctypes.c_float * 10).from_address(raw.grad_buffer(0))
    for i in range(10):
        buf[i] = 1.0
    ok, msg = raises(lambda: raw.push_staged_on_stream(0, 1234), "has no streams", "host",
                     kinds=(shard.ShardError,))
    check(ok, f"push_staged_on_stream with a stream on host memory refused: {msg}")
    raw.push_staged_on_stream(0, None)
    check(abs(raw.step() - 10 ** 0.5) < 1e-6, "push_staged_on_stream(None) pushed the gradient")
    raw.detach()
    torch.manual_seed(0)
    base = Net()

    # ModuleList units, a torch AdamW translated (torch's default weight decay 0.01)
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    ref_losses = train(ref, 6, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    st.wrap(mine, job="mlist", optimizer=torch.optim.AdamW(mine.parameters(), lr=1e-2))
    nunits = len(st._state_of(mine).units)
    check(nunits == 5, f"default units: embed, 3 blocks of the ModuleList, head: {nunits}")
    losses = train(mine, 6)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    check(worst <= 1e-5, f"per-step losses vs torch AdamW: worst relative {worst:.3g}")
    full = st.full_state_dict(mine)
    want = ref.state_dict()
    maxd = max((full[k] - want[k]).abs().max().item() for k in want)
    check(sorted(full) == sorted(want) and maxd <= 1e-5,
          f"parameters vs torch AdamW after 6 steps: max |diff| {maxd:.3g}")
    print(f"ModuleList model, torch AdamW translated: 6 steps, loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}, worst loss difference {worst:.2e}, parameters max |diff| "
          f"{maxd:.2e}", flush=True)

    # FSDP2's set_requires_gradient_sync on the wrapped model: accumulation as FSDP2 scripts
    # write it (False, then True on the last micro-step) trains as the same loop without the
    # calls, bitwise; a backward after the promised last one fails the job naming it
    runs = {}
    for tag, calls in (("sync-plain", False), ("sync-fsdp2", True)):
        m = copy.deepcopy(base)
        st.wrap(m, job=tag, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2))
        for s_ in range(3):
            for micro in range(2):
                if calls:
                    m.set_requires_gradient_sync(micro == 1)
                x, y = batch(10 * s_ + micro)
                (((m(x) - y) ** 2).mean() / 2).backward()
            st.step(m)
        runs[tag] = st.full_state_dict(m)
        st.unwrap(m)
    same = all(torch.equal(runs["sync-plain"][k], runs["sync-fsdp2"][k]) for k in runs["sync-plain"])
    check(same, "set_requires_gradient_sync(micro == last) trains bitwise as without the calls")
    m = copy.deepcopy(base)
    st.wrap(m, job="sync-broken", optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2))
    m.set_requires_gradient_sync(False)
    x, y = batch(0)
    ((m(x) - y) ** 2).mean().backward()
    m.set_requires_gradient_sync(True)
    ((m(x) - y) ** 2).mean().backward()  # the promised last
    ok, msg = raises(lambda: (((m(x) - y) ** 2).mean().backward(), st.step(m)),
                     "shard_last_micro_step", kinds=(shard.ShardError,))
    check(ok, f"a backward after the promised last one fails, naming the promise: {msg}")
    try:
        st.unwrap(m)
    except shard.ShardError:
        pass
    print("set_requires_gradient_sync: FSDP2's accumulation loop bitwise the plain one; a broken "
          f"promise refused: {msg[:100]}", flush=True)

    # checkpoints: save, resume in another job, the same as an uninterrupted run
    import shard.checkpoint as sck
    torch.manual_seed(1)
    m0 = Net()
    a, b = copy.deepcopy(m0), copy.deepcopy(m0)
    ckdir = os.path.join(work, "ck")
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2)
    st.wrap(a, job="ck-straight", optimizer=oa)
    train(a, 3)
    saved = st.save(ckdir, a)
    full3 = st.full_state_dict(a)
    sd3 = sck.load_state_dict(ckdir, optimizer_states=True)
    # torch's optimizer.state_dict() of the wrapped model: the checkpoint's moments and step
    # counts (read by shard.checkpoint without a daemon), bitwise; loading it back changes
    # nothing (the 3 steps after still equal the resumed job's, below)
    osd = st.optimizer(a).state_dict()
    names = [n for n, _ in a.named_parameters()]
    exact = len(osd["state"]) == len(names) and all(
        torch.equal(osd["state"][i][s_], sd3["optimizer"][n][s_]) and
        osd["state"][i]["step"].item() == sd3["optimizer"][n]["step"]
        for i, n in enumerate(names) for s_ in ("exp_avg", "exp_avg_sq"))
    check(exact and osd["param_groups"][0]["params"] == list(range(len(names))) and
          osd["param_groups"][0]["lr"] == 1e-2,
          "optimizer.state_dict(): torch's layout, the checkpoint's moments and steps bitwise")
    st.optimizer(a).load_state_dict(osd)
    again = st.optimizer(a).state_dict()
    check(all(torch.equal(again["state"][i][k], v) for i, e in osd["state"].items()
              for k, v in e.items()), "optimizer.load_state_dict of its own state_dict: the same")
    # the same through torch.distributed.checkpoint's state-dict API, as FSDP2 scripts call it
    # (keyed by the parameters' names; no process group needed for a full state dict)
    from torch.distributed.checkpoint import state_dict as dsd
    fo = dsd.StateDictOptions(full_state_dict=True)
    fsd = dsd.get_optimizer_state_dict(a, oa, options=fo)
    check(sorted(fsd["state"]) == sorted(names) and
          all(torch.equal(fsd["state"][n][s_], osd["state"][i][s_])
              for i, n in enumerate(names) for s_ in ("exp_avg", "exp_avg_sq", "step")),
          "get_optimizer_state_dict(full_state_dict=True): optimizer.state_dict() under FQNs")
    dsd.set_optimizer_state_dict(a, oa, fsd, options=fo)
    again = st.optimizer(a).state_dict()
    msd = dsd.get_model_state_dict(a, options=fo)
    check(all(torch.equal(again["state"][i][k], v) for i, e in osd["state"].items()
              for k, v in e.items()) and all(torch.equal(msd[k], full3[k]) for k in full3),
          "set_optimizer_state_dict of it changes nothing; get_model_state_dict: the full tensors")
    la = train(a, 6, start=3)
    full6 = st.full_state_dict(a)
    st.unwrap(a)
    check(saved == 3 and open(os.path.join(ckdir, "LATEST")).read() == "step-00000003\n",
          f"shard.torch.save returns the step and LATEST names it: {saved}")
    sd = sck.load_state_dict(ckdir, optimizer_states=True)
    check(all(torch.equal(sd[k], full3[k]) for k in full3) and sd["step"] == 3 and
          sd["optimizer"]["embed.weight"]["step"] == 3 and
          sd["optimizer"]["embed.weight"]["exp_avg"].shape == full3["embed.weight"].shape,
          "shard.checkpoint.load_state_dict: the saved parameters, moments and step counts")
    ob = torch.optim.AdamW(b.parameters(), lr=5e-2)  # the checkpoint's lr replaces it
    st.wrap(b, job="ck-resumed", optimizer=ob, load=ckdir)
    check(st.start_step(b) == 3 and abs(ob.param_groups[0]["lr"] - 1e-2) < 1e-9,
          f"wrap(load=): start step {st.start_step(b)}, lr {ob.param_groups[0]['lr']}")
    resumed3 = st.full_state_dict(b)
    check(all(torch.equal(resumed3[k], full3[k]) for k in full3),
          "wrap(load=): the saved parameters")
    lb = train(b, 6, start=3)
    full6b = st.full_state_dict(b)
    st.unwrap(b)
    check(la == lb and all(torch.equal(full6b[k], full6[k]) for k in full6),
          "3 steps, save, resume, 3 steps: bitwise the 6 uninterrupted steps (losses, params)")
    bad = os.path.join(work, "ck-bad")
    import shutil
    shutil.copytree(sck.info(ckdir)["path"], bad)
    with open(os.path.join(bad, "data-0.bin"), "r+b") as f:
        f.seek(10)
        c = f.read(1)
        f.seek(10)
        f.write(bytes([c[0] ^ 1]))
    ok, msg = raises(lambda: sck.load_state_dict(bad), "data-0.bin is corrupt", "extent")
    check(ok, f"load_state_dict of a flipped byte: {msg}")
    print(f"checkpoint: saved step 3, resumed in another job, 3 more steps bitwise equal to 6 "
          f"uninterrupted (loss {la[-1]:.5f})", flush=True)

    # model.state_dict() is the full state dict, a submodule's too (its own names)
    sd = mine.state_dict()
    check(sorted(sd) == sorted(want) and all(torch.equal(sd[k], full[k]) for k in full),
          "model.state_dict() of a wrapped model: the full tensors")
    sub = mine.blocks[1].state_dict()
    check(sorted(sub) == ["bias", "weight"] and
          all(torch.equal(sub[k], full["blocks.1." + k]) for k in sub),
          f"a submodule's state_dict(): its full tensors under its own names: {sorted(sub)}")
    # what cannot work on a wrapped model raises a ShardError naming the call and the fix,
    # before anything is written (nanoGPT's resume saves both dicts in one torch.save)
    import io
    out = io.BytesIO()
    torch.save({"model": mine.state_dict(), "optimizer": st.optimizer(mine).state_dict()}, out)
    out.seek(0)
    back = torch.load(out)
    check(sorted(back["model"]) == sorted(want) and
          all(sorted(e) == ["exp_avg", "exp_avg_sq", "step"]
              for e in back["optimizer"]["state"].values()) and
          len(back["optimizer"]["state"]) == len(list(mine.parameters())),
          "nanoGPT's torch.save({'model', 'optimizer'}) of a wrapped model holds both")
    ok, msg = raises(lambda: st.optimizer(mine).load_state_dict({"state": {}}),
                     "'state' and 'param_groups'", kinds=(ValueError,))
    check(ok, f"optimizer.load_state_dict() of a dict that is not torch's refused: {msg}")
    ok, msg = raises(lambda: torch.save(mine, io.BytesIO()), "torch.save(model)",
                     "model.state_dict()", kinds=(shard.ShardError,))
    check(ok, f"torch.save(model) of a wrapped model refused naming what to save: {msg}")
    ok, msg = raises(lambda: copy.deepcopy(mine), "copy.deepcopy", kinds=(shard.ShardError,))
    check(ok, f"copy.deepcopy of a wrapped model refused: {msg}")
    # load_state_dict on the wrapped model and on a submodule: torch's strict checks (nothing
    # written when they fail), then the values written into shardd, bitwise
    other = {k: v + 0.25 for k, v in sd.items()}
    for what, bad, words in (
            ("a missing key", {k: v for k, v in other.items() if k != "head.bias"},
             ["Missing key(s)", '"head.bias"']),
            ("an unexpected key", dict(other, extra=torch.zeros(1)),
             ["Unexpected key(s)", '"extra"']),
            ("another shape", dict(other, **{"head.bias": torch.zeros(5)}),
             ["size mismatch for head.bias", "torch.Size([4])"])):
        ok, msg = raises(lambda: mine.load_state_dict(bad), *words, kinds=(RuntimeError,))
        check(ok, f"load_state_dict with {what} refused as torch does: {msg}")
    after = st.full_state_dict(mine)
    check(all(torch.equal(after[k], full[k]) for k in full),
          "no parameter changed by the refused loads")
    keys = mine.load_state_dict(other)
    after = st.full_state_dict(mine)
    check(list(keys) == [[], []] and all(torch.equal(after[k], other[k]) for k in other),
          f"model.load_state_dict writes every parameter into shardd, bitwise: {keys}")
    part = {k: v for k, v in sd.items() if k.startswith("head.")}
    keys = mine.load_state_dict(part, strict=False)
    after = st.full_state_dict(mine)
    check(sorted(keys.missing_keys) == sorted(k for k in sd if not k.startswith("head.")) and
          keys.unexpected_keys == [] and
          all(torch.equal(after[k], part[k] if k in part else other[k]) for k in sd),
          "strict=False loads what the dict has, reports the missing keys, leaves the rest")
    keys = mine.blocks[1].load_state_dict({"weight": full["blocks.1.weight"],
                                           "bias": full["blocks.1.bias"]})
    after = st.full_state_dict(mine)
    check(list(keys) == [[], []] and torch.equal(after["blocks.1.weight"],
                                                 full["blocks.1.weight"]),
          "a submodule's load_state_dict writes under its own names")
    mine.load_state_dict(sd)
    after = st.full_state_dict(mine)
    check(all(torch.equal(after[k], full[k]) for k in full),
          "loading the saved state dict back restores every parameter bitwise")
    # under a plan that gathers int8 weights, state_dict() returns the fp32 masters: those of
    # a checkpoint at the same step (shard.checkpoint, without a daemon), bitwise
    qz = copy.deepcopy(base)
    st.wrap(qz, job="qw", plan="zeropp", optimizer=torch.optim.AdamW(qz.parameters(), lr=1e-2))
    train(qz, 2)
    qdir = os.path.join(work, "ck-zeropp")
    st.save(qdir, qz)
    masters = sck.load_state_dict(qdir)
    qsd = qz.state_dict()
    check(sorted(qsd) == sorted(masters) and all(torch.equal(qsd[k], masters[k]) for k in qsd),
          "zeropp: model.state_dict() is the fp32 masters bitwise, not the int8-gathered weights")
    st.unwrap(qz)

    # clip_grad_norm_ warns once
    x, y = batch(0)
    ((mine(x) - y) ** 2).mean().backward()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.nn.utils.clip_grad_norm_(mine.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(mine.parameters(), 1.0)
    msgs = [str(m.message) for m in w if "clip_grad_norm_" in str(m.message)]
    check(len(msgs) == 1 and "max_grad_norm" in msgs[0],
          f"clip_grad_norm_ on a wrapped model warns once, naming max_grad_norm: {msgs}")
    st.step(mine)
    st.unwrap(mine)

    # refusals, naming what is wrong; nothing registered
    m = copy.deepcopy(base)
    ok, msg = raises(lambda: st.wrap(m, job="bad", optimizer={"name": "adamw",
                                                                "weight_decy": 0.1}),
                     "weight_decy")
    check(ok, f"unknown optimizer key refused naming it: {msg}")
    # an option shardd's own AdamW has not: the ranks run torch's on their shards (its three
    # per-element states kept by the daemon); one that keeps other state is refused naming it
    am = copy.deepcopy(base)
    st.wrap(am, job="amsgrad", optimizer=torch.optim.AdamW(am.parameters(), amsgrad=True))
    kind = st._state_of(am).kind
    st.unwrap(am)
    check(kind == "trainer3", f"AdamW(amsgrad=True) runs in the trainers with 3 states: {kind}")

    class Odd(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            super().step(closure)
            for g in self.param_groups:
                for p in g["params"]:
                    self.state[p]["history"] = [1.0]  # not a tensor of the parameter's shape
    ok, msg = raises(lambda: st.wrap(m, job="bad", optimizer=Odd(m.parameters(), lr=0.1)),
                     "history")
    check(ok, f"an optimizer keeping state shardd cannot hold refused naming it: {msg}")
    ok, msg = raises(lambda: st.wrap(m, job="bad", optimizer={
        "param_groups": [{"params": list(m.parameters()), "weight_decy": 0.0}]}), "weight_decy")
    check(ok, f"unknown key in a param group refused naming it: {msg}")
    some = [p for n, p in m.named_parameters() if n != "blocks.1.weight"]
    ok, msg = raises(lambda: st.wrap(m, job="bad", optimizer=torch.optim.AdamW(some)),
                     "blocks.1.weight")
    check(ok, f"a parameter outside the torch optimizer refused naming it: {msg}")
    ok, msg = raises(lambda: st.wrap(m, job="bad", optimizer={"param_groups": [
        {"params": ["head.bias"]}, {"params": list(m.parameters())}]}), "param_groups 0 and 1")
    check(ok, f"a parameter in two param groups refused: {msg}")
    # a large learning rate is the user's (word_language_model's SGD uses 20), a negative one
    # is refused as torch refuses it
    big, ref20 = copy.deepcopy(base), copy.deepcopy(base)
    train(ref20, 1, torch.optim.SGD(ref20.parameters(), lr=20.0))
    st.wrap(big, job="lr20", optimizer=torch.optim.SGD(big.parameters(), lr=20.0))
    train(big, 1)
    d20 = max((st.full_state_dict(big)[k] - v).abs().max().item()
              for k, v in ref20.state_dict().items())
    st.unwrap(big)
    check(d20 <= 1e-5, f"SGD lr=20 trains as torch's: max |diff| after a step {d20:.3g}")
    ok, msg = raises(lambda: st.wrap(m, job="bad", optimizer={"name": "sgd", "lr": -1.0}),
                     "lr is -1", "at least 0", kinds=(shard.ShardError, ValueError))
    check(ok, f"a negative lr refused: {msg}")
    ok, msg = raises(lambda: st.wrap(m, job="bad", optimizer=torch.optim.LBFGS(
        m.parameters())), "LBFGS", "closure")
    check(ok, f"an optimizer that cannot step on a shard (LBFGS) refused naming it: {msg}")
    ok, msg = raises(lambda: st.wrap(m, job="bad", optimizer=torch.optim.Adagrad(
        m.parameters(), initial_accumulator_value=0.1)), "Adagrad", "sum", "0")
    check(ok, f"a state that starts other than 0 refused naming it: {msg}")
    # parameters on a device shard.torch does not train (meta) are refused naming it, not
    # moved (CUDA models against a host daemon: test_torch_device.py)
    off = copy.deepcopy(base).to("meta")
    ok, msg = raises(lambda: st.wrap(off, job="bad"), "meta", "CPU and CUDA models",
                     "nothing was registered")
    check(ok and all(p.device.type == "meta" for p in off.parameters()),
          f"a model off the CPU refused, its parameters where they were: {msg}")
    try:
        st.wrap(m, job="bad")
        check(True, "the same job name registers after the refusals")
        st.unwrap(m)
    except Exception as e:
        check(False, f"wrap after the refusals: {e}")

    # a wrap that fails half-way leaves nothing behind
    m = copy.deepcopy(base)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    orig = nn.Module.register_forward_hook
    calls = [0]

    def failing(self, hook, *a, **k):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("cannot install this hook (test)")
        return orig(self, hook, *a, **k)

    nn.Module.register_forward_hook = failing
    try:
        st.wrap(m, job="half")
        check(False, "the failing hook made wrap fail")
    except RuntimeError as e:
        check("test" in str(e), f"wrap's own error comes through: {e}")
    finally:
        nn.Module.register_forward_hook = orig
    hooks = sum(len(mod._forward_pre_hooks) + len(mod._forward_hooks) for mod in m.modules())
    hooks += sum(len(p._backward_hooks or {}) for p in m.parameters())
    check(hooks == 0, f"no hook left after a failed wrap: {hooks}")
    now = m.state_dict()
    check(all(torch.equal(now[k], before[k]) for k in before),
          "the parameters' values are back after a failed wrap")
    try:
        st.wrap(m, job="half")
        losses = train(m, 2)
        check(len(losses) == 2, "the same job wraps and trains after a failed wrap")
        st.unwrap(m)
    except Exception as e:
        check(False, f"wrap again after a failed wrap: {e}")

    # an in-place write into the gathered weights (a torch optimizer's update, p.data.add_)
    # raises a Python error naming the parameter and what to use instead, never a segfault,
    # and the write is discarded
    m = copy.deepcopy(base)
    st.wrap(m, job="scribble")
    before = st.full_state_dict(m)
    hook = m.blocks[1].register_forward_pre_hook(lambda mod, inp: mod.weight.data.add_(1.0))
    x, y = batch(0)
    ok, msg = raises(lambda: m(x), "blocks.1.weight", kinds=(shard.ShardError,))
    check(ok and "read-only" in msg and "shard.torch.optimizer" in msg,
          f"p.data.add_ on a gathered weight: a Python error naming it: {msg}")
    hook.remove()
    after = st.full_state_dict(m)
    check(all(torch.equal(after[k], before[k]) for k in before),
          "the caught write changed no parameter")
    st.unwrap(m)
    # the other routes to it: a hand-written update between backward and the step
    # (p.data -= lr * p.grad, with gradients of the user's own) is caught at the step; a torch
    # optimizer that was not given to wrap raises at its own step(), before writing anything
    m = copy.deepcopy(base)
    st.wrap(m, job="scribble2")
    before = st.full_state_dict(m)
    stray = torch.optim.SGD(m.parameters(), lr=0.1)
    ((m(x) - y) ** 2).mean().backward()
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    ok, msg2 = raises(stray.step, "SGD", "shard.torch.wrap(model, optimizer=",
                      kinds=(RuntimeError,))
    check(ok, f"a torch optimizer not given to wrap raises at its step(): {msg2}")
    for p in m.parameters():
        p.data -= 0.1 * p.grad
    ok, msg2 = raises(lambda: st.step(m), "read-only", "weight", kinds=(shard.ShardError,))
    check(ok, f"a hand-written in-place update: the step raises: {msg2}")
    after = st.full_state_dict(m)
    check(all(torch.equal(after[k], before[k]) for k in before),
          "neither changed a parameter")
    print(f"in-place write into gathered weights: {msg[:200]}...", flush=True)
    st.unwrap(m)

    # a rank dies mid-step: the other's call raises EPAUSED; every rank wraps again and the job
    # resumes from the last completed step, bitwise the uninterrupted run (zero3)
    resume = ("import os, signal, sys, torch, shard, shard.torch as st\n"
              "rank, job, kill_at = int(os.environ['RANK']), os.environ['JOB'], "
              "int(os.environ['KILL_AT'])\n"
              "torch.manual_seed(0)\n"
              "m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), "
              "torch.nn.Linear(16, 4))\n"
              "st.wrap(m, job=job, rank=rank, world=2, plan='zero3', resume_timeout_ms=60000,\n"
              "        optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2))\n"
              "print('START', st.start_step(m), flush=True)\n"
              "try:\n"
              "    for s in range(st.start_step(m), 8):\n"
              "        g = torch.Generator().manual_seed(1000 * rank + s)\n"
              "        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)\n"
              "        ((m(x) - y) ** 2).mean().backward()\n"
              "        if s == kill_at:  # its gradients pushed, the step not taken\n"
              "            os.kill(os.getpid(), signal.SIGKILL)\n"
              "        st.step(m)\n"
              "except shard.ShardError as e:\n"
              "    print('PAUSED', e.status == shard.EPAUSED, e, flush=True)\n"
              "    sys.exit(3)\n"
              "if rank == 0:\n"
              "    torch.save(st.full_state_dict(m), os.environ['OUT'])\n"
              "print('DONE', flush=True)\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "client", "python"))

    def ranks(job, kill_at, out):
        procs = [spawn([sys.executable, "-c", resume],
                       env=dict(env, RANK=str(r), JOB=job, OUT=out,
                                KILL_AT=str(kill_at if r == 1 else -1)))
                 for r in range(2)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outs)]

    whole, resumed = os.path.join(work, "whole.pt"), os.path.join(work, "resumed.pt")
    outs = ranks("py-whole", -1, whole)
    check(all(rc == 0 for rc, _ in outs), f"the uninterrupted run: {outs}")
    outs = ranks("py-resume", 5, resumed)
    paused = outs[0][1]
    check(outs[1][0] == -signal.SIGKILL and outs[0][0] == 3 and "PAUSED True" in paused
          and "rank 1" in paused and "step 5" in paused,
          f"rank 1 killed in step 5: rank 0's step raises EPAUSED naming rank 1 and step 5: "
          f"{outs}")
    outs = ranks("py-resume", -1, resumed)
    check(all(rc == 0 and "START 5" in out for rc, out in outs),
          f"wrapping again resumes the paused job at step 5: {outs}")
    if os.path.exists(whole) and os.path.exists(resumed):
        a, b = torch.load(whole), torch.load(resumed)
        check(sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a),
              "killed in step 5, resumed: bitwise the uninterrupted 8 steps")
        print(f"paused and resumed: {paused.strip().splitlines()[-1][:200]}", flush=True)
    else:
        check(False, "both runs saved their parameters")

    # torchrun's variables
    script = ("import torch, shard, shard.torch as st\n"
              "torch.manual_seed(0)\n"
              "m = torch.nn.Linear(4, 2)\n"
              "st.wrap(m)\n"
              "for s in range(2):\n"
              "    m(torch.ones(3, 4)).sum().backward()\n"
              "    st.step(m)\n"
              "jobs = shard.admin('jobs')['jobs']\n"
              "print('JOBS', [(j['name'], j['world']) for j in jobs])\n")
    def launched(env, rank_var, job, what):
        """two ranks whose rank is rank_var: each sees the job named job of world 2"""
        procs = [spawn([sys.executable, "-c", script], env=dict(env, **{rank_var: str(r)}))
                 for r in range(2)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        for r, (p, out) in enumerate(zip(procs, outs)):
            check(p.returncode == 0 and f"('{job}', 2)" in out,
                  f"rank {r} from {what}: job {job} of world 2 (exit {p.returncode}):\n{out}")

    env = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="abc123",
               PYTHONPATH=os.path.join(ROOT, "client", "python"))
    launched(env, "RANK", "torch-abc123", "RANK/WORLD_SIZE/TORCHELASTIC_RUN_ID")
    # Slurm's: SLURM_PROCID, SLURM_NTASKS, SLURM_NTASKS_PER_NODE, SLURM_JOB_ID.SLURM_STEP_ID
    slurm = dict(os.environ, SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_ID="77",
                 SLURM_STEP_ID="3", PYTHONPATH=os.path.join(ROOT, "client", "python"))
    launched(slurm, "SLURM_PROCID", "slurm-77.3", "SLURM_PROCID/SLURM_NTASKS/SLURM_JOB_ID")
    r = subprocess.run([sys.executable, "-c", script], env=dict(slurm, SLURM_PROCID="x"),
                       capture_output=True, text=True, timeout=120)
    check(r.returncode != 0 and "SLURM_PROCID='x' is not a number" in r.stderr,
          f"a SLURM_PROCID that is not a number refused: {r.stderr[-300:]}")
    r = subprocess.run([sys.executable, "-c", script], env=dict(env, RANK="2"),
                       capture_output=True, text=True, timeout=120)
    check(r.returncode != 0 and "rank 2 is outside world 2" in r.stderr,
          f"RANK outside WORLD_SIZE refused: {r.stderr[-300:]}")
    # the job's secret: given to wrap (here rank 0's random bytes, broadcast over the process
    # group by the script), both ranks register with it; $SHARD_JOB_SECRET_FILE that differs
    # between a node's ranks refused (the second, saying so); one too short refused by libshard
    gsec = ("import os, torch, torch.distributed as dist, shard, shard.torch as st\n"
            "dist.init_process_group('gloo', rank=int(os.environ['RANK']), world_size=2)\n"
            "box = [os.urandom(32) if dist.get_rank() == 0 else None]\n"
            "dist.broadcast_object_list(box, src=0)\n"
            "torch.manual_seed(0)\n"
            "m = torch.nn.Linear(4, 2)\n"
            "st.wrap(m, job='py-secret', job_secret=box[0])\n"
            "m(torch.ones(3, 4)).sum().backward()\n"
            "st.step(m)\n"
            "print('SECRET', [j['secret'] for j in shard.admin('jobs')['jobs']\n"
            "                 if j['name'] == 'py-secret'])\n"
            "dist.destroy_process_group()\n")
    genv = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 9000))
    procs = [spawn([sys.executable, "-c", gsec], env=dict(genv, RANK=str(r)))
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    check(all(p.returncode == 0 and "SECRET [True]" in out for p, out in zip(procs, outs)),
          f"a secret given to wrap: both ranks register with it: {outs}")
    keys = []
    for r in range(2):
        keys.append(os.path.join(work, f"job{r}.key"))
        with open(keys[r], "wb") as f:
            f.write(bytes([r + 1]) * 32)
    fsec = ("import torch, shard.torch as st\n"
            "m = torch.nn.Linear(4, 2)\n"
            "st.wrap(m, job='py-secrets')\n"
            "print('REGISTERED')\n")
    procs = [spawn([sys.executable, "-c", fsec],
                   env=dict(env, RANK=str(r), SHARD_JOB_SECRET_FILE=keys[r]))
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    check(all(p.returncode != 0 for p in procs) and
          any("another job secret than the other ranks of this node" in out for out in outs),
          f"two ranks of one node with different secrets ($SHARD_JOB_SECRET_FILE): refused, "
          f"saying so: {[out[-300:] for out in outs]}")
    m = torch.nn.Linear(4, 2)
    ok, msg = raises(lambda: st.wrap(m, job="short-secret", job_secret=b"12345678"),
                     "a job secret of 8 bytes", "give 16-4096", kinds=(Exception,))
    check(ok, f"a job secret of 8 bytes refused: {msg}")

    # shard.torch.launcher: what wrap takes, before wrap (a script picking its data by rank)
    q = ("import shard.torch as st\n"
         "print('L', st.launcher(), st.launcher(job='mine', rank=0))\n")
    r = subprocess.run([sys.executable, "-c", q], env=dict(env, RANK="1"), capture_output=True,
                       text=True, timeout=120)
    check(r.returncode == 0 and "L ('torch-abc123', 1, 2) ('mine', 0, 2)" in r.stdout,
          f"launcher() from torchrun's variables, arguments first: {r.stdout}{r.stderr[-300:]}")
    r = subprocess.run([sys.executable, "-c", q], env=dict(slurm, SLURM_PROCID="1"),
                       capture_output=True, text=True, timeout=120)
    check(r.returncode == 0 and "L ('slurm-77.3', 1, 2) ('mine', 0, 2)" in r.stdout,
          f"launcher() from Slurm's: {r.stdout}{r.stderr[-300:]}")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID",
                          "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID")}
    r = subprocess.run([sys.executable, "-c", q],
                       env=dict(clean, PYTHONPATH=os.path.join(ROOT, "client", "python")),
                       capture_output=True, text=True, timeout=120)
    check(r.returncode == 0 and "L ('torch', 0, 1) ('mine', 0, 1)" in r.stdout,
          f"launcher() without a launcher: job torch, rank 0 of 1: {r.stdout}{r.stderr[-300:]}")
    # torchrun's LOCAL_WORLD_SIZE is the job's ranks per node: one rank per node needs two
    # nodes, which an independent daemon forms only with the job's secret
    r = subprocess.run([sys.executable, "-c", script],
                       env=dict(env, RANK="0", LOCAL_WORLD_SIZE="1"),
                       capture_output=True, text=True, timeout=120)
    check(r.returncode != 0 and "world size 2 spans 2 nodes of 1 ranks" in r.stderr
          and "needs a job secret" in r.stderr,
          f"LOCAL_WORLD_SIZE=1 of WORLD_SIZE 2 on one daemon refused: {r.stderr[-300:]}")

    # installs: cmake --install into a prefix (the README's venv and its pip install of the
    # package: test_readme)
    build = os.path.dirname(os.path.dirname(os.path.abspath(libshard)))
    prefix = os.path.join(work, "prefix")
    r = subprocess.run(["cmake", "--install", build, "--prefix", prefix], capture_output=True,
                       text=True, timeout=300)
    check(r.returncode == 0, f"cmake --install --prefix: {r.stdout[-300:]}{r.stderr[-300:]}")
    pydir = os.path.join(prefix, "lib", "python%d.%d" % sys.version_info[:2], "dist-packages")
    clean = {k: v for k, v in os.environ.items() if k != "SHARD_LIBRARY"}
    r = subprocess.run([sys.executable, "-c", "import shard, shard.torch; "
                        "print(shard.__file__); print(shard.library_path)"],
                       capture_output=True, text=True, cwd=work, timeout=120,
                       env=dict(clean, PYTHONPATH=pydir))
    lines = r.stdout.split()
    check(r.returncode == 0 and len(lines) == 2 and lines[0].startswith(pydir) and
          lines[1] == os.path.join(prefix, "lib", "libshard.so.0"),
          f"the installed package loads the installed libshard: {r.stdout}{r.stderr[-2000:]}")
finally:
    daemon.send_signal(signal.SIGTERM)
    try:
        _, err = daemon.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        daemon.kill()
        _, err = daemon.communicate()
    check(daemon.returncode == 0, f"shardd exit {daemon.returncode}: {err[-500:]}")
finish("test_torch_api", work)
