#!/usr/bin/env python3
"""shard.torch on device memory (issue 37).

  test_torch_device.py SHARDD LIBSHARD plumbing   (every machine: ctest test_torch_device)
  test_torch_device.py SHARDD LIBSHARD cuda       (a GPU: ctest label gpu, tools/gpu-check.sh)
  test_torch_device.py SHARDD LIBSHARD cuda-on-cpu (cuda's flow on CPU tensors and the host
                                                   backend: this test's own check, about 4 min)

plumbing, what needs no GPU, against one real host daemon and stand-ins for the device:
  - where a model may train: _placement_error for every pairing of the model's device (CPU, a
    CUDA device by UUID) and the job's memory (host, cuda, emu-gpu), UUIDs compared however they
    are printed, each refusal naming both sides and what to do;
  - a CUDA model (a stand-in parameter on cuda:0) against the host daemon is refused at wrap's
    check, naming the device and the backend, before anything is registered; parameters on
    several devices are refused naming two, the model left where it was;
  - the views: __cuda_array_interface__ of a pointer (read-only for weights, writable for the
    staging slot) and _CudaMemory.view through torch.as_tensor (replaced by a stand-in that
    reads the interface as a CPU tensor over the same address): the right dtype, count and
    data_ptr, fp32, bf16 and fp16;
  - the order of a push on a GPU, played by a stand-in memory on a real CPU training: every
    unit's gradient is written into the staging slot libshard gave (grad_buffer), then pushed
    with the stream's handle, once a unit per backward; every release is made with the stream's
    handle (release_on_stream: the stream signals it after the slot's reads); and the run
    equals the same run through the host memory's path bit for bit, with the default pool and
    one smaller than the model (max_live_bytes).
cuda (exit 77 saying why without a CUDA torch or a GPU shardd can open):
  - the GPT example (tied embedding, two AdamW param groups, warm-up and cosine, accumulation 2,
    clipping) on CUDA tensors, 4 ranks on one GPU under zero3, mics:2 and zeropp, against the
    same model trained in one process: parameters within the CPU tests' tolerance (rtol 1e-5,
    atol 1e-5; zeropp's quantized collectives: the loss within 2% every step), every
    parameter's data_ptr inside its
    fetched slot (--check-zero-copy), no wait for the GPU in the micro-steps (torch's sync debug
    mode raises: --check-syncs) and none by libshard (shard.device_syncs() 0);
  - bf16 weights (mics:2) within the bf16 band of the CPU tests (the loss within 2% every step);
  - a non-finite step skipped on every rank, as the reference skips it;
  - a CPU model against the cuda daemon refused naming both; full_state_dict on CUDA and CPU;
    a checkpoint saved and resumed in a new job, bitwise equal to an uninterrupted run;
  - torch's state dicts (model.state_dict(), optimizer.state_dict(): shard_read out of device
    memory) loaded with load_state_dict into another job (shard_write into device memory) read
    back bitwise and go on bitwise as the job that saved them.
"""
import os
import subprocess
import sys
import tempfile
import types

from harness import ROOT, check, finish, raises, shard, torch  # noqa: F401

import shard.torch as st  # noqa: E402

nn = torch.nn
shardd, libshard = sys.argv[1], sys.argv[2]
mode = sys.argv[3] if len(sys.argv) > 3 else "plumbing"
work = tempfile.mkdtemp(prefix="shardd-torchdev-")
GPT = os.path.join(ROOT, "client", "examples", "train_gpt.py")


def start_daemon(backend):
    run = os.path.join(work, backend)
    os.makedirs(run)
    sock = os.path.join(run, "shardd.sock")
    log = open(os.path.join(run, "shardd.log"), "w")
    d = subprocess.Popen([shardd, "--runtime-dir", run, "--backend", backend, "--log-level",
                          "warn"], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(300):
        if os.path.exists(sock) or d.poll() is not None:
            break
        subprocess.run(["sleep", "0.02"])
    return d, sock


def stop_daemon(d):
    d.terminate()
    try:
        d.wait(timeout=30)
    except subprocess.TimeoutExpired:
        d.kill()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.b = nn.Linear(12, 12)
        self.c = nn.Linear(12, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def plumbing():
    # ---- _placement_error: every pairing, with stand-ins for torch's view of its GPUs
    uuids = {0: "11111111-2222-3333-4444-555555555555", 1: "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"}
    saved = st._torch_uuid, st._torch_device_of, torch.cuda.get_device_name
    st._torch_uuid = lambda dev: st._uuid_hex(uuids[torch.device(dev).index or 0])
    st._torch_device_of = lambda u: next((torch.device("cuda", k) for k, v in uuids.items()
                                          if st._uuid_hex(v) == st._uuid_hex(u)), None)
    torch.cuda.get_device_name = lambda dev: "Stand-in GPU"
    try:
        gpu1 = {"index": 0, "name": "H200", "uuid": "GPU-AAAAAAAA-BBBB-CCCC-DDDD-EEEEEEEEEEEE"}
        cpu, c0, c1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
        check(st._uuid_hex(gpu1["uuid"]) == st._uuid_hex(uuids[1]),
              "a UUID printed with GPU- and capitals is torch's without")
        check(st._placement_error(cpu, "host", None, "host") is None, "a CPU model, host memory")
        check(st._placement_error(c1, "cuda", gpu1, "cuda") is None,
              "a CUDA model on the daemon's GPU (by UUID, whatever its index)")
        e = st._placement_error(c0, "host", None, "host") or ""
        check(all(w in e for w in ("cuda:0", "backend host", "host memory", "--backend cuda",
                                   "model.cpu()")), f"a CUDA model, host memory: {e}")
        e = st._placement_error(cpu, "cuda", gpu1, "cuda") or ""
        check(all(w in e for w in ("model is on cpu", "GPU 0 (H200, GPU-AAAAAAAA", "cuda:1",
                                   "--backend host")), f"a CPU model, a GPU's memory: {e}")
        e = st._placement_error(c0, "cuda", gpu1, "cuda") or ""
        check(all(w in e for w in ("cuda:0", "GPU-11111111", "GPU-AAAAAAAA", "cuda:1")),
              f"another GPU: both named, and the one to move to: {e}")
        gone = dict(gpu1, uuid="GPU-99999999-0000-0000-0000-000000000000")
        e = st._placement_error(c0, "cuda", gone, "cuda") or ""
        check("not visible to this process" in e, f"the daemon's GPU not visible here: {e}")
        e = st._placement_error(c0, "emu-gpu", None, "emu-gpu") or ""
        check("emu-gpu" in e and "torch cannot" in e, f"emulated GPU memory: {e}")
        # wrap's check asks the daemon's topology: the device it drives is the one compared
        real_admin = st._shard.admin
        st._shard.admin = lambda cmd, socket=None: {
            "backend": "cuda",
            "devices": [{"index": 0, "name": "H200", "uuid": "GPU-" + uuids[0]},
                        dict(gpu1, index=1, driven=True)]}
        try:
            on = [("w", types.SimpleNamespace(device=c1))]
            try:
                got, why = st._check_devices(on, "sock"), ""
            except ValueError as e:
                got, why = None, str(e)
            check(got == c1, f"a model on the driven GPU (index 1) passes: {why}")
            ok, msg = raises(lambda: st._check_devices([("w", types.SimpleNamespace(device=c0))],
                                                       "sock"), "GPU 1 (H200, GPU-AAAAAAAA",
                             "cuda:1", "nothing was registered")
            check(ok, f"a model on the daemon's other GPU refused, the driven one named: {msg}")
            # a daemon driving both GPUs (devices 0,1): local rank i's is rank_devices[i mod 2]
            st._shard.admin = lambda cmd, socket=None: {
                "backend": "cuda", "ranks_per_node": 0, "rank_devices": [0, 1],
                "devices": [{"index": 0, "name": "H200", "uuid": "GPU-" + uuids[0],
                             "driven": True}, dict(gpu1, index=1, driven=True)]}
            for rank, k, dev, other, name in ((1, 2, c1, c0, "GPU 1 (H200, GPU-AAAAAAAA"),
                                              (2, 2, c0, c1, "GPU 0 (H200, GPU-11111111"),
                                              (3, 4, c1, c0, "GPU 1 (H200, GPU-AAAAAAAA")):
                try:
                    got, why = st._check_devices([("w", types.SimpleNamespace(device=dev))],
                                                 "sock", rank, k), ""
                except ValueError as e:
                    got, why = None, str(e)
                check(got == dev, f"rank {rank} of {k} a node on {dev}, its GPU, passes: {why}")
                ok, msg = raises(lambda: st._check_devices(
                    [("w", types.SimpleNamespace(device=other))], "sock", rank, k), name,
                    "nothing was registered")
                check(ok, f"rank {rank} of {k} a node on {other} refused, its GPU named: {msg}")
        finally:
            st._shard.admin = real_admin
    finally:
        st._torch_uuid, st._torch_device_of, torch.cuda.get_device_name = saved

    d, sock = start_daemon("host")
    try:
        # ---- a CUDA model against the host daemon, at wrap's check: nothing registered
        fake = [("w", types.SimpleNamespace(device=torch.device("cuda", 0)))]
        ok, msg = raises(lambda: st._check_devices(fake, sock), "cuda:0", "backend host",
                         "nothing was registered")
        check(ok, f"a CUDA model against the host daemon refused before registering: {msg}")
        m = Net()
        m.b.to("meta")
        ok, msg = raises(lambda: st.wrap(m, socket=sock, job="mixed"), "a.weight", "cpu",
                         "b.weight", "meta", "one device")
        check(ok and m.a.weight.device.type == "cpu" and m.b.weight.device.type == "meta",
              f"parameters on two devices refused naming two, left where they were: {msg}")
        r = shard.admin("jobs", socket=sock)
        check(not r.get("jobs"), f"nothing registered by the refusals: {r}")

        # ---- the views a GPU's memory gets, through torch.as_tensor's stand-in
        buf = torch.arange(64, dtype=torch.float32)
        addr = buf.data_ptr()
        ptr = st._DevicePointer(addr, 256, writable=False)
        cai = ptr.__cuda_array_interface__
        check(cai["data"] == (addr, False) and cai["shape"] == (256,) and cai["typestr"] == "|u1"
              and cai["version"] == 2 and "stream" not in cai and not ptr.writable,
              f"the weights' interface: bytes at the address, the read-only flag False (torch "
              f"refuses True; the PROT_READ mapping keeps them read-only), no stream: {cai}")
        check(st._DevicePointer(addr, 8, writable=True).__cuda_array_interface__["data"][1]
              is False, "the staging slot's interface is writable")
        real_as_tensor = torch.as_tensor
        seen = []

        def as_tensor(obj, device=None):  # a CPU tensor over the interface's bytes
            i = obj.__cuda_array_interface__
            if i["data"][1]:  # as torch 2.x does
                raise TypeError("the read only flag is not supported, should always be False")
            seen.append(device)
            import ctypes
            raw = (ctypes.c_char * i["shape"][0]).from_address(i["data"][0])
            return torch.frombuffer(raw, dtype=torch.uint8)
        torch.as_tensor = as_tensor
        try:
            mem = st._CudaMemory(torch.device("cuda", 0))
            v = mem.view(addr, 256, torch.float32, 64)
            check(v.dtype == torch.float32 and v.numel() == 64 and v.data_ptr() == addr and
                  torch.equal(v, buf) and seen[-1] == torch.device("cuda", 0),
                  "an fp32 unit's view: the slot's address, count and values, on the model's GPU")
            h = torch.arange(32, dtype=torch.bfloat16)
            v = mem.view(h.data_ptr(), 64, torch.bfloat16, 32)
            check(v.dtype == torch.bfloat16 and torch.equal(v, h), "a bf16 unit's view")
            h = torch.arange(7, dtype=torch.float16)
            v = mem.view(h.data_ptr(), 16, torch.float16, 7)
            check(v.dtype == torch.float16 and v.numel() == 7 and torch.equal(v, h),
                  "an fp16 unit's view, an odd count")
            # torch's default stream has the handle 0, which libshard takes for "no stream"
            # (a signal at the call, before the kernels ran: a GPU diverged so)
            real_current = torch.cuda.current_stream
            torch.cuda.current_stream = lambda dev=None: types.SimpleNamespace(cuda_stream=0)
            try:
                s0 = mem.stream()
                torch.cuda.current_stream = lambda dev=None: types.SimpleNamespace(cuda_stream=77)
                s77 = mem.stream()
            finally:
                torch.cuda.current_stream = real_current
            check(s0 == shard.STREAM_DEFAULT == 1 and s77 == 77,
                  f"the default stream is named CU_STREAM_LEGACY, never NULL ({s0}, {s77})")
        finally:
            torch.as_tensor = real_as_tensor

        # ---- a push on a GPU, played on a CPU training: the order of its calls
        def run(memory, job, max_live=0):
            torch.manual_seed(3)
            m = Net()
            st.wrap(m, socket=sock, job=job, plan="zero3", max_live_bytes=max_live,
                    optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2))
            state = m._shard_state
            if memory is not None:
                memory.ctx = state.ctx
                state.mem = memory
            for s in range(4):
                g = torch.Generator().manual_seed(s)
                x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
                for _ in range(2):
                    (((m(x) - y) ** 2).mean() / 2).backward()
                st.optimizer(m).step()
            out = st.full_state_dict(m)
            st.unwrap(m)
            return out

        class Played(st._HostMemory):
            """_CudaMemory's calls, on host memory: records them"""

            def __init__(self):
                self.calls, self.last_buffer = [], None
                self.device = torch.device("cpu")

            def view(self, addr, nbytes, dtype, count, writable=False):
                if writable:
                    self.calls.append(("write", addr))
                return super().view(addr, nbytes, dtype, count, writable)

            def stream(self):
                return 0x5151

            def push(self, ctx, unit):
                self.calls.append(("push", unit, self.stream()))
                ctx.push_staged_on_stream(unit, None)  # host memory has no streams

            def release(self, ctx, unit, aside):
                self.calls.append(("release", unit, self.stream()))
                ctx.release_on_stream(unit, None, aside=aside)  # host memory has no streams

        ref = run(None, "plain")
        played = Played()
        got = run(played, "played")
        pushes = [c for c in played.calls if c[0] == "push"]
        writes = [c for c in played.calls if c[0] == "write"]
        order_ok = len(pushes) == 3 * 2 * 4 and len(writes) == len(pushes) and all(
            played.calls[i - 1][0] == "write" for i, c in enumerate(played.calls)
            if c[0] == "push")
        check(order_ok and all(p[2] == 0x5151 for p in pushes),
              f"each push: its gradient written into the staging slot, then pushed with the "
              f"stream's handle ({len(writes)} writes, {len(pushes)} pushes)")
        releases = [c for c in played.calls if c[0] == "release"]
        check(len(releases) > 0 and all(c[2] == 0x5151 for c in releases),
              f"every release is signalled by the stream that read the slot ({len(releases)})")
        check(all(torch.equal(got[k], ref[k]) for k in ref),
              "the played GPU path trains bit for bit as the host path")
        check(isinstance(st._memory_for(torch.device("cpu")), st._HostMemory) and
              isinstance(st._memory_for(torch.device("cuda", 0)), st._CudaMemory),
              "a CUDA model reaches its job's memory through the stream's calls")
        small = Played()
        got = run(small, "small", max_live=800)
        check(all(torch.equal(got[k], ref[k]) for k in ref) and
              any(c[0] == "release" for c in small.calls),
              "a pool smaller than the model: the same, releases signalled by the stream")
    finally:
        stop_daemon(d)


def cuda(device="cuda"):
    """device "cpu" (mode cuda-on-cpu): the same flow on the host backend, a check of this
    test's own logic where no GPU is"""
    backend = "cuda" if device == "cuda" else "host"
    if device == "cuda" and not torch.cuda.is_available():
        print("SKIP: this torch has no CUDA device (torch.cuda.is_available() is False)")
        sys.exit(77)
    cluster = os.path.join(work, "c")
    env = dict(os.environ, SHARD_LIBRARY=os.path.abspath(libshard), PYTHONUNBUFFERED="1")
    script = os.path.join(ROOT, "tools", "local-cluster.sh")
    r = subprocess.run(["bash", script, "start", "--nodes", "1", "--ranks-per-node", "4", "--dir",
                        cluster, "--shardd", shardd, "--", "--backend", backend,
                        "--log-level", "warn"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        print(f"SKIP: shardd --backend {backend} does not start here: {r.stdout[-300:]}"
              f"{r.stderr[-300:]}")
        sys.exit(77)
    sock = os.path.join(cluster, "node0", "shardd.sock")
    try:
        def gpt(plan, tag, *extra, tol=1e-5, loss_rtol=None):
            """the example through shardd against one process: the final parameters within tol,
            or (loss_rtol: bf16 weights, quantized collectives, as the CPU tests judge them)
            rank 0's loss within loss_rtol of the same batch's in one process every step"""
            out = os.path.join(work, tag)
            os.makedirs(out, exist_ok=True)
            cmd = [sys.executable, GPT, "--launch", "--device", device, "--baseline", "single",
                   "--cluster-dir", cluster,
                   "--nodes", "1", "--ranks-per-node", "4", "--plan", plan, "--job", tag,
                   "--out", out, "--steps", "8", "--accum", "2", "--tie", "--clip", "1.0",
                   "--check-zero-copy", "--check-syncs", "--dump", "1", "--quiet", *extra]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
            check(r.returncode == 0, f"{tag}: train_gpt --launch --device {device}: "
                  f"{r.stdout[-1500:]}{r.stderr[-1500:]}")
            if r.returncode != 0:
                return
            a = torch.load(os.path.join(out, "shardd-params.pt"))
            b = torch.load(os.path.join(out, "single-params.pt"))
            worst = max((a[k].float() - b[k].float()).abs().max().item() for k in b)
            import json
            s = json.load(open(os.path.join(out, "shardd-0.json")))
            d = json.load(open(os.path.join(out, "single-0.json")))
            if loss_rtol is None:
                outside = sum(int((~torch.isclose(a[k].float(), b[k].float(), rtol=tol,
                                                  atol=tol)).sum()) for k in b)
                check(sorted(a) == sorted(b) and outside == 0,
                      f"{tag}: {outside} parameters outside rtol/atol {tol} of the one-process "
                      f"run (max |diff| {worst:.3g})")
            else:
                lw = max(abs(x - y) / abs(y) for x, y in zip(s["loss"], d["loss"]))
                check(lw <= loss_rtol and s["loss"][-1] < s["loss"][0],
                      f"{tag}: loss within {loss_rtol} of one process's every step ({lw:.3g}) "
                      f"and falling ({s['loss'][0]:.4f} -> {s['loss'][-1]:.4f})")
            check(s.get("device_syncs") == 0, f"{tag}: libshard waited for the GPU "
                  f"{s.get('device_syncs')} times")
            print(f"{tag}: max |diff| to one process {worst:.2e}; {r.stdout.strip()[-300:]}",
                  flush=True)

        gpt("zero3", "zero3")
        gpt("mics:2", "mics2")
        gpt("zeropp", "zeropp", loss_rtol=2e-2)
        gpt("mics:2", "bf16", "--dtype", "bf16", loss_rtol=2e-2)
        gpt("zero3", "nan", "--nan-step", "3")

    finally:
        subprocess.run(["bash", script, "stop", "--dir", cluster], capture_output=True,
                       text=True, timeout=120)
    d, sock = start_daemon(backend)  # jobs of one rank
    try:
        if device == "cuda":  # a CPU model against the GPU daemon: refused naming both
            ok, msg = raises(lambda: st.wrap(Net(), socket=sock, job="cpu-model"),
                             "model is on cpu", "cuda")
            check(ok, f"a CPU model against the cuda daemon refused: {msg}")

        # full_state_dict on CUDA and on the CPU; a checkpoint resumed bitwise
        def train(m, steps, start=0):
            for s in range(start, steps):
                g = torch.Generator().manual_seed(s)
                x = torch.randn(8, 6, generator=g).to(device)
                y = torch.randn(8, 3, generator=g).to(device)
                ((m(x) - y) ** 2).mean().backward()
                st.optimizer(m).step()

        torch.manual_seed(5)
        base = Net().to(device)
        m = st.wrap(_copy(base), socket=sock, job="ck-a", plan="zero3")
        train(m, 3)
        sd = st.full_state_dict(m)
        check(all(t.device.type == device for t in sd.values()),
              f"full_state_dict of a {device} model: on {device}")
        sc = st.full_state_dict(m, device="cpu")
        check(all(t.device.type == "cpu" and torch.equal(t, sd[k].cpu()) for k, t in sc.items()),
              "full_state_dict(device='cpu'): the same values on the CPU")
        ckpt = os.path.join(work, "ckpt")
        st.save(ckpt, m)
        train(m, 6, start=3)
        want = st.full_state_dict(m, device="cpu")
        st.unwrap(m)
        m2 = st.wrap(_copy(base), socket=sock, job="ck-b", plan="zero3", load=ckpt)
        check(st.start_step(m2) == 3, f"resumed at step {st.start_step(m2)}")
        train(m2, 6, start=3)
        got = st.full_state_dict(m2, device="cpu")
        st.unwrap(m2)
        check(all(torch.equal(got[k], want[k]) for k in want),
              f"a {device} model's checkpoint resumed: bitwise the uninterrupted run")

        # torch's own state dicts (shard_read of the masters and moments out of device
        # memory, shard_write into another job's): a job that loads them at step 3 goes on
        # bitwise as the job that saved them
        m3 = st.wrap(_copy(base), socket=sock, job="sd-a", plan="zero3")
        train(m3, 3)
        msd = {k: v.to(device) for k, v in m3.state_dict().items()}
        osd = st.optimizer(m3).state_dict()
        moments = [t for s in osd["state"].values() for k, t in s.items() if k != "step"]
        check(len(osd["state"]) == 6 and all(t.device.type == device for t in msd.values()),
              f"optimizer.state_dict() of a {device} model: {len(osd['state'])} parameters' "
              f"state, the weights on {device}")
        m4 = st.wrap(Net().to(device), socket=sock, job="sd-b", plan="zero3")
        keys = m4.load_state_dict(msd)
        st.optimizer(m4).load_state_dict(osd)
        back = st.optimizer(m4).state_dict()
        same = all(torch.equal(torch.as_tensor(back["state"][i][k]).cpu(),
                               torch.as_tensor(t).cpu())
                   for i, s in osd["state"].items() for k, t in s.items())
        check(not keys.missing_keys and not keys.unexpected_keys and same and moments and
              any(t.abs().sum() > 0 for t in moments),
              f"a {device} job's load_state_dict of both dicts reads back bitwise: {keys}")
        train(m3, 6, start=3)
        train(m4, 6, start=3)
        a3, a4 = st.full_state_dict(m3, device="cpu"), st.full_state_dict(m4, device="cpu")
        st.unwrap(m3)
        st.unwrap(m4)
        check(all(torch.equal(a3[k], a4[k]) for k in a3),
              f"{device}: a job started from torch's state dicts goes on bitwise as the job "
              f"that saved them (max |diff| "
              f"{max((a3[k] - a4[k]).abs().max().item() for k in a3):.3g})")
    finally:
        stop_daemon(d)


def _copy(m):
    import copy
    return copy.deepcopy(m)


if mode == "cuda":
    cuda()
elif mode == "cuda-on-cpu":
    cuda("cpu")
else:
    plumbing()
finish("test_torch_device", work)
