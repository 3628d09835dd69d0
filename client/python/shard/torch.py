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
import os
import warnings

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


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def _default_units(model):
    """Every direct child with parameters; a container (ModuleList, ModuleDict, Sequential) is
    descended into, so that each of its members is a unit: a ModuleList is never called itself,
    and its members' hooks are the ones that fire."""
    units = []
    for m in model.children():
        if not any(True for _ in m.parameters()):
            continue
        if isinstance(m, _CONTAINERS):
            units += _default_units(m)
        else:
            units.append(m)
    return units


# torch's defaults, per optimizer (torch.optim.AdamW, torch.optim.SGD)
_DEFAULTS = {"adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2},
             "sgd": {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0}}
_KEYS = {"adamw": {"name", "lr", "betas", "eps", "weight_decay", "max_grad_norm"},
         "sgd": {"name", "lr", "momentum", "weight_decay", "max_grad_norm"}}
# a torch optimizer's options that shardd's optimizer has, and those it accepts only at torch's
# default value (any other value is refused, naming the option)
_TORCH_SAME = {"adamw": {"amsgrad": False, "maximize": False, "capturable": False,
                         "differentiable": False, "fused": None, "foreach": None},
               "sgd": {"dampening": 0, "nesterov": False, "maximize": False,
                       "differentiable": False, "foreach": None}}


def _optimizer_of(optimizer, params):
    """The optimizer dict shardd registers, from a dict or a torch optimizer, with torch's
    defaults; unknown or unsupported keys are refused naming the key."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return _from_torch(optimizer, params)
    if not isinstance(optimizer, dict):
        raise TypeError(f"shard.torch.wrap: optimizer must be a dict or a torch.optim.AdamW/SGD, "
                        f"not {type(optimizer).__name__}")
    name = str(optimizer.get("name", "adamw")).lower()
    if name not in _DEFAULTS:
        raise ValueError(f"shard.torch.wrap: optimizer '{name}' is not supported (adamw, sgd)")
    for k in optimizer:
        if k not in _KEYS[name]:
            raise ValueError(f"shard.torch.wrap: optimizer key '{k}' is not known for {name} "
                             f"(known: {', '.join(sorted(_KEYS[name]))})")
    out = dict(_DEFAULTS[name], name=name)
    out.update(optimizer)
    out["name"] = name
    return out


def _from_torch(opt, params):
    kinds = {torch.optim.AdamW: "adamw", torch.optim.SGD: "sgd"}
    name = kinds.get(type(opt))
    if name is None:
        raise ValueError(f"shard.torch.wrap: torch optimizer {type(opt).__name__} is not "
                         "supported (torch.optim.AdamW, torch.optim.SGD)")
    groups = opt.param_groups
    keys = ["lr", "weight_decay"] + (["betas", "eps"] if name == "adamw" else ["momentum"])
    first = groups[0]
    for g in groups[1:]:
        for k in keys:
            if g[k] != first[k]:
                raise ValueError(f"shard.torch.wrap: the optimizer's param groups differ in "
                                 f"'{k}' ({first[k]} and {g[k]}); one set of hyperparameters "
                                 "for the whole model is supported")
    for k, want in _TORCH_SAME[name].items():
        for g in groups:
            if k in g and g[k] != want and not (want is None and g[k] is False):
                raise ValueError(f"shard.torch.wrap: {type(opt).__name__} option '{k}'={g[k]} "
                                 "is not supported by shardd's optimizer")
    mine = {id(p) for g in groups for p in g["params"]}
    missing = [n for n, p in params if p.requires_grad and id(p) not in mine]
    if missing:
        raise ValueError(f"shard.torch.wrap: parameter '{missing[0]}' is not in the torch "
                         "optimizer's param groups; shardd updates every parameter it holds")
    out = {"name": name}
    for k in keys:
        out[k] = tuple(first[k]) if k == "betas" else first[k]
    if len(opt.state):
        raise ValueError("shard.torch.wrap: the torch optimizer has taken steps already; its "
                         "state cannot be moved into shardd (wrap before the first step)")
    return out


def _launcher(job, rank, world):
    """rank, world and the job name from torchrun's variables where not given."""
    env = os.environ
    if rank is None:
        rank = int(env.get("RANK", 0))
    if world is None:
        world = int(env.get("WORLD_SIZE", 1))
    if job is None:
        run = env.get("TORCHELASTIC_RUN_ID")
        job = f"torch-{run}" if run else "torch"
    if not 0 <= rank < world:
        raise ValueError(f"shard.torch.wrap: rank {rank} is outside world {world} (RANK "
                         f"{env.get('RANK')}, WORLD_SIZE {env.get('WORLD_SIZE')})")
    return job, rank, world


_clip_patched = False


def _patch_clip():
    """torch.nn.utils.clip_grad_norm_ on a wrapped model's parameters sees empty gradients
    (they are in shardd once pushed): it warns once, pointing to the optimizer's max_grad_norm."""
    global _clip_patched
    if _clip_patched:
        return
    orig = torch.nn.utils.clip_grad_norm_
    warned = [False]

    def clip_grad_norm_(parameters, *args, **kwargs):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)
        if not warned[0] and any(getattr(p, "_shard_wrapped", False) for p in parameters):
            warned[0] = True
            warnings.warn("shard.torch: clip_grad_norm_ on a wrapped model does nothing (the "
                          "gradients are in shardd); clip with the optimizer's 'max_grad_norm' "
                          "instead", stacklevel=2)
        return orig(parameters, *args, **kwargs)

    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    _clip_patched = True


def wrap(model, socket=None, job=None, rank=None, world=None, plan="zero3", optimizer=None,
         units=None, max_live_bytes=0):
    """Register model's parameters with shardd and install the hooks; returns model.

    rank, world and job default from torchrun's RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID
    ("torch-<id>"; else rank 0 of 1, job "torch"); socket from $SHARD_SOCKET.
    units: submodules (or their names) that become units, in forward order; by default every
    direct child with parameters, descending into ModuleList, ModuleDict and Sequential.
    Parameters outside them form one more unit fetched around the whole model's forward.
    optimizer: {"name": "adamw"|"sgd", "lr", "betas", "eps", "weight_decay", "momentum",
    "max_grad_norm"} with torch's defaults (AdamW: lr 1e-3, betas (0.9, 0.999), eps 1e-8,
    weight_decay 0.01; SGD: lr 1e-3, momentum 0, weight_decay 0), unknown keys refused; or a
    torch.optim.AdamW / SGD built on the model's parameters (one set of hyperparameters for
    every group), translated. plan: "topo:W/G/OS" (shard factors of the
    weights, gradients and optimizer states) or a preset: "ddp", "zero1", "zero2", "zero3",
    "mics:P", "topo", "topo-fp", "zeropp" (with ",no-hier", ",no-2hop", ",sec=S" and the quantized
    ",qw", ",qg", ",qsec", ",ef", ",qblock=B"; README, Plans). Every rank must build the same
    model; rank 0's values are the initial ones."""
    global _current
    job, rank, world = _launcher(job, rank, world)
    optimizer = _optimizer_of({"name": "adamw"} if optimizer is None else optimizer,
                              list(model.named_parameters()))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        raise ValueError(f"shard.torch.wrap: parameter '{frozen[0]}' does not require a gradient; "
                         "frozen parameters are not supported yet (keep them outside the wrapped "
                         "model, or unfreeze them)")
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
    saved = []  # (param, its data): put back if wrap fails half-way
    try:
        for u, m in enumerate(units):
            state.handles.append(m.register_forward_pre_hook(
                lambda mod, inp, u=u: state._pre_forward(u)))
            state.handles.append(m.register_forward_hook(
                lambda mod, inp, out, u=u: state._post_forward(u, out)))
            for i, (_, p) in enumerate(plist[u]):
                state.handles.append(p.register_hook(
                    lambda g, u=u, i=i: state._grad_ready(u, i, g)))
                saved.append((p, p.data))
                p.data = state.placeholder[p.dtype]  # the values live in shardd now
                p._shard_wrapped = True
    except BaseException:  # no hooks left behind, the values back, the job left
        for h in state.handles:
            h.remove()
        for p, d in saved:
            p.data = d
            p.__dict__.pop("_shard_wrapped", None)
        ctx.detach()
        raise
    model._shard_state = state
    model.state_dict = lambda *a, **k: _full_state_dict_of(model, *a, **k)
    _patch_clip()
    _current = state
    return model


def _full_state_dict_of(model, destination=None, prefix="", keep_vars=False):
    """model.state_dict() of a wrapped model: the full tensors, as FSDP's full state dict."""
    out = full_state_dict(model)
    if destination is None:
        import collections
        destination = collections.OrderedDict()
    for k, v in out.items():
        destination[prefix + k] = v
    return destination


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
    for ps in st.params:
        for _, p in ps:
            p.__dict__.pop("_shard_wrapped", None)
    st.model.__dict__.pop("state_dict", None)
    del st.model._shard_state
