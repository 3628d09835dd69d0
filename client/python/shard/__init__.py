"""Python binding of libshard, the client library of shardd (ctypes; no compiled extension).

    ctx = shard.Context("/run/shardd/shardd.sock")
    ctx.register(job="j", rank=0, world=2, plan="mics:2", tensors=[...],
                 optimizer={"name": "adamw", "lr": 1e-3}, init=[...])
    addr, nbytes = ctx.fetch(unit)        # the gathered unit, read-only shared memory
    ctx.release(unit)
    ctx.push_grad(unit, addr, nbytes)     # this micro-step's gradient of the unit
    addr = ctx.grad_buffer(unit)          # or write it into shardd's staging buffer,
    ctx.push_staged(unit)                 # without the copy
    norm = ctx.step()

Every libshard error becomes a ShardError carrying the status (an int, shard.EJOBFAILED ...),
its name and the daemon's message. See client/include/shard.h for the semantics.
"""
import atexit
import ctypes
import ctypes.util
import json
import os
import re
import sys
import weakref

__all__ = ["Context", "ShardError", "Tensor", "Scaler", "FP32", "BF16", "FP16", "admin",
           "library_path", "device_syncs", "strerror"]

FP32, BF16, FP16 = 0, 1, 2
DTYPE_BYTES = {FP32: 4, BF16: 2, FP16: 2}

# status codes (shard.h)
OK = 0
EPERM = -1  # a write into the gathered weights was caught (they are read-only)
EINVAL, ENOSPC, ETIMEDOUT, ECONNRESET = -22, -28, -110, -104
ESTATE, EMISMATCH, EJOBFAILED, EVERSION = -1001, -1002, -1003, -1004
ENOUNIT, ENOJOB, ENOTHELD, ECONFIG, EPEER = -1005, -1006, -1007, -1008, -1009
EPAUSED = -1011  # a rank died: the job paused; register again (every rank) to resume from ctx.start_step
ENOREPLICA = -1012  # shardctl checkpoint --job: a lost node held the only copy of some state
ENONFINITE = -1010  # step: a gradient was NaN or infinite; the step was skipped, the job goes on
OWN_GRAD = 254  # read_own: the gradient sums handed over at a trainer optimizer's step


class ShardError(RuntimeError):
    """A libshard call failed: .status (negative int), .name ("mismatch between ranks" ...),
    .message (what the daemon or library said)."""

    def __init__(self, status, message, call=None):
        self.status = status
        self.name = strerror(status) if _lib is not None else str(status)
        self.message = message
        self.call = call
        where = f"{call}: " if call else ""
        super().__init__(f"{where}{self.name} ({status}): {message}")


class _Tensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("ndim", ctypes.c_uint32),
                ("dims", ctypes.POINTER(ctypes.c_uint64)), ("dtype", ctypes.c_int),
                ("unit", ctypes.c_uint32), ("group", ctypes.c_uint32)]


class _HParams(ctypes.Structure):
    _fields_ = [("lr", ctypes.c_float), ("beta1", ctypes.c_float), ("beta2", ctypes.c_float),
                ("eps", ctypes.c_float), ("weight_decay", ctypes.c_float),
                ("momentum", ctypes.c_float)]


class _StepArgs(ctypes.Structure):
    _fields_ = [("groups", ctypes.POINTER(_HParams)), ("n_groups", ctypes.c_uint32),
                ("has_grad", ctypes.POINTER(ctypes.c_uint8)), ("n_tensors", ctypes.c_uint32),
                ("bcast", ctypes.c_void_p), ("bcast_bytes", ctypes.c_uint64)]


class Scaler(ctypes.Structure):
    """libshard's dynamic loss scaler (shard_scaler_t) with torch.amp.GradScaler's rule and
    defaults: multiply the loss by .scale before its backward, step with
    Context.step_amp(scaler) (or step(loss_scale=scaler.scale) and update(found_inf)): a step
    skipped for a non-finite gradient (on every rank alike) multiplies the scale by
    backoff_factor, growth_interval steps taken in a row by growth_factor. The scale is a float32
    value, as torch keeps it. (shard.torch users keep torch's own GradScaler.)"""
    _fields_ = [("scale", ctypes.c_double), ("growth_factor", ctypes.c_double),
                ("backoff_factor", ctypes.c_double), ("growth_interval", ctypes.c_uint32),
                ("growth_tracker", ctypes.c_uint32), ("skipped", ctypes.c_uint64)]

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and
                int(growth_interval) > 0):
            raise ValueError(f"shard.Scaler: init_scale {init_scale} > 0, growth_factor "
                             f"{growth_factor} > 1, 0 < backoff_factor {backoff_factor} < 1 and "
                             f"growth_interval {growth_interval} > 0 (torch's GradScaler's)")
        super().__init__(float(_c_float_round(init_scale)), growth_factor, backoff_factor,
                         int(growth_interval), 0, 0)

    def update(self, found_inf):
        """the scale after a step: found_inf true (skipped) backs off, else counts a step"""
        _lib.shard_scaler_update(ctypes.byref(self), 1 if found_inf else 0)


def _c_float_round(x):
    return ctypes.c_float(x).value


class _Optimizer(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("lr", ctypes.c_float), ("beta1", ctypes.c_float),
                ("beta2", ctypes.c_float), ("eps", ctypes.c_float),
                ("weight_decay", ctypes.c_float), ("momentum", ctypes.c_float),
                ("max_grad_norm", ctypes.c_float)]


class _Model(ctypes.Structure):
    _fields_ = [("job", ctypes.c_char_p), ("rank", ctypes.c_uint32), ("world", ctypes.c_uint32),
                ("plan", ctypes.c_char_p), ("tensors", ctypes.POINTER(_Tensor)),
                ("n_tensors", ctypes.c_uint32), ("optimizer", _Optimizer),
                ("init", ctypes.POINTER(ctypes.POINTER(ctypes.c_float))),
                ("max_live_bytes", ctypes.c_uint64), ("groups", ctypes.POINTER(_HParams)),
                ("n_groups", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("bcast_bytes", ctypes.c_uint64), ("load", ctypes.c_char_p),
                ("resume_timeout_ms", ctypes.c_uint64), ("ranks_per_node", ctypes.c_uint32),
                ("job_secret", ctypes.c_void_p), ("job_secret_len", ctypes.c_size_t),
                ("leader", ctypes.c_char_p)]

SKIP_UNUSED = 1  # shard_model_t.flags: tensors no rank gave a gradient in a step are not updated


class _UnitInfo(ctypes.Structure):
    _fields_ = [("numel", ctypes.c_uint64), ("bytes", ctypes.c_uint64), ("dtype", ctypes.c_int),
                ("first_tensor", ctypes.c_uint32), ("n_tensors", ctypes.c_uint32)]


class _TensorInfo(ctypes.Structure):
    _fields_ = [("unit", ctypes.c_uint32), ("offset", ctypes.c_uint64),
                ("numel", ctypes.c_uint64)]


def _candidates():
    env = os.environ.get("SHARD_LIBRARY")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "libshard.so.0")
    try:  # installed by cmake --install: the libshard of the same prefix
        from . import _install
        yield os.path.join(_install.LIBDIR, "libshard.so.0")
    except ImportError:
        pass
    # imported from a source checkout: the build trees next to it; pip-installed from one: that
    # checkout's (the build backend wrote _origin.py)
    trees = [os.path.dirname(os.path.dirname(os.path.dirname(here)))]
    try:
        from . import _origin
        trees.append(_origin.SOURCE_TREE)
    except ImportError:
        pass
    for src in trees:
        for build in ("build", "build/ci", "build/demo", "build/bench"):
            yield os.path.join(src, build, "client", "libshard.so.0")
    found = ctypes.util.find_library("shard")
    if found:
        yield found
    for d in ("/usr/local/lib", "/usr/lib", "/usr/local/lib64", "/usr/lib/x86_64-linux-gnu"):
        yield os.path.join(d, "libshard.so.0")


def _load():
    tried = []
    for path in _candidates():
        if os.path.sep in path and not os.path.exists(path):
            tried.append(path)
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append(f"{path} ({e})")
    raise ImportError("shard: libshard not found. Set SHARD_LIBRARY to the path of "
                      "libshard.so.0 (a build tree's client/libshard.so.0, or PREFIX/lib after "
                      "cmake --install), or install shardd where the loader looks (ldconfig). "
                      "Tried: " + ", ".join(tried))


_lib, library_path = _load()
_c = ctypes
_lib.shard_attach.argtypes = [_c.c_char_p, _c.POINTER(_c.c_void_p)]
_lib.shard_register.argtypes = [_c.c_void_p, _c.POINTER(_Model)]
_lib.shard_memory.argtypes = [_c.c_void_p]
_lib.shard_memory.restype = _c.c_char_p
_lib.shard_device_uuid.argtypes = [_c.c_void_p]
_lib.shard_device_uuid.restype = _c.c_char_p
_lib.shard_device_syncs.argtypes = []
_lib.shard_device_syncs.restype = _c.c_ulonglong
_lib.shard_num_units.argtypes = [_c.c_void_p]
_lib.shard_num_units.restype = _c.c_uint32
_lib.shard_unit_info.argtypes = [_c.c_void_p, _c.c_uint32, _c.POINTER(_UnitInfo)]
_lib.shard_tensor_info.argtypes = [_c.c_void_p, _c.c_uint32, _c.POINTER(_TensorInfo)]
_lib.shard_fetch.argtypes = [_c.c_void_p, _c.c_uint32, _c.POINTER(_c.c_void_p)]
_lib.shard_release.argtypes = [_c.c_void_p, _c.c_uint32]
_lib.shard_fetch_aside.argtypes = [_c.c_void_p, _c.c_uint32, _c.POINTER(_c.c_void_p)]
_lib.shard_release_aside.argtypes = [_c.c_void_p, _c.c_uint32]
# the device's default stream (CUDA's legacy NULL stream, HIP's null stream) where a stream is
# asked for: NULL there means no stream (shard.h, SHARD_STREAM_DEFAULT)
STREAM_DEFAULT = 1
_lib.shard_release_on_stream.argtypes = [_c.c_void_p, _c.c_uint32, _c.c_void_p]
_lib.shard_release_aside_on_stream.argtypes = [_c.c_void_p, _c.c_uint32, _c.c_void_p]
_lib.shard_push_grad.argtypes = [_c.c_void_p, _c.c_uint32, _c.c_void_p, _c.c_size_t]
_lib.shard_grad_buffer.argtypes = [_c.c_void_p, _c.c_uint32, _c.POINTER(_c.c_void_p)]
_lib.shard_push_staged.argtypes = [_c.c_void_p, _c.c_uint32]
_lib.shard_push_staged_on_stream.argtypes = [_c.c_void_p, _c.c_uint32, _c.c_void_p]
_lib.shard_step.argtypes = [_c.c_void_p, _c.POINTER(_c.c_double)]
_lib.shard_last_micro_step.argtypes = [_c.c_void_p, _c.c_int]
_lib.shard_group_hparams.argtypes = [_c.c_void_p, _c.c_uint32, _c.POINTER(_HParams)]
_lib.shard_step_ex.argtypes = [_c.c_void_p, _c.POINTER(_StepArgs), _c.POINTER(_c.c_double)]
_lib.shard_step_scaled.argtypes = [_c.c_void_p, _c.POINTER(_StepArgs), _c.c_double,
                                   _c.POINTER(_c.c_double)]
_lib.shard_scaler_update.argtypes = [_c.POINTER(Scaler), _c.c_int]
_lib.shard_scaler_update.restype = None
_lib.shard_detach.argtypes = [_c.c_void_p]
_lib.shard_save.argtypes = [_c.c_void_p, _c.c_char_p, _c.POINTER(_c.c_uint64)]
_lib.shard_write.argtypes = [_c.c_void_p, _c.c_uint32, _c.c_uint32, _c.c_void_p, _c.c_size_t]
_lib.shard_write_steps.argtypes = [_c.c_void_p, _c.c_uint32, _c.c_uint64]
_lib.shard_write_done.argtypes = [_c.c_void_p]
_lib.shard_read.argtypes = [_c.c_void_p, _c.c_uint32, _c.c_uint32, _c.c_void_p, _c.c_size_t]
_lib.shard_read_steps.argtypes = [_c.c_void_p, _c.c_uint32, _c.POINTER(_c.c_uint64)]
_lib.shard_read_own.argtypes = [_c.c_void_p, _c.c_uint32, _c.c_uint32, _c.c_void_p, _c.c_size_t,
                                _c.POINTER(_c.c_uint64), _c.POINTER(_c.c_uint64)]
_lib.shard_write_own.argtypes = [_c.c_void_p, _c.c_uint32, _c.c_uint32, _c.c_void_p,
                                 _c.c_size_t]
_lib.shard_step_update_done.argtypes = [_c.c_void_p, _c.POINTER(_c.c_double)]
_lib.shard_step_grad_scale.argtypes = [_c.c_void_p]
_lib.shard_step_grad_scale.restype = _c.c_double
_lib.shard_start_step.argtypes = [_c.c_void_p]
_lib.shard_start_step.restype = _c.c_uint64
_lib.shard_resumed.argtypes = [_c.c_void_p]
_lib.shard_resumed.restype = _c.c_int
_lib.shard_crc32c.argtypes = [_c.c_uint32, _c.c_void_p, _c.c_size_t]
_lib.shard_crc32c.restype = _c.c_uint32
_lib.shard_strerror.argtypes = [_c.c_int]
_lib.shard_strerror.restype = _c.c_char_p
_lib.shard_last_error.argtypes = [_c.c_void_p]
_lib.shard_last_error.restype = _c.c_char_p
_lib.shard_admin.argtypes = [_c.c_char_p, _c.c_char_p, _c.c_char_p, _c.POINTER(_c.c_void_p)]
_lib.shard_free.argtypes = [_c.c_void_p]


def strerror(status):
    """The name of a status code."""
    return _lib.shard_strerror(int(status)).decode()


def _b(s):
    return s.encode() if isinstance(s, str) else s



def device_syncs():
    """How many times libshard waited for a device in this process so far (shard_copy and
    push_grad into device memory wait for their copies; a trainer that writes gradients on its
    stream and pushes them with push_staged_on_stream makes none)."""
    return int(_lib.shard_device_syncs())

def admin(command, job=None, socket=None):
    """One admin command (status, jobs, groups, topology, stats, schedule): the daemon's JSON."""
    out = _c.c_void_p()
    st = _lib.shard_admin(_b(socket), _b(command), _b(job), _c.byref(out))
    text = _c.string_at(out.value).decode() if out.value else None
    if out.value:
        _lib.shard_free(out)
    if st != 0:
        raise ShardError(st, _lib.shard_last_error(None).decode(), f"admin {command}")
    return json.loads(text)


class Tensor:
    """A tensor of the model: name, dims, dtype (FP32, BF16, FP16), its unit and its parameter
    group (an index into register's groups)."""

    def __init__(self, name, dims, dtype=FP32, unit=0, group=0):
        self.name, self.dims, self.dtype, self.unit = name, tuple(int(d) for d in dims), dtype, unit
        self.group = group


# the optimizer dict's keys (shard.h's shard_optimizer_t), and a parameter group's
_OPTIMIZER_KEYS = {"name", "lr", "betas", "beta1", "beta2", "eps", "weight_decay", "momentum",
                   "max_grad_norm"}
_GROUP_KEYS = {"lr", "betas", "beta1", "beta2", "eps", "weight_decay", "momentum"}


def _hparams(g, defaults, what):
    """A _HParams from a group dict over defaults; unknown keys are refused naming the key."""
    unknown = sorted(set(g) - _GROUP_KEYS)
    if unknown:
        raise ValueError(f"{what}: unknown hyperparameter '{unknown[0]}' (known: "
                         f"{', '.join(sorted(_GROUP_KEYS))})")
    d = dict(defaults)
    d.update(g)
    betas = d.get("betas", (d.get("beta1", 0.9), d.get("beta2", 0.999)))
    return _HParams(float(d.get("lr", 1e-3)), float(betas[0]), float(betas[1]),
                    float(d.get("eps", 1e-8)), float(d.get("weight_decay", 0.0)),
                    float(d.get("momentum", 0.0)))


class Context:
    """An attached trainer process (one per rank; not thread-safe)."""

    def __init__(self, socket=None):
        self._ctx = _c.c_void_p()
        st = _lib.shard_attach(_b(socket), _c.byref(self._ctx))
        if st != 0:
            raise ShardError(st, _lib.shard_last_error(None).decode(), "attach")
        self.units = []    # per unit: dict(numel, bytes, dtype, tensors)
        self.tensors = []  # per tensor: dict(unit, offset, numel)
        self.names = []    # per tensor: its name, for errors
        self._pid = os.getpid()
        _live.add(self)

    def _check(self, st, call):
        if st != 0:
            msg = _lib.shard_last_error(self._ctx).decode()
            if st == EPERM and self.names:  # a write into the gathered weights: name the tensor
                msg = re.sub(r"\(tensor (\d+),",
                             lambda m: f"(tensor {m.group(1)} '{self.names[int(m.group(1))]}',"
                             if int(m.group(1)) < len(self.names) else m.group(0), msg)
            raise ShardError(st, msg, call)

    def register(self, job, rank, world, plan, tensors, optimizer, init=None, max_live_bytes=0,
                 groups=None, skip_unused=False, bcast_bytes=0, load=None, resume_timeout_ms=0,
                 ranks_per_node=0, job_secret=None, leader=None):
        """Register the model (every rank the same tensors). init (rank 0): one fp32 buffer per
        tensor (objects with the buffer protocol or ctypes addresses), None for zeros.
        groups: None, or one dict of hyperparameters per parameter group (lr, betas, eps,
        weight_decay, momentum; missing keys from optimizer), indexed by Tensor.group.
        skip_unused: tensors that no rank gave a gradient in a step are not updated (step's
        has_grad says which this rank gave). bcast_bytes: what rank 0 broadcasts with each step
        (step's bcast). load: a checkpoint to start from (a directory of them, meaning its
        LATEST, or one), written by save() under any world and plan; start_step is then its
        step. resume_timeout_ms: when a rank dies the job pauses for that long (0: the daemon's
        resume_timeout_ms) and calls raise ShardError with status EPAUSED; registering every
        rank again (same job and model) resumes it: resumed is True and start_step the step it
        paused after. ranks_per_node: the job's ranks per node, the same on every rank (ranks
        with the same r // ranks_per_node share a node, any of the cluster's; 0: the daemon's
        ranks_per_node). job_secret: the job's secret (bytes, 16-4096 of them, the same on every
        rank; None: none): the daemons form the job across nodes of the nodes whose ranks gave
        it and refuse a node that reports the job without it (they see only a token derived
        from it). leader: "host[:port]" of the job's leader, the daemon of rank 0's node, for
        daemons without a cluster list (None: $SHARD_LEADER, else $MASTER_ADDR, else the first
        host of $SLURM_STEP_NODELIST, with $SHARD_LEADER_PORT or 7701)."""
        n = len(tensors)
        keep = []  # keep ctypes objects alive during the call
        arr = (_Tensor * n)()
        for i, t in enumerate(tensors):
            dims = (_c.c_uint64 * max(1, len(t.dims)))(*t.dims)
            name = _b(t.name)
            keep += [dims, name]
            arr[i] = _Tensor(name, len(t.dims), dims, t.dtype, t.unit, getattr(t, "group", 0))
        o = dict(optimizer)
        unknown = sorted(set(o) - _OPTIMIZER_KEYS)
        if unknown:
            raise ValueError(f"register: unknown optimizer key '{unknown[0]}' (known: "
                             f"{', '.join(sorted(_OPTIMIZER_KEYS))})")
        betas = o.get("betas", (o.get("beta1", 0.9), o.get("beta2", 0.999)))
        oname = _b(o.get("name", "adamw"))
        keep.append(oname)
        opt = _Optimizer(oname, float(o.get("lr", 1e-3)), float(betas[0]), float(betas[1]),
                         float(o.get("eps", 1e-8)), float(o.get("weight_decay", 0.0)),
                         float(o.get("momentum", 0.0)), float(o.get("max_grad_norm", 0.0)))
        init_arr = None
        if init is not None:
            init_arr = (_c.POINTER(_c.c_float) * n)()
            for i, buf in enumerate(init):
                if buf is None:
                    continue
                addr = buf if isinstance(buf, int) else _address_of(buf, keep)
                init_arr[i] = _c.cast(addr, _c.POINTER(_c.c_float))
        jobb, planb = _b(job), _b(plan)
        defaults = {k: v for k, v in o.items() if k in _GROUP_KEYS}
        garr, ng = None, 0
        if groups is not None:
            if isinstance(groups, dict) or not len(groups):
                raise ValueError("register: groups must be a non-empty list of dicts")
            ng = len(groups)
            garr = (_HParams * ng)(*[_hparams(g, defaults, f"register: group {i}")
                                     for i, g in enumerate(groups)])
        self.n_groups = max(1, ng)
        secret = None
        if job_secret is not None:
            secret = _c.create_string_buffer(bytes(job_secret), len(job_secret))
            keep.append(secret)
        model = _Model(jobb, rank, world, planb, arr, n, opt, init_arr, int(max_live_bytes),
                       garr, ng, SKIP_UNUSED if skip_unused else 0, int(bcast_bytes),
                       _b(os.fspath(load)) if load else None, int(resume_timeout_ms),
                       int(ranks_per_node), _c.cast(secret, _c.c_void_p) if secret else None,
                       len(job_secret) if secret else 0, _b(leader) if leader else None)
        self._check(_lib.shard_register(self._ctx, _c.byref(model)), "register")
        # "host", or "cuda": the daemon keeps the job's buffers in a GPU's memory and the
        # pointers fetch and push use are device addresses
        self.memory = (_lib.shard_memory(self._ctx) or b"host").decode()
        # the daemon's device holding it ("GPU-..." as nvidia-smi -L prints it; "" for none)
        self.device_uuid = (_lib.shard_device_uuid(self._ctx) or b"").decode()
        self.start_step = int(_lib.shard_start_step(self._ctx))
        self.resumed = bool(_lib.shard_resumed(self._ctx))
        del keep
        self.names = [t.name for t in tensors]
        self.units = []
        for u in range(_lib.shard_num_units(self._ctx)):
            ui = _UnitInfo()
            self._check(_lib.shard_unit_info(self._ctx, u, _c.byref(ui)), "unit_info")
            self.units.append({"numel": ui.numel, "bytes": ui.bytes, "dtype": ui.dtype,
                               "tensors": list(range(ui.first_tensor,
                                                     ui.first_tensor + ui.n_tensors))})
        self.tensors = []
        for t in range(n):
            ti = _TensorInfo()
            self._check(_lib.shard_tensor_info(self._ctx, t, _c.byref(ti)), "tensor_info")
            self.tensors.append({"unit": ti.unit, "offset": ti.offset, "numel": ti.numel})

    def save(self, directory):
        """Save a checkpoint into directory/step-NNNNNNNN and point directory/LATEST at it
        (every rank, between two steps, the same directory); returns the step saved."""
        step = _c.c_uint64()
        self._check(_lib.shard_save(self._ctx, _b(os.fspath(directory)), _c.byref(step)), "save")
        return step.value

    def write(self, tensor, what, addr, count):
        """Write tensor's count fp32 values at host address addr into this rank's shards of
        the running job (every rank, between the same two steps, the same values): what 0 the
        weights (masters and weights), 1.. an optimizer state (AdamW's exp_avg, exp_avg_sq;
        SGD's momentum_buffer). write_done after the last."""
        self._check(_lib.shard_write(self._ctx, tensor, what, _c.c_void_p(addr), count),
                    f"write tensor {tensor}")

    def read(self, unit, what, addr):
        """Read unit's fp32 master weights (what 0) or optimizer state what, gathered from
        the job's nodes, into the unit's elements of fp32 at host address addr (this rank alone,
        between its steps)."""
        self._check(_lib.shard_read(self._ctx, unit, what, _c.c_void_p(addr),
                                    self.units[unit]["numel"]), f"read unit {unit}")

    def read_own(self, unit, what, addr, max_count):
        """A trainer optimizer's own shard of unit (its rank's part of the optimizer state):
        what OWN_GRAD the gradient sums (only at a step's hand-off), 0 the fp32 masters, 1..N
        the states, into fp32 at host address addr (at most max_count elements). Returns
        (the shard's first element in the unit, its elements)."""
        first, count = _c.c_uint64(), _c.c_uint64()
        self._check(_lib.shard_read_own(self._ctx, unit, what, _c.c_void_p(addr), max_count,
                                        _c.byref(first), _c.byref(count)),
                    f"read_own unit {unit}")
        return first.value, count.value

    def write_own(self, unit, what, addr, count):
        """The updated masters (what 0) or state what of this rank's own shard of unit, count
        fp32 at host address addr, at a step's hand-off."""
        self._check(_lib.shard_write_own(self._ctx, unit, what, _c.c_void_p(addr), count),
                    f"write_own unit {unit}")

    def step_grad_scale(self):
        """the factor of the handed-over gradient sums (1 / world, clipped)"""
        return _lib.shard_step_grad_scale(self._ctx)

    def step_update_done(self):
        """the trainer's update is written: returns once the step's weights are there"""
        norm = _c.c_double()
        self._check(_lib.shard_step_update_done(self._ctx, _c.byref(norm)), "step_update_done")
        return norm.value

    def read_steps(self, tensor):
        """tensor's step count"""
        n = _c.c_uint64()
        self._check(_lib.shard_read_steps(self._ctx, tensor, _c.byref(n)),
                    f"read_steps tensor {tensor}")
        return n.value

    def write_steps(self, tensor, steps):
        """Set tensor's step count (AdamW's bias correction) on this rank's node."""
        self._check(_lib.shard_write_steps(self._ctx, tensor, int(steps)),
                    f"write_steps tensor {tensor}")

    def write_done(self):
        """End this rank's writes; returns once every rank of its node ended theirs: the next
        fetches read the written weights."""
        self._check(_lib.shard_write_done(self._ctx), "write_done")

    def fetch(self, unit):
        """Gather a unit: (address, bytes) of its flat buffer, read-only until release."""
        p = _c.c_void_p()
        self._check(_lib.shard_fetch(self._ctx, unit, _c.byref(p)), f"fetch unit {unit}")
        return p.value, self.units[unit]["bytes"]

    def release(self, unit):
        self._check(_lib.shard_release(self._ctx, unit), f"release unit {unit}")

    def fetch_aside(self, unit):
        """fetch outside the step's schedule (reads some ranks only make: a save, an
        evaluation); release_aside releases it"""
        p = _c.c_void_p()
        self._check(_lib.shard_fetch_aside(self._ctx, unit, _c.byref(p)), f"fetch unit {unit}")
        return p.value, self.units[unit]["bytes"]

    def release_aside(self, unit):
        self._check(_lib.shard_release_aside(self._ctx, unit), f"release unit {unit}")

    def release_on_stream(self, unit, stream=None, aside=False):
        """release (release_aside) of a unit that work queued on a device stream (a CUDA
        stream handle as an int) may still read: the stream signals the release on the fence
        page after that work, and shardd keeps the slot until then; returns at once. None:
        release."""
        f = _lib.shard_release_aside_on_stream if aside else _lib.shard_release_on_stream
        self._check(f(self._ctx, unit, stream), f"release unit {unit}")

    def push_grad(self, unit, addr, nbytes):
        """Push this micro-step's gradient of a unit from memory at addr (the unit's layout and
        dtype, nbytes == units[unit]["bytes"]); returns once it is copied."""
        self._check(_lib.shard_push_grad(self._ctx, unit, _c.c_void_p(addr), nbytes),
                    f"push_grad unit {unit}")

    def grad_buffer(self, unit):
        """The zero-copy push: the address of the staging buffer (units[unit]["bytes"] of shared
        memory, not zeroed) to write the unit's next gradient into; push_staged hands it over."""
        p = _c.c_void_p()
        self._check(_lib.shard_grad_buffer(self._ctx, unit, _c.byref(p)), f"grad_buffer unit {unit}")
        return p.value

    def push_staged(self, unit):
        """Push the gradient written into grad_buffer(unit)."""
        self._check(_lib.shard_push_staged(self._ctx, unit), f"push_staged unit {unit}")

    def push_staged_on_stream(self, unit, stream=None):
        """push_staged for a gradient a device stream is still writing: the stream (a CUDA
        stream handle as an int, e.g. torch.cuda.current_stream().cuda_stream) signals it on
        the fence page after that work, and the call returns at once. None: push_staged."""
        self._check(_lib.shard_push_staged_on_stream(self._ctx, unit, stream),
                    f"push_staged_on_stream unit {unit}")

    def last_micro_step(self, last=True):
        """The pushes until the next step are this rank's last of the step (shard_last_micro_step):
        where the plan syncs across nodes at the boundary, each unit's gradient crosses as soon as
        the node pushed it, overlapping the rest of the backward; a later push of a unit in the
        same step fails the job. False takes it back; each step resets it."""
        self._check(_lib.shard_last_micro_step(self._ctx, 1 if last else 0), "last_micro_step")

    def step(self, groups=None, has_grad=None, bcast=None, loss_scale=None):
        """Optimizer step at the accumulation boundary (all ranks); the gradient norm.
        groups: every parameter group's hyperparameters from this step on (a list of dicts as
        register's, missing keys as in the last step; None: those of the last step). has_grad
        (with skip_unused): one truth value per tensor, whether this rank gave it a gradient
        since the last step (None: all). bcast: a writable ctypes buffer of the registered
        bcast_bytes, given by every rank or none: rank 0's contents are sent, and every other
        rank's are overwritten with them (also when the step raises ENONFINITE). loss_scale:
        the factor this step's gradients were multiplied by (shard_step_scaled; every rank
        gives the same), divided out before the norm, the clipping and the optimizer; a
        non-finite gradient raises ENONFINITE, the step skipped on every rank."""
        norm = _c.c_double()
        if groups is None and has_grad is None and bcast is None and loss_scale is None:
            self._check(_lib.shard_step(self._ctx, _c.byref(norm)), "step")
            return norm.value
        args = _StepArgs()
        if groups is not None:
            last = [self.group_hparams(i) if i < self.n_groups else {}
                    for i in range(len(groups))]
            args.groups = (_HParams * len(groups))(*[_hparams(g, d, f"step: group {i}")
                                                     for i, (g, d) in enumerate(zip(groups, last))])
            args.n_groups = len(groups)
        if has_grad is not None:
            args.has_grad = (_c.c_uint8 * len(has_grad))(*[1 if h else 0 for h in has_grad])
            args.n_tensors = len(has_grad)
        if bcast is not None:
            args.bcast = _c.addressof(bcast)
            args.bcast_bytes = _c.sizeof(bcast)
        if loss_scale is None:
            self._check(_lib.shard_step_ex(self._ctx, _c.byref(args), _c.byref(norm)), "step")
        else:
            self._check(_lib.shard_step_scaled(self._ctx, _c.byref(args), float(loss_scale),
                                               _c.byref(norm)), "step")
        return norm.value

    def step_amp(self, scaler, **kwargs):
        """step(loss_scale=scaler.scale, ...), then scaler.update with its outcome: the norm, or
        None for a step skipped for a non-finite gradient (the scale lowered; go on). Any other
        error raises, the scaler unchanged."""
        try:
            norm = self.step(loss_scale=scaler.scale, **kwargs)
        except ShardError as e:
            if e.status != ENONFINITE:
                raise
            scaler.update(True)
            return None
        scaler.update(False)
        return norm

    def group_hparams(self, group):
        """A parameter group's hyperparameters as of the last step: a dict."""
        h = _HParams()
        self._check(_lib.shard_group_hparams(self._ctx, group, _c.byref(h)), "group_hparams")
        return {"lr": h.lr, "betas": (h.beta1, h.beta2), "eps": h.eps,
                "weight_decay": h.weight_decay, "momentum": h.momentum}

    def detach(self):
        if self._ctx:
            _lib.shard_detach(self._ctx)
            self._ctx = _c.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()

    def __del__(self):
        try:
            self.detach()
        except Exception:
            pass


# A process that ends normally has finished its part of the job: the contexts it left attached
# detach at exit (the daemon reports the job finished once every rank did), unless an exception
# nobody caught ended it, or sys.exit with a failing status (the connection then drops: the job
# fails, or pauses with resume_timeout_ms). A forked child that exits does not detach its
# parent's contexts.
_live = weakref.WeakSet()
_failed_exit = []


def _note_uncaught(hook):
    def excepthook(kind, value, tb):
        _failed_exit.append(kind)
        hook(kind, value, tb)
    return excepthook


def _note_exit(exit_fn):
    def exit(status=None):
        if status is not None and status != 0:  # sys.exit("message") fails too, as Python's
            _failed_exit.append(status)
        return exit_fn(status)
    exit.__doc__ = exit_fn.__doc__
    return exit


sys.excepthook = _note_uncaught(sys.excepthook)
sys.exit = _note_exit(sys.exit)


@atexit.register
def _detach_at_exit():
    # an uncaught exception also leaves sys.last_value (set before any excepthook runs, so also
    # where a script replaced ours), except in an interactive session, where errors are survived
    uncaught = getattr(sys, "last_value", None) is not None and not hasattr(sys, "ps1")
    if _failed_exit or uncaught:
        return
    for ctx in list(_live):
        if ctx._pid == os.getpid():
            ctx.detach()


def _address_of(buf, keep):
    """Address of a writable or read-only buffer-protocol object (numpy, array, bytearray)."""
    if hasattr(buf, "data_ptr"):  # a torch tensor
        keep.append(buf)
        return buf.data_ptr()
    mv = memoryview(buf)
    if mv.readonly:
        copy = bytearray(mv)
        keep.append(copy)
        mv = memoryview(copy)
    c = (_c.c_char * mv.nbytes).from_buffer(mv)
    keep += [mv, c]
    return _c.addressof(c)
