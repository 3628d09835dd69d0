"""PyTorch integration: a model trains through shardd unchanged apart from one wrap() call.

    model = shard.torch.wrap(model, socket=..., job="gpt", rank=r, world=w, plan="mics:2",
                             optimizer={"name": "adamw", "lr": 1e-3, "betas": (0.9, 0.999),
                                        "weight_decay": 0.01})
    for micro in range(accum):
        loss = loss_fn(model(x[micro]), y[micro]) / accum
        loss.backward()
    norm = shard.torch.step()          # instead of optimizer.step(); the gradient norm

Each chosen submodule is a unit (by default every direct child that has parameters, plus one
unit for parameters of the model itself). A forward pre-hook fetches the unit: its parameters
become zero-copy views of the gathered slot in shardd's shared memory. A forward post-hook
releases it and marks the outputs so that the backward pass fetches it again before the
module's backward runs; when every parameter of the unit has its gradient, a gradient hook
packs them in the unit's layout and pushes them. step() pushes what is left (parameters that got
no gradient count as zero), runs the sharded optimizer and returns the gradient norm. Gradients
are averaged over the world as DistributedDataParallel does.

Memory: autograd keeps views of the weights it saved in the forward pass; they stay valid
because the gather pool keeps a unit's slot for the whole step when it holds every unit, which
is the default (max_live_bytes=0). A smaller pool is accepted for inference and for models whose
saved tensors do not alias their weights.

CUDA tensors use the same path: the fetched host view is copied to the parameter's device and
gradients are copied back before the push (the daemon's CUDA backend replaces both copies).
"""
import ctypes

import torch

import shard as _shard

__all__ = ["wrap", "step", "full_state_dict", "slot_of", "unwrap"]

_DTYPES = {torch.float32: _shard.FP32, torch.bfloat16: _shard.BF16, torch.float16: _shard.FP16}
_TORCH = {v: k for k, v in _DTYPES.items()}
_current = None


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs whose backward fetches the unit before its own backward."""

    @staticmethod
    def forward(ctx, state, unit, *outputs):
        ctx.state, ctx.unit = state, unit
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.state._backward_fetch(ctx.unit)
        return (None, None) + grads


class _State:
    def __init__(self, model, ctx, units, params, job):
        self.model, self.ctx, self.job = model, ctx, job
        self.units = units            # per unit: the module
        self.params = params          # per unit: [(name, param)]
        self.shapes = [[p.shape for _, p in ps] for ps in params]
        self.views = [None] * len(units)   # per unit: (address, bytes) while fetched
        self.bwd_held = [False] * len(units)
        self.grads = [dict() for _ in units]
        self.handles = []
        self.placeholder = {}
        self.fetches = self.pushes = 0
        self.bytes_fetched = self.bytes_pushed = 0

    # ---- fetch: parameters become views of the slot
    def _attach_views(self, u, addr, nbytes):
        info = self.ctx.units[u]
        dtype = _TORCH[info["dtype"]]
        buf = (ctypes.c_char * nbytes).from_address(addr)
        flat = torch.frombuffer(buf, dtype=dtype, count=info["numel"])
        for (name, p), shape, t in zip(self.params[u], self.shapes[u], info["tensors"]):
            ti = self.ctx.tensors[t]
            view = flat[ti["offset"]:ti["offset"] + ti["numel"]].view(shape)
            p.data = view if p.device.type == "cpu" else view.to(p.device)
        self.views[u] = (addr, nbytes)

    def _fetch(self, u):
        addr, nbytes = self.ctx.fetch(u)
        self.fetches += 1
        self.bytes_fetched += nbytes
        self._attach_views(u, addr, nbytes)

    def _pre_forward(self, u):
        self._fetch(u)

    def _post_forward(self, u, outputs):
        self.ctx.release(u)
        if not torch.is_grad_enabled():
            return outputs
        if isinstance(outputs, torch.Tensor):
            if outputs.requires_grad:
                return _PreBackward.apply(self, u, outputs)[0]
            return outputs
        if isinstance(outputs, (tuple, list)):
            idx = [i for i, o in enumerate(outputs)
                   if isinstance(o, torch.Tensor) and o.requires_grad]
            if not idx:
                return outputs
            wrapped = _PreBackward.apply(self, u, *[outputs[i] for i in idx])
            out = list(outputs)
            for i, w in zip(idx, wrapped):
                out[i] = w
            return type(outputs)(out) if isinstance(outputs, tuple) else out
        return outputs

    def _backward_fetch(self, u):
        if not self.bwd_held[u]:
            self._fetch(u)
            self.bwd_held[u] = True

    # ---- gradients: packed in the unit's layout and pushed once complete
    def _grad_ready(self, u, i, grad):
        self.grads[u][i] = grad
        if len(self.grads[u]) == len(self.params[u]):
            self._push(u)

    def _push(self, u):
        # written straight into shardd's staging buffer (no temporary, no second copy); the
        # buffer holds what an earlier push left, so the padding and missing gradients are zeroed
        info = self.ctx.units[u]
        addr = self.ctx.grad_buffer(u)
        buf = (ctypes.c_char * info["bytes"]).from_address(addr)
        flat = torch.frombuffer(buf, dtype=_TORCH[info["dtype"]], count=info["numel"])
        done = 0  # elements written, in offset order
        order = sorted(enumerate(info["tensors"]), key=lambda it: self.ctx.tensors[it[1]]["offset"])
        for i, t in order:
            ti = self.ctx.tensors[t]
            lo, hi = ti["offset"], ti["offset"] + ti["numel"]
            flat[done:lo].zero_()
            g = self.grads[u].get(i)
            if g is None:
                flat[lo:hi].zero_()
            else:
                flat[lo:hi].copy_(g.detach().reshape(-1))
            done = hi
        flat[done:].zero_()
        self.ctx.push_staged(u)
        self.pushes += 1
        self.bytes_pushed += info["bytes"]
        self.grads[u].clear()
        if self.bwd_held[u]:
            self.ctx.release(u)
            self.bwd_held[u] = False

    def step(self):
        for u in range(len(self.units)):
            if self.grads[u] or self.bwd_held[u]:
                self._push(u)  # missing gradients count as zero
        try:
            norm = self.ctx.step()
        finally:  # also when the step failed (a skipped step, ENONFINITE): the next one goes on
            for u, plist in enumerate(self.params):
                for _, p in plist:
                    p.grad = None
                    p.data = self.placeholder[p.dtype]
                self.views[u] = None
        return norm


def _default_units(model):
    units = [m for m in model.children() if any(True for _ in m.parameters())]
    return units


def wrap(model, socket=None, job="torch", rank=0, world=1, plan="zero3", optimizer=None,
         units=None, max_live_bytes=0):
    """Register model's parameters with shardd and install the hooks; returns model.

    units: submodules (or their names) that become units, in forward order; by default every
    direct child with parameters. Parameters outside them form one more unit fetched around the
    whole model's forward. optimizer: {"name": "adamw"|"sgd", "lr", "betas", "eps",
    "weight_decay", "momentum", "max_grad_norm"}. plan: "topo:W/G/OS" (shard factors of the
    weights, gradients and optimizer states) or a preset: "ddp", "zero1", "zero2", "zero3",
    "mics:P", "topo", "topo-fp", "zeropp" (with ",no-hier", ",no-2hop", ",sec=S" and the quantized
    ",qw", ",qg", ",qsec", ",ef", ",qblock=B"; README, Plans). Every rank must build the same
    model; rank 0's values are the initial ones."""
    global _current
    if optimizer is None:
        optimizer = {"name": "adamw", "lr": 1e-3}
    if units is None:
        units = _default_units(model)
    units = [model.get_submodule(m) if isinstance(m, str) else m for m in units]
    names = {id(p): n for n, p in model.named_parameters()}
    owner = {}
    plist = []
    for u, m in enumerate(units):
        ps = []
        for _, p in m.named_parameters():
            if id(p) in owner:
                if owner[id(p)] != u:
                    raise ValueError(f"shard.torch.wrap: parameter '{names[id(p)]}' belongs to "
                                     f"units {owner[id(p)]} and {u}; shared parameters must be "
                                     "in one unit")
                continue
            owner[id(p)] = u
            ps.append((names[id(p)], p))
        plist.append(ps)
    rest = [(n, p) for n, p in model.named_parameters() if id(p) not in owner]
    if rest:
        units.append(model)
        plist.append(rest)
    tensors, init = [], []
    for u, ps in enumerate(plist):
        if not ps:
            raise ValueError(f"shard.torch.wrap: unit {u} ({type(units[u]).__name__}) has no "
                             "parameters")
        dts = {p.dtype for _, p in ps}
        if len(dts) != 1 or next(iter(dts)) not in _DTYPES:
            raise ValueError(f"shard.torch.wrap: unit {u} mixes or uses unsupported dtypes "
                             f"{sorted(str(d) for d in dts)}; one of float32, bfloat16, float16 "
                             "per unit")
        for name, p in ps:
            tensors.append(_shard.Tensor(name, tuple(p.shape) or (1,), _DTYPES[p.dtype], u))
            init.append(p.detach().to("cpu", torch.float32).contiguous().reshape(-1))
    ctx = _shard.Context(socket)
    try:
        ctx.register(job=job, rank=rank, world=world, plan=plan, tensors=tensors,
                     optimizer=optimizer, init=init if rank == 0 else None,
                     max_live_bytes=max_live_bytes)
    except Exception:
        ctx.detach()
        raise
    state = _State(model, ctx, units, plist, job)
    for dt in {p.dtype for ps in plist for _, p in ps}:
        state.placeholder[dt] = torch.empty(0, dtype=dt)
    for u, m in enumerate(units):
        state.handles.append(m.register_forward_pre_hook(
            lambda mod, inp, u=u: state._pre_forward(u)))
        state.handles.append(m.register_forward_hook(
            lambda mod, inp, out, u=u: state._post_forward(u, out)))
        for i, (_, p) in enumerate(plist[u]):
            state.handles.append(p.register_hook(
                lambda g, u=u, i=i: state._grad_ready(u, i, g)))
            p.data = state.placeholder[p.dtype]  # the values live in shardd now
    model._shard_state = state
    _current = state
    return model


def _state_of(model):
    st = getattr(model, "_shard_state", None) if model is not None else _current
    if st is None:
        raise RuntimeError("shard.torch: no wrapped model (call shard.torch.wrap first)")
    return st


def step(model=None):
    """Push the gradients not pushed yet, run the optimizer step in shardd, return the global
    gradient norm (before clipping). Replaces optimizer.step() and optimizer.zero_grad().

    A NaN or infinite gradient raises shard.ShardError with .status == shard.ENONFINITE and a
    message naming the unit: the step was skipped (gradients dropped, weights and optimizer
    state unchanged) on every rank, and training can go on with the next step."""
    return _state_of(model).step()


def full_state_dict(model=None):
    """The full current parameters (and the model's buffers) as ordinary tensors."""
    st = _state_of(model)
    out = {}
    for u, ps in enumerate(st.params):
        st._fetch(u)
        try:
            for name, p in ps:
                out[name] = p.detach().clone()
        finally:
            st.ctx.release(u)
            for _, p in ps:
                p.data = st.placeholder[p.dtype]
    for name, b in st.model.named_buffers():
        out[name] = b.detach().clone()
    return out


def slot_of(model, unit):
    """(address, bytes) of the shared slot a unit's parameters view while fetched, else None."""
    return _state_of(model).views[unit]


def unwrap(model=None):
    """Remove the hooks and detach from shardd (the parameters stay empty)."""
    global _current
    st = _state_of(model)
    for h in st.handles:
        h.remove()
    st.ctx.detach()
    if _current is st:
        _current = None
    del st.model._shard_state
