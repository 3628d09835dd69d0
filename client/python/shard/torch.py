"""PyTorch integration: a model trains through shardd unchanged apart from one wrap() call.

    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=3e-4)
    model = shard.torch.wrap(model, plan="mics:2", optimizer=opt, max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    for micro in range(accum):
        (loss_fn(model(x[micro]), y[micro]) / accum).backward()
    norm = opt.step()                  # in shardd, with each group's current lr; the grad norm
    sched.step()

Each chosen submodule is a unit (by default every direct child that has parameters, descending
into containers, plus one unit for parameters of the model itself). A forward pre-hook fetches
the unit (and the units of tied parameters it shares): its parameters become zero-copy views of
the gathered slot in shardd's shared memory. A forward post-hook releases it and marks the
outputs so that the backward pass fetches it again before the module's backward runs. A hook on
each parameter's gradient accumulator takes the gradient out of .grad once accumulated; when
every parameter of the unit that requires a gradient has one, they are packed in the unit's
layout and pushed, and the unit's gradients are dropped. Units with only some gradients are
pushed at the end of backward. The step sends each param group's current hyperparameters and
the tensors this rank gave a gradient: tensors no rank gave one are not updated (torch's
set_to_none semantics), nor frozen ones. Gradients are averaged over the world as
DistributedDataParallel does.

Memory: autograd keeps views of the weights it saved in the forward pass; they stay valid
because the gather pool keeps a unit's slot for the whole step when it holds every unit, which
is the default (max_live_bytes=0). A smaller pool is accepted for inference and for models whose
saved tensors do not alias their weights.

Devices: a CPU model trains through daemons that keep shards in host memory; a .cuda() model
through daemons on a GPU (shardd --backend cuda), on the daemon's GPU itself (compared by UUID,
whatever CUDA_VISIBLE_DEVICES numbers it). There the parameters are zero-copy CUDA tensors over
the gathered slot libshard imported (__cuda_array_interface__), the gradients are copied into
the device staging slot on torch's current stream, which then signals them on the fence page
(push_staged_on_stream), and the fetch's answer means the gather is complete: no host
synchronization per unit (at most one per step, for module buffers). Any other pairing (a CUDA
model and host memory, a CPU model and a GPU's, another GPU, parameters on several devices) is
refused at wrap naming both sides, and the model is left where it is.
"""
import collections.abc
import contextlib
import ctypes
import functools
import json
import os
import sys
import threading
import types
import warnings

import torch

import shard as _shard
from shard import checkpoint as _checkpoint

__all__ = ["wrap", "step", "optimizer", "ShardOptimizer", "full_state_dict", "slot_of", "unwrap"]

_DTYPES = {torch.float32: _shard.FP32, torch.bfloat16: _shard.BF16, torch.float16: _shard.FP16}
_TORCH = {v: k for k, v in _DTYPES.items()}
_current = None
_reading = threading.local()  # full_state_dict is reading the model's names (active)


class _HostMemory:
    """A job in host memory: parameters are views of the mapped pool, gradients are written into
    the mapped staging slot by the CPU."""
    device = torch.device("cpu")

    def view(self, addr, nbytes, dtype, count, writable=False):
        buf = (ctypes.c_char * nbytes).from_address(addr)
        return torch.frombuffer(buf, dtype=dtype, count=count)

    def push(self, ctx, unit):
        ctx.push_staged(unit)

    def release(self, ctx, unit, aside):
        (ctx.release_aside if aside else ctx.release)(unit)


class _DevicePointer:
    """Bytes of the job's device memory as __cuda_array_interface__ (version 2: no stream to
    wait on; libshard's mapping owns the memory): torch.as_tensor makes a tensor over them
    without copying, which keeps this object alive. The interface's read-only flag stays False
    whatever `writable` says: torch has no read-only tensors and refuses it ("the read only flag
    is not supported", torch 2.11 on an H200). The weights stay read-only where it counts: the
    gather pool is imported with a PROT_READ mapping, so the driver refuses a write into it."""

    def __init__(self, addr, nbytes, writable):
        self.writable = bool(writable)
        self.__cuda_array_interface__ = {"shape": (int(nbytes),), "typestr": "|u1",
                                         "data": (int(addr), False), "version": 2}


class _CudaMemory:
    """A job in a GPU's memory with the model on that GPU: parameters are zero-copy CUDA tensors
    over the imported slot; a gradient is copied into the device staging slot on torch's current
    stream, which then signals it on the fence page (push_staged_on_stream), and a release is
    signalled by the stream after the kernels that read the slot (release_on_stream: the daemon
    gathers another unit into a released place only once they ran): no host synchronization."""

    def __init__(self, device):
        self.device = device

    def view(self, addr, nbytes, dtype, count, writable=False):
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.as_tensor(_DevicePointer(addr, count * size, writable), device=self.device)
        return raw.view(dtype)

    def stream(self):
        # torch's default stream is CUDA's legacy NULL stream, whose handle is 0: to libshard
        # NULL means "no stream" (signalled at the call, before the kernels ran), so it is
        # named by CU_STREAM_LEGACY (SHARD_STREAM_DEFAULT)
        return torch.cuda.current_stream(self.device).cuda_stream or _shard.STREAM_DEFAULT

    def push(self, ctx, unit):
        ctx.push_staged_on_stream(unit, self.stream())

    def release(self, ctx, unit, aside):
        ctx.release_on_stream(unit, self.stream(), aside=aside)


def _memory_for(dev):
    """How a model on dev reaches its job's buffers"""
    if dev.type == "cuda":
        return _CudaMemory(dev)
    return _HostMemory()


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


class _Buffers:
    """The module buffers rank 0 broadcasts with each step: packed byte for byte (any dtype:
    BatchNorm's num_batches_tracked is int64), each at an 8-byte aligned offset of one area."""

    def __init__(self, model):
        self.bufs, seen, off = [], set(), 0
        for _, b in model.named_buffers():
            if b is None or id(b) in seen:
                continue
            seen.add(id(b))
            n = b.numel() * b.element_size()
            self.bufs.append((b, off, n))
            off += (n + 7) // 8 * 8
        self.nbytes = off
        self.area = (ctypes.c_uint8 * max(1, off))()
        self.flat = torch.frombuffer(self.area, dtype=torch.uint8) if off else None

    def pack(self):
        for b, off, n in self.bufs:
            if n:
                self.flat[off:off + n].copy_(
                    b.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))

    def unpack(self):
        with torch.no_grad():
            for b, off, n in self.bufs:
                if n:
                    b.copy_(self.flat[off:off + n].view(b.dtype).view(b.shape))


def _in_checkpoint():
    """called (through the module's forward) from torch.utils.checkpoint"""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.endswith(os.path.join("torch", "utils", "checkpoint.py")):
            return True
        f = f.f_back
    return False


class _State:
    def __init__(self, model, ctx, units, params, needs, job, mem):
        self.model, self.ctx, self.job = model, ctx, job
        self.mem = mem                # _HostMemory or _CudaMemory: where the views are
        self.units = units            # per unit: the module
        self.params = params          # per unit: [(name, param)]
        self.needs = needs            # per hooked module (units first): the units it reads
        self.shapes = [[p.shape for _, p in ps] for ps in params]
        self.views = [None] * len(units)   # per unit: (address, bytes) while fetched
        self.refs = [0] * len(units)       # holds of the fetched unit (forwards, one backward)
        self.aside = [False] * len(units)  # the hold is outside the schedule (no autograd)
        self.bwd_held = [False] * len(units)
        self.grads = [dict() for _ in units]
        self.has_grad = [False] * sum(len(ps) for ps in params)  # per tensor, since the step
        self.hooked = set()                # id of every parameter with a gradient hook
        self.acc_nodes = []                # the AccumulateGrad nodes hooked (kept alive)
        self.final_queued = False
        self.sync_off = False              # set_requires_gradient_sync(False) since the step
        self.handles = []
        self.placeholder = {}
        self.opt = None                    # the optimizer object (its param_groups drive steps)
        self.trainer = None                # a trainer optimizer's part of the step (_TrainerStep)
        self.trainer_steps = None          # tensor: its step count in shardd before the step
        self.grad_scaler = None            # the torch.amp.GradScaler the last step came from
        self.skipped_steps = 0             # steps a GradScaler's found_inf skipped
        self.saved_scaler = None           # the GradScaler's state_dict the checkpoint holds
        self.group_of = {}                 # id(param): its param group
        self.bufs, self.rank = None, 0     # the buffers rank 0 broadcasts (_Buffers), this rank
        self.fetches = self.pushes = 0
        self.bytes_fetched = self.bytes_pushed = 0

    def __reduce_ex__(self, protocol):
        raise _refusal("torch.save(model) (or pickling, copy.deepcopy) of a wrapped model",
                       "its parameters live in shardd and the module holds empty placeholders; "
                       "save the full tensors with torch.save(model.state_dict(), f) (any rank "
                       "alone), or a checkpoint of the job with shard.torch.save(directory) "
                       "(every rank), which wrap(load=directory) resumes")

    def _tensor(self, u, i):
        return self.ctx.units[u]["tensors"][i]

    # ---- fetch: parameters become views of the slot
    def _attach_views(self, u, addr, nbytes):
        info = self.ctx.units[u]
        flat = self.mem.view(addr, nbytes, _TORCH[info["dtype"]], info["numel"])
        for (name, p), shape, t in zip(self.params[u], self.shapes[u], info["tensors"]):
            ti = self.ctx.tensors[t]
            view = flat[ti["offset"]:ti["offset"] + ti["numel"]].view(shape)
            p.data = view
        self.views[u] = (addr, nbytes)

    def _fetch(self, u, aside):
        self.aside[u] = aside
        addr, nbytes = (self.ctx.fetch_aside if aside else self.ctx.fetch)(u)
        self.fetches += 1
        self.bytes_fetched += nbytes
        self._attach_views(u, addr, nbytes)

    def _acquire(self, u, aside=False):
        if self.refs[u] == 0:
            self._fetch(u, aside)
        self.refs[u] += 1

    def _drop(self, u):
        self.refs[u] -= 1
        if self.refs[u] == 0:
            self.mem.release(self.ctx, u, self.aside[u])

    def _pre_forward(self, m):
        # A forward without autograd (torch.no_grad(), inference_mode: an evaluation, which
        # often only rank 0 runs) reads outside the step's schedule: any rank, at any time. Not
        # the first forward of torch.utils.checkpoint (reentrant), which every rank runs in the
        # step (backward runs it again with autograd; its own fetches are never aside).
        aside = False
        if torch.is_grad_enabled():
            self._hook_new(m)
        else:
            aside = not _in_checkpoint()
        for u in self.needs[m]:
            self._acquire(u, aside)

    def _post_forward(self, m, outputs):
        for u in self.needs[m]:
            self._drop(u)
        if not torch.is_grad_enabled():
            return outputs
        if isinstance(outputs, torch.Tensor):
            if outputs.requires_grad:
                return _PreBackward.apply(self, m, outputs)[0]
            return outputs
        if isinstance(outputs, (tuple, list)):
            idx = [i for i, o in enumerate(outputs)
                   if isinstance(o, torch.Tensor) and o.requires_grad]
            if not idx:
                return outputs
            wrapped = _PreBackward.apply(self, m, *[outputs[i] for i in idx])
            out = list(outputs)
            for i, w in zip(idx, wrapped):
                out[i] = w
            return type(outputs)(out) if isinstance(outputs, tuple) else out
        return outputs

    def _backward_fetch(self, m):
        self._queue_final()
        for u in self.needs[m]:
            if not self.bwd_held[u]:
                self._acquire(u)
                self.bwd_held[u] = True

    # ---- gradients: each parameter's is taken from .grad once accumulated (so that no unit's
    # gradients outlive its push), packed in the unit's layout and pushed once the unit is complete
    def _hook_new(self, m):
        """Gradient hooks for the parameters of the units module m reads that require a gradient
        and have none yet (frozen at wrap and unfrozen since)."""
        for u in self.needs[m]:
            for i, (_, p) in enumerate(self.params[u]):
                if p.requires_grad and id(p) not in self.hooked:
                    self._hook(u, i, p)

    def _hook(self, u, i, p):
        # the node that accumulates p's gradient into p.grad: its hook runs once p.grad holds the
        # sum over every use of p in this backward (a tied parameter's too)
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        self.handles.append(acc.register_hook(lambda *_: self._grad_ready(u, i, p)))
        self.acc_nodes.append(acc)
        self.hooked.add(id(p))

    def _grad_ready(self, u, i, p):
        g, p.grad = p.grad, None
        if g is None:
            return
        self._queue_final()
        if i in self.grads[u]:
            g = self.grads[u][i] + g
        self.grads[u][i] = g
        self.has_grad[self._tensor(u, i)] = True
        if len(self.grads[u]) == sum(1 for _, q in self.params[u] if q.requires_grad):
            self._push(u)

    def _queue_final(self):
        """Once per backward: at its end, push the units that got only some of their gradients
        (parameters unused in this forward count as zero, and are not marked as having one)."""
        if not self.final_queued:
            self.final_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self):
        self.final_queued = False
        self._push_partial()

    def set_requires_gradient_sync(self, flag):
        """FSDP2's: False on the micro-steps before the last, True on the last. shardd sums every
        micro-step's gradients at the boundary either way; True after False tells it the coming
        backward is the step's last (shard_last_micro_step), so each unit's gradient crosses
        nodes as soon as it is pushed. True without a False before it in the step (FSDP2's
        default, every backward synced) promises nothing."""
        if not flag:
            self.sync_off = True
            self.ctx.last_micro_step(False)
        elif self.sync_off:
            self.ctx.last_micro_step(True)

    def _push_partial(self):
        """push the units that got some gradients, or were fetched for backward; the missing
        gradients count as zero"""
        for u in range(len(self.units)):
            if self.grads[u] or self.bwd_held[u]:
                self._push(u)

    def _push(self, u):
        # written straight into shardd's staging buffer (no temporary, no second copy; on a GPU
        # by copies on torch's current stream, which signals the push once they are done); the
        # buffer holds what an earlier push left, so the padding and missing gradients are zeroed
        info = self.ctx.units[u]
        addr = self.ctx.grad_buffer(u)
        flat = self.mem.view(addr, info["bytes"], _TORCH[info["dtype"]], info["numel"],
                             writable=True)
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
        self.mem.push(self.ctx, u)
        self.pushes += 1
        self.bytes_pushed += info["bytes"]
        self.grads[u].clear()
        if self.bwd_held[u]:
            self.bwd_held[u] = False
            self._drop(u)

    def hparams(self):
        """Every registered group's hyperparameters now: the optimizer object's param_groups
        (a scheduler may have changed them)."""
        groups = self.opt.param_groups
        if len(groups) != self.n_groups:
            raise RuntimeError(f"shard.torch: the optimizer has {len(groups)} param groups; "
                               f"{self.n_groups} were registered at wrap (groups cannot be added)")
        out = []
        for g in groups:
            if self.trainer is not None:
                out.append(_trainer_hparams(g))
                continue
            h = {"lr": float(g["lr"]), "weight_decay": float(g["weight_decay"])}
            if self.kind in _ADAM_LIKE:
                h["betas"] = tuple(float(b) for b in g["betas"])
                h["eps"] = float(g["eps"])
            else:
                h["momentum"] = float(g["momentum"])
            out.append(h)
        return out

    def step(self, loss_scale=None):
        if self.trainer is not None and self.trainer_steps is None:
            # every tensor's step count before the step: a trainer optimizer tells the tensors
            # no rank gave a gradient by an unchanged count
            self.trainer_steps = {t: self.ctx.read_steps(t) for t in range(len(self.ctx.tensors))}
        self._push_partial()
        bufs = self.bufs
        if bufs is not None and self.rank == 0:
            bufs.pack()
        try:
            norm = self.ctx.step(groups=self.hparams(), has_grad=self.has_grad,
                                 bcast=bufs.area if bufs is not None else None,
                                 loss_scale=loss_scale)
            if self.trainer is not None:  # the hand-off: this rank's shard, then the weights
                try:
                    self.trainer()
                finally:
                    self.ctx.step_update_done()
            if bufs is not None and self.rank != 0:
                bufs.unpack()
        except _shard.ShardError as e:
            if bufs is not None and self.rank != 0 and e.status == _shard.ENONFINITE:
                bufs.unpack()  # a skipped step broadcasts all the same
            raise
        finally:  # also when the step failed (a skipped step, ENONFINITE): the next one goes on
            self.sync_off = False
            self.has_grad = [False] * len(self.has_grad)
            for u, plist in enumerate(self.params):
                for _, p in plist:
                    p.grad = None
                    p.data = self.placeholder[p.dtype]
                self.views[u] = None
        return norm

    def amp_step(self, optimizer, grad_scaler):
        """scaler.step(optimizer) of a torch.amp.GradScaler: the step with the scaler's current
        scale, which the daemon divides out before the norm, the clipping and the optimizer, and
        the outcome told to the scaler as its own unscale_ would have found it (found_inf, the
        same on every rank: the daemon decides from the exchanged norm), so that scaler.update()
        backs off after a skipped step and grows after growth_interval steps taken, by torch's
        own rule. The norm, or None for a skipped step (the optimizer's state untouched)."""
        scale = float(grad_scaler.get_scale())
        found_inf = False
        try:
            norm = self.step(loss_scale=scale)
        except _shard.ShardError as e:
            if e.status != _shard.ENONFINITE:
                raise
            found_inf, norm = True, None
        dev = grad_scaler._scale.device
        grad_scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {
            dev: torch.full((), 1.0 if found_inf else 0.0, dtype=torch.float32, device=dev)}
        self.skipped_steps += found_inf
        self.grad_scaler = grad_scaler
        return norm


# torch.amp.GradScaler hands itself to an optimizer whose step takes grad_scaler (the optimizers
# of a wrapped model: the gradients are in shardd, out of its unscale_'s reach) and warns that
# this will change; shard.torch follows the change when torch makes it
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself",
                        category=FutureWarning)


def _refusal(call, why):
    """The ShardError a torch call that cannot work on a wrapped model raises: the call, why, and
    what to do instead."""
    return _shard.ShardError(_shard.ESTATE, why, call)


# torch's names of each optimizer's per-parameter state, and shardd's state index of each
_TORCH_STATE = {"adamw": {"exp_avg": 1, "exp_avg_sq": 2}, "sgd": {"momentum_buffer": 1}}
_TORCH_STATE["adam"], _TORCH_STATE["sgd-nesterov"] = _TORCH_STATE["adamw"], _TORCH_STATE["sgd"]


class ShardOptimizer(torch.optim.Optimizer):
    """The optimizer of a wrapped model, as torch sees it: param_groups with lr, weight_decay,
    betas and eps (AdamW) or momentum (SGD) per group, which schedulers change; step() runs the
    step in shardd with the groups' current values and returns the gradient norm (with a closure,
    the closure's loss, as torch's optimizers do); zero_grad() is accepted (the gradients are in
    shardd once pushed). The optimizer's state (master weights, moments) lives in shardd."""

    _step_supports_amp_scaling = True  # torch.amp.GradScaler: step(grad_scaler=) unscales

    def __init__(self, state, groups, defaults):
        super().__init__(groups, defaults)
        self._shard = state

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scaler is not None:
            norm = self._shard.amp_step(self, grad_scaler)
        else:
            norm = self._shard.step()
        return norm if closure is None else loss

    def state_dict(self):
        """torch's optimizer.state_dict of the wrapped model: the full state in torch's layout
        ('state': per parameter index AdamW's and Adam's step, exp_avg, exp_avg_sq, SGD's
        momentum_buffer; 'param_groups' with their hyperparameters and parameter indices),
        gathered from the job's nodes by this rank alone (rank 0 may call it alone, as
        nanoGPT's checkpoint does); a parameter never stepped has no state, as in torch."""
        return _optimizer_state(self._shard, self)

    def load_state_dict(self, state_dict):
        """torch's optimizer.load_state_dict on the wrapped model: a state dict in torch's
        layout (a torch optimizer's of the same kind and param groups: AdamW's and Adam's
        exp_avg, exp_avg_sq and step; SGD's momentum_buffer) into the daemon's shards, and its
        param groups' hyperparameters into these. Every rank calls it with the same dict
        between the same two steps (each writes its own shards); a parameter without state in
        it starts afresh, as torch's would."""
        _load_optimizer_state(self._shard, self, state_dict)

    def add_param_group(self, param_group):
        if getattr(self, "_shard", None) is not None:
            raise RuntimeError("shard.torch: parameter groups are fixed at wrap")
        super().add_param_group(param_group)


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


# the optimizers the daemon runs, as torch.optim computes them: libshard's names, and torch's
# defaults of each (torch.optim.AdamW, Adam, SGD; "sgd-nesterov" is SGD(nesterov=True))
_DEFAULTS = {"adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2},
             "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
             "sgd": {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0}}
_DEFAULTS["sgd-nesterov"] = _DEFAULTS["sgd"]
# the hyperparameters a group has, per optimizer; the whole optimizer's keys add these
_GROUP = {"adamw": ("lr", "betas", "eps", "weight_decay"), "sgd": ("lr", "momentum", "weight_decay")}
_GROUP["adam"], _GROUP["sgd-nesterov"] = _GROUP["adamw"], _GROUP["sgd"]
_KEYS = {n: set(g) | {"name", "max_grad_norm", "param_groups"} for n, g in _GROUP.items()}
_KEYS["sgd"].add("nesterov")
_ADAM_LIKE = ("adamw", "adam")  # the optimizers with betas and eps (and exp_avg, exp_avg_sq)
# a torch optimizer's options that change what shardd's optimizer computes, which it has only at
# torch's default value (any other value runs the optimizer in the trainers, _trainer_opt; the
# implementation options, foreach, fused, capturable, differentiable, change nothing there);
# Adam's decoupled_weight_decay and SGD's nesterov choose the kind (_from_torch)
_TORCH_SAME = {"adamw": {"amsgrad": False, "maximize": False},
               "sgd": {"dampening": 0, "maximize": False}}
_TORCH_SAME["adam"] = _TORCH_SAME["adamw"]
_TORCH_KINDS = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}
# what a torch optimizer's option that picks the kind makes of it: (option, kind if True)
_TORCH_FLAG = {"adam": ("decoupled_weight_decay", "adamw"), "sgd": ("nesterov", "sgd-nesterov")}
_SUPPORTED = ("torch.optim.AdamW, Adam, SGD (with or without nesterov), run by the daemon, or "
              "any other torch.optim optimizer whose update is per element, run by the ranks on "
              "their shards; a dict's name: adamw, adam, sgd (nesterov=True)")


class _Opt:
    """What wrap registers: the optimizer's name and clipping, each group's hyperparameters
    (torch's defaults filled in), each parameter's group, and the torch optimizer it came from."""

    def __init__(self, name, max_grad_norm, groups, group_of, torch_opt=None):
        self.name, self.max_grad_norm = name, max_grad_norm
        self.groups, self.group_of, self.torch_opt = groups, group_of, torch_opt
        self.trainer = None  # a trainer kind's (per-element state names, step count's type)


def _optimizer_of(optimizer, named):
    """The optimizer wrap registers, from a dict or a torch optimizer, with torch's defaults;
    unknown or unsupported keys are refused naming the key."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return _from_torch(optimizer, named)
    if not isinstance(optimizer, dict):
        raise TypeError(f"shard.torch.wrap: optimizer must be a dict or a torch optimizer "
                        f"({_SUPPORTED}), not {type(optimizer).__name__} (parameter groups: a "
                        "torch optimizer built on them, or the dict's 'param_groups')")
    name = str(optimizer.get("name", "adamw")).lower()
    if name not in _DEFAULTS:
        raise ValueError(f"shard.torch.wrap: optimizer '{name}' is not supported ({_SUPPORTED})")
    for k in optimizer:
        if k not in _KEYS[name]:
            raise ValueError(f"shard.torch.wrap: optimizer key '{k}' is not known for {name} "
                             f"(known: {', '.join(sorted(_KEYS[name]))})")
    base = dict(_DEFAULTS[name])
    base.update({k: v for k, v in optimizer.items() if k in _GROUP[name]})
    if optimizer.get("nesterov"):
        name = "sgd-nesterov"
    specs = optimizer.get("param_groups")
    if specs is None:
        return _Opt(name, float(optimizer.get("max_grad_norm", 0.0)), [base], {})
    by_name = dict(named)
    groups, group_of = [], {}
    for gi, spec in enumerate(specs):
        if not isinstance(spec, dict) or "params" not in spec:
            raise ValueError(f"shard.torch.wrap: param_groups[{gi}] must be a dict with 'params'")
        for k in spec:
            if k != "params" and k not in _GROUP[name]:
                raise ValueError(f"shard.torch.wrap: param_groups[{gi}] key '{k}' is not known "
                                 f"for {name} (known: params, {', '.join(_GROUP[name])})")
        for p in spec["params"]:
            if isinstance(p, str):
                if p not in by_name:
                    raise ValueError(f"shard.torch.wrap: param_groups[{gi}]: the model has no "
                                     f"parameter '{p}'")
                p = by_name[p]
            if id(p) in group_of:
                raise ValueError(f"shard.torch.wrap: a parameter is in param_groups "
                                 f"{group_of[id(p)]} and {gi}")
            group_of[id(p)] = gi
        g = dict(base)
        g.update({k: v for k, v in spec.items() if k != "params"})
        groups.append(g)
    _check_covered(named, group_of, "the optimizer's param_groups")
    return _Opt(name, float(optimizer.get("max_grad_norm", 0.0)), groups, group_of)


def _check_covered(named, group_of, what):
    missing = [n for n, p in named if p.requires_grad and id(p) not in group_of]
    if missing:
        raise ValueError(f"shard.torch.wrap: parameter '{missing[0]}' is not in {what}; "
                         "shardd updates every parameter that requires a gradient (freeze it "
                         "with requires_grad_(False) to leave it alone)")


def _from_torch(opt, named):
    name = _TORCH_KINDS.get(type(opt))
    if name is None:  # any other optimizer: the trainers run it on their shards
        return _trainer_opt(opt, named)
    for k, want in _TORCH_SAME[name].items():
        for g in opt.param_groups:
            if k in g and g[k] != want and not (want is None and g[k] is False):
                return _trainer_opt(opt, named)  # an option shardd's own does not have
    if name in _TORCH_FLAG:  # one kind for the whole optimizer: the flag alike in every group
        flag, kind = _TORCH_FLAG[name]
        values = [bool(g.get(flag, False)) for g in opt.param_groups]
        if len(set(values)) > 1:
            raise ValueError(f"shard.torch.wrap: {type(opt).__name__}'s param groups differ in "
                             f"'{flag}' ({values}); shardd runs one kind of optimizer per job")
        name = kind if values[0] else name
    if len(opt.state):
        raise ValueError("shard.torch.wrap: the torch optimizer has taken steps already; its "
                         "state cannot be moved into shardd (wrap before the first step)")
    groups, group_of = [], {}
    for gi, g in enumerate(opt.param_groups):
        for p in g["params"]:
            group_of[id(p)] = gi
        groups.append({k: tuple(g[k]) if k == "betas" else g[k] for k in _GROUP[name]})
    _check_covered(named, group_of, "the torch optimizer's param groups")
    return _Opt(name, 0.0, groups, group_of, opt)


# ---- any other torch optimizer, run by each rank on its own shard (the trainer kinds)

_NOT_IN_STATE = ("step", )  # a torch optimizer's per-parameter scalars that shardd keeps itself


def _clone_optimizer(opt, groups):
    """A copy of torch optimizer opt (its class, options, hooks) over other parameters: groups,
    one list of tensors per param group of opt, with an empty state. Its step() is the class's
    own (not the one wrap puts on opt)."""
    new = object.__new__(type(opt))
    new.__dict__.update({k: v for k, v in opt.__dict__.items()
                         if k not in ("step", "state_dict", "load_state_dict",
                                      "_shard_translated", "_step_supports_amp_scaling", "state",
                                      "param_groups")})
    new.state = collections.defaultdict(dict)
    new.param_groups = [dict(g, params=list(ps)) for g, ps in zip(opt.param_groups, groups)]
    return new


def _probe_trainer(opt):
    """Which state torch optimizer opt keeps per parameter, from one step of a copy of it on a
    stand-in parameter: (the names of its per-element tensors, in the order it made them, and
    the type of its step count: ('tensor', dtype), 'int' or None). An optimizer that keeps
    anything else, more than 4 per-element tensors, or cannot step without a closure is
    refused naming it."""
    what = type(opt).__name__
    p = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 8))
    try:  # (a new one: torch's Adagrad makes its state in __init__)
        clone = type(opt)([dict({k: v for k, v in opt.param_groups[0].items() if k != "params"},
                                params=[p])], **opt.defaults)
    except Exception:
        clone = _clone_optimizer(opt, [[p]] + [[] for _ in opt.param_groups[1:]])
    made = {k: v.clone() for k, v in clone.state.get(p, {}).items() if torch.is_tensor(v)}
    if any(v.is_floating_point() and v.shape == p.shape and bool(v.any()) for v in made.values()):
        raise ValueError(f"shard.torch.wrap: {what} starts a state at values other than 0 "
                         f"({', '.join(k for k, v in made.items() if v.shape == p.shape and v.any())}"
                         "); shardd starts every state at 0 (keep its initial value 0)")
    p.grad = torch.linspace(0.5, -0.5, 8)
    try:
        clone.step()
    except Exception as e:
        raise ValueError(f"shard.torch.wrap: {what} cannot run on the ranks' shards: its step() "
                         f"without a closure on a stand-in parameter failed ({type(e).__name__}: "
                         f"{e})") from None
    state = clone.state.get(p, {})
    names, step, odd = [], None, []
    for k, v in state.items():
        if torch.is_tensor(v) and v.shape == p.shape and v.is_floating_point():
            names.append(k)
        elif k in _NOT_IN_STATE and torch.is_tensor(v) and v.numel() == 1:
            step = ("tensor", v.dtype)
        elif k in _NOT_IN_STATE and isinstance(v, (int, float)):
            step = "int"
        else:
            odd.append(k)
    if odd or len(names) > 4:
        raise ValueError(
            f"shard.torch.wrap: {what} keeps per-parameter state shardd cannot hold on the "
            f"shards ({', '.join(odd) if odd else f'{len(names)} tensors'}; shardd keeps up to 4 "
            "tensors of the parameter's shape, each element on its own, and the step count): "
            f"use {_SUPPORTED}, or an optimizer whose update is per element")
    return names, step


def _step_name(step):
    """how a probed step type is named in torch.json (and shard.dcp): "tensor", "int" or None"""
    return step if step in (None, "int") else "tensor"


def _trainer_opt(opt, named):
    """_Opt of a torch optimizer the daemon does not run: the trainer kind with its states"""
    def stepped(s):
        v = s.get("step", 0)
        return bool(v.item() if torch.is_tensor(v) and v.numel() == 1 else v)
    if any(stepped(s) for s in opt.state.values()):
        raise ValueError("shard.torch.wrap: the torch optimizer has taken steps already; its "
                         "state cannot be moved into shardd (wrap before the first step)")
    names, step = _probe_trainer(opt)
    groups, group_of = [], {}
    for gi, g in enumerate(opt.param_groups):
        for p in g["params"]:
            group_of[id(p)] = gi
        groups.append(_trainer_hparams(g))
    _check_covered(named, group_of, "the torch optimizer's param groups")
    out = _Opt(f"trainer{len(names)}", 0.0, groups, group_of, opt)
    out.trainer = (names, step)
    return out


def _trainer_hparams(g):
    """what shardd checks and shows of a trainer optimizer's group: its lr and weight decay
    (every rank's alike), where they are numbers"""
    def num(k):
        v = g.get(k, 0.0)
        v = v.item() if torch.is_tensor(v) and v.numel() == 1 else v
        return float(v) if isinstance(v, (int, float)) and 0 <= v < float("inf") else 0.0
    return {"lr": num("lr"), "weight_decay": num("weight_decay")}


class _TrainerStep:
    """A rank's part of a trainer optimizer's step: at the hand-off, for each unit, its own shard
    of the gradient sums (times the step's factor), the masters and the states read from shardd
    into flat fp32 buffers; each tensor's piece of the shard is a parameter of a copy of the
    user's optimizer (its param groups' current options), with its state as views of the
    buffers and its step count shardd's; one step of that copy; the masters and states written
    back. shardd keeps them (state_dict, checkpoints)."""

    def __init__(self, st, opt, names, step):
        self.st, self.opt, self.names, self.step_type = st, opt, names, step
        self.pieces = None  # per unit: (first, count, [(tensor, lo, hi, group)])

    def _layout(self):
        st, out, scratch = self.st, [], None
        tensor_group = {st.ctx.units[u]["tensors"][i]: g
                        for u, ps in enumerate(st.params) for i, (_, p) in enumerate(ps)
                        for g in [st.group_of.get(id(p), 0)]}
        for u, info in enumerate(st.ctx.units):
            if scratch is None or scratch.numel() < info["numel"]:
                scratch = torch.empty(info["numel"], dtype=torch.float32)
            first, count = st.ctx.read_own(u, 0, scratch.data_ptr(), scratch.numel())
            ps = []
            for t in info["tensors"]:
                ti = st.ctx.tensors[t]
                lo = max(ti["offset"], first)
                hi = min(ti["offset"] + ti["numel"], first + count)
                if lo < hi:
                    ps.append((t, lo - first, hi - first, tensor_group[t]))
            out.append((first, count, ps))
        return out

    def __call__(self):
        st = self.st
        if self.pieces is None:
            self.pieces = self._layout()
        scale = st.ctx.step_grad_scale()
        user_groups = self.opt.param_groups
        for u, (first, count, ps) in enumerate(self.pieces):
            if not ps:
                continue
            bufs = [torch.empty(count, dtype=torch.float32) for _ in range(2 + len(self.names))]
            grad, master, states = bufs[0], bufs[1], bufs[2:]
            st.ctx.read_own(u, _shard.OWN_GRAD, grad.data_ptr(), count)
            grad.mul_(scale)
            st.ctx.read_own(u, 0, master.data_ptr(), count)
            for i, s in enumerate(states):
                st.ctx.read_own(u, i + 1, s.data_ptr(), count)
            groups = [[] for _ in user_groups]
            local = {}
            for t, lo, hi, g in ps:
                steps = st.ctx.read_steps(t)  # (this step counted where a rank gave a gradient)
                if steps == st.trainer_steps[t]:
                    continue  # no rank gave it a gradient: left as it is, as torch skips it
                st.trainer_steps[t] = steps
                p = torch.nn.Parameter(master[lo:hi])
                p.grad = grad[lo:hi]
                groups[g].append(p)
                entry = {n: s[lo:hi] for n, s in zip(self.names, states)}
                if self.step_type == "int":
                    entry["step"] = steps - 1
                elif self.step_type is not None:
                    entry["step"] = torch.tensor(float(steps - 1), dtype=self.step_type[1])
                local[p] = (entry, master[lo:hi], [s[lo:hi] for s in states])
            if not local:
                continue
            clone = _clone_optimizer(self.opt, groups)
            for p, (entry, _, _) in local.items():
                clone.state[p] = entry
            clone.step()
            for p, (entry, m, ss) in local.items():  # (an optimizer may have replaced them)
                if p.data_ptr() != m.data_ptr():
                    m.copy_(p.detach())
                for n, s in zip(self.names, ss):
                    v = clone.state[p].get(n)
                    if torch.is_tensor(v) and v.data_ptr() != s.data_ptr():
                        s.copy_(v)
            st.ctx.write_own(u, 0, master.data_ptr(), count)
            for i, s in enumerate(states):
                st.ctx.write_own(u, i + 1, s.data_ptr(), count)


def _ranks_per_node(given):
    """The job's ranks per node: given, else the launcher's (torchrun, Slurm), else 0 (the
    daemon's)."""
    if given is not None:
        return int(given)
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        v = os.environ.get(var, "")
        if v:
            try:
                return int(v)
            except ValueError:
                raise ValueError(f"shard.torch.wrap: {var}={v!r} is not a number of ranks per "
                                 "node") from None
    return 0


def _job_secret(given):
    """The job's secret: given, else $SHARD_JOB_SECRET_FILE's bytes, else None. (Not one rank 0
    makes for each run: a job restarted under the same name, to resume, must give the same.)"""
    if given is not None:
        return bytes(given)
    path = os.environ.get("SHARD_JOB_SECRET_FILE", "")
    if path:
        try:
            with open(path, "rb") as f:
                return f.read(4097)
        except OSError as e:
            raise ValueError(f"shard.torch.wrap: SHARD_JOB_SECRET_FILE={path!r}: "
                             f"{e.strerror}") from None
    return None


def _launcher_int(names, default):
    """The first of the launcher's variables names that is set, as a number; else default."""
    for var in names:
        v = os.environ.get(var, "")
        if v:
            try:
                return int(v)
            except ValueError:
                raise ValueError(f"shard.torch.wrap: {var}={v!r} is not a number") from None
    return default


def launcher(job=None, rank=None, world=None):
    """(job, rank, world) as wrap takes them where not given: torchrun's RANK, WORLD_SIZE and
    TORCHELASTIC_RUN_ID (job torch-ID), else Slurm's SLURM_PROCID, SLURM_NTASKS and
    SLURM_JOB_ID with SLURM_STEP_ID (job slurm-ID.STEP), else rank 0 of 1, job "torch". For a
    script that needs its rank before wrap (to pick its data); ValueError for a rank outside
    the world or a variable that is not a number."""
    env = os.environ
    if rank is None:
        rank = _launcher_int(("RANK", "SLURM_PROCID"), 0)
    if world is None:
        world = _launcher_int(("WORLD_SIZE", "SLURM_NTASKS"), 1)
    if job is None:
        run, sjob, sstep = (env.get("TORCHELASTIC_RUN_ID"), env.get("SLURM_JOB_ID"),
                            env.get("SLURM_STEP_ID"))
        if run:
            job = f"torch-{run}"
        elif sjob:
            job = f"slurm-{sjob}.{sstep}" if sstep else f"slurm-{sjob}"
        else:
            job = "torch"
    if not 0 <= rank < world:
        raise ValueError(f"shard.torch.wrap: rank {rank} is outside world {world} (RANK "
                         f"{env.get('RANK')}, WORLD_SIZE {env.get('WORLD_SIZE')}, SLURM_PROCID "
                         f"{env.get('SLURM_PROCID')}, SLURM_NTASKS {env.get('SLURM_NTASKS')})")
    return job, rank, world


# What FSDP2, FSDP1 and DeepSpeed call shardd's plans and options (docs/pytorch.md, FSDP2 and DeepSpeed):
# wrap refuses them naming shardd's spelling, rather than a bare TypeError or an unknown plan
_HSDP = ("'mics:P', P the ranks of a shard group (FSDP2's HSDP on a 2-D mesh (replicas, P), "
         "FSDP1's HYBRID_SHARD, DeepSpeed's mics_shard_size=P)")
_FOREIGN_PLANS = {
    "full_shard": "'zero3' (FSDP1's FULL_SHARD, FSDP2's fully_shard, DeepSpeed's stage 3)",
    "fully_shard": "'zero3' (FSDP2's fully_shard: every state over the world)",
    "fsdp": "'zero3' (FSDP's full sharding)", "stage3": "'zero3'", "zero_3": "'zero3'",
    "shard_grad_op": "'zero2' (FSDP1's SHARD_GRAD_OP, DeepSpeed's stage 2)",
    "stage2": "'zero2'", "zero_2": "'zero2'", "stage1": "'zero1'", "zero_1": "'zero1'",
    "no_shard": "'ddp' (FSDP1's NO_SHARD)", "hybrid_shard": _HSDP, "hsdp": _HSDP, "mics": _HSDP,
    "_hybrid_shard_zero2": "'topo:1/P/P' (FSDP1's _HYBRID_SHARD_ZERO2 with a shard group of P)",
    "zero++": "'zeropp' (ZeRO++: ',sec=S' for zero_hpz_partition_size, ',qw' and ',qg' for "
              "the quantized weights and gradients)",
}
_FOREIGN_ARGS = {
    "mesh": f"HSDP's 2-D mesh is plan={_HSDP}; ranks share a node by ranks_per_node",
    "device_mesh": f"HSDP's 2-D mesh is plan={_HSDP}; ranks share a node by ranks_per_node",
    "sharding_strategy": "the sharding is the plan: 'zero3', 'zero2', 'ddp', 'mics:P', 'topo:W/G/OS'",
    "reshard_after_forward": "the plan says what stays gathered: 'zero3' releases a unit after "
                             "its forward, 'zero2' and 'topo:1/G/OS' keep the weights whole",
    "mics_shard_size": f"plan={_HSDP}",
    "mics_hierarchical_params_gather": "'mics:P' gathers hierarchically by default "
                                       "(',no-hier' turns it off)",
    "zero_hpz_partition_size": "plan='zeropp,sec=S' (ZeRO++'s secondary partition of S ranks)",
    "zero_quantized_weights": "plan='zeropp,qw' (int8 weights on the wire)",
    "zero_quantized_gradients": "plan='zeropp,qg' (quantized gradients)",
    "stage": "plan='zero1', 'zero2' or 'zero3'",
    "mp_policy": "the weights travel and compute in the model's dtype (bf16 masters are kept "
                 "fp32 in shardd): cast the model with .to(torch.bfloat16) before wrap; "
                 "MixedPrecisionPolicy's reduce_dtype is wrap(reduce_dtype=torch.bfloat16)",
    "mixed_precision": "the weights travel and compute in the model's dtype (bf16 masters are "
                       "kept fp32 in shardd): cast the model with .to(torch.bfloat16) before "
                       "wrap; reduce_dtype is wrap(reduce_dtype=torch.bfloat16)",
    "offload_policy": "shardd keeps the shards in its own memory (host or GPU by its --backend)",
    "cpu_offload": "shardd keeps the shards in its own memory (host or GPU by its --backend)",
    "process_group": "the job is the daemons' (job=, rank=, world=), not a process group",
}


_GWIRE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _with_reduce_dtype(plan, reduce_dtype):
    """the plan with reduce_dtype as its ,gwire= option (refused where the plan says another)"""
    if reduce_dtype is None:
        return plan
    if reduce_dtype not in _GWIRE:
        raise ValueError(f"shard.torch.wrap: reduce_dtype={reduce_dtype}: gradients cross nodes "
                         f"in torch.bfloat16, torch.float16 or torch.float32")
    want = _GWIRE[reduce_dtype]
    given = [o[len("gwire="):] for o in str(plan).split(",")[1:] if o.startswith("gwire=")]
    if given and given[-1] != want:
        raise ValueError(f"shard.torch.wrap: reduce_dtype={reduce_dtype} but plan {plan!r} says "
                         f"gwire={given[-1]}: give one of them")
    return plan if given or want == "fp32" else f"{plan},gwire={want}"


def _foreign(plan, kwargs):
    """a ValueError naming shardd's spelling for another system's plan name or wrap argument,
    a TypeError for an argument nobody knows; None when there is neither"""
    for k in kwargs:
        if k in _FOREIGN_ARGS:
            return ValueError(f"shard.torch.wrap: {k}= is FSDP's or DeepSpeed's; in shardd: "
                              f"{_FOREIGN_ARGS[k]} (docs/pytorch.md, FSDP2 and DeepSpeed)")
        return TypeError(f"shard.torch.wrap() got an unexpected keyword argument '{k}'")
    key = str(plan).strip().lower().replace("-", "_").removeprefix("shardingstrategy.")
    if key in _FOREIGN_PLANS:
        return ValueError(f"shard.torch.wrap: plan '{plan}' is another system's name; shardd's "
                          f"is {_FOREIGN_PLANS[key]} (docs/pytorch.md, FSDP2 and DeepSpeed)")
    return None


_clip_patched = False
_steps_guarded = False


def _stray_check(opt):
    """A torch optimizer that was not given to wrap cannot update a wrapped model's parameters
    (their values live in shardd): say so at its step() instead of letting it do nothing, or
    write into the read-only gathered weights."""
    if isinstance(opt, ShardOptimizer) or getattr(opt, "_shard_translated", False):
        return
    for g in opt.param_groups:
        for p in g["params"]:
            if getattr(p, "_shard_wrapped", False):
                raise RuntimeError(
                    f"shard.torch: this {type(opt).__name__} holds parameters of a wrapped model, "
                    "whose values live in shardd: it cannot update them. Give it to "
                    "shard.torch.wrap(model, optimizer=...) (its step() then steps in shardd), "
                    "or step shard.torch.optimizer(model)")


def _guard_steps():
    """Every torch optimizer's step() checks _stray_check first: torch's global step pre-hook
    where it exists (torch >= 2.0), else each optimizer class's step wrapped once."""
    global _steps_guarded
    if _steps_guarded:
        return
    _steps_guarded = True
    optim_mod = getattr(torch.optim, "optimizer", None)
    if hasattr(optim_mod, "register_optimizer_step_pre_hook"):
        optim_mod.register_optimizer_step_pre_hook(lambda opt, args, kwargs: _stray_check(opt))
        return
    todo = list(torch.optim.Optimizer.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        fn = cls.__dict__.get("step")
        if fn is None or getattr(fn, "_shard_guarded", False) or cls is ShardOptimizer:
            continue

        def guarded(self, *args, _fn=fn, **kwargs):
            _stray_check(self)
            return _fn(self, *args, **kwargs)
        guarded._shard_guarded = True
        guarded.__wrapped__ = fn
        for attr in ("__name__", "__qualname__", "__doc__"):
            setattr(guarded, attr, getattr(fn, attr, None))
        cls.step = guarded


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


def _model_device(named):
    """The one device every parameter is on (CPU for a model without parameters); parameters on
    several devices are refused naming two of them."""
    first = {}
    for n, p in named:
        first.setdefault(p.device, n)
    if len(first) > 1:
        (da, na), (db, nb) = list(first.items())[:2]
        raise ValueError(f"shard.torch.wrap: parameter '{na}' is on {da} and '{nb}' on {db}; "
                         "every parameter of a wrapped model must be on one device (the "
                         "daemon's GPU, or the CPU); nothing was registered")
    return next(iter(first)) if first else torch.device("cpu")


def _uuid_hex(s):
    """a UUID's 32 hex digits, whichever way it was printed ("GPU-..." by nvidia-smi and shardd,
    torch's _CUuuid without the prefix)"""
    s = str(s).lower()
    s = s[4:] if s.startswith("gpu-") else s
    return "".join(c for c in s if c in "0123456789abcdef")


def _torch_uuid(device):
    """torch's UUID of a CUDA device ("" where this torch does not say)"""
    u = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return _uuid_hex(u) if u is not None else ""


def _torch_device_of(uuid):
    """the torch device (cuda:K) whose UUID is uuid, or None"""
    want = _uuid_hex(uuid)
    if want and torch.cuda.is_available():
        for k in range(torch.cuda.device_count()):
            if _torch_uuid(k) == want:
                return torch.device("cuda", k)
    return None


_HOST_MEMORY = ("host", "host-deferred", "emu", "emu-device")


def _placement_error(dev, memory, gpu, backend):
    """Why a model on dev cannot train through a job whose buffers are `memory` ("host", "cuda",
    "hip", "emu-gpu") on the daemon's device gpu ({"name", "uuid", "index"} or None), or None
    where it can. Never a move: the caller refuses with this message."""
    where = (f"GPU {gpu.get('index', 0)} ({gpu.get('name', '?')}, {gpu.get('uuid') or 'no UUID'})"
             if gpu else "its device")
    if memory == "host":
        if dev.type == "cpu":
            return None
        return (f"the model is on {dev}, but the daemon (backend {backend}) keeps shards in host "
                "memory: run shardd with --backend cuda on this GPU's machine, or move the model "
                "to the CPU (model.cpu())")
    if memory in ("cuda", "hip"):
        if dev.type != "cuda":  # torch calls ROCm devices "cuda" too
            near = _torch_device_of(gpu.get("uuid", "")) if gpu else None
            return (f"the model is on {dev}, but the daemon (backend {backend}) keeps shards in "
                    f"the memory of {where}: move the model there "
                    f"(model.to('{near or 'cuda'}')) before wrap, or run shardd with --backend "
                    "host")
        want = _uuid_hex(gpu.get("uuid", "")) if gpu else ""
        have = _torch_uuid(dev)
        if want and have and want != have:
            near = _torch_device_of(want)
            hint = (f"move the model to {near} (model.to('{near}'))" if near else
                    "that GPU is not visible to this process (CUDA_VISIBLE_DEVICES?)")
            return (f"the model is on {dev} ({torch.cuda.get_device_name(dev)}, GPU-{have}), but "
                    f"the daemon keeps this job's shards on {where}: {hint}")
        return None
    return (f"the daemon (backend {backend}) keeps shards in {memory} memory, which torch cannot "
            "address (the emulated GPU is reached only through copies: shard_copy); use "
            "--backend host or cuda")


def _check_devices(named, socket, rank=0, ranks_per_node=0):
    """The model's device, checked against the daemon's memory before anything is registered
    (wrap checks again against what the registration's reply says): a mismatch is refused naming
    both, the model left where it is. The daemon is asked through its admin socket; where that is
    not allowed, only the reply's check stands. A daemon driving several GPUs keeps local rank
    i's buffers on GPU rank_devices[i mod their count] (its config devices): the rank's is the
    one checked."""
    dev = _model_device(named)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"shard.torch.wrap: the model is on {dev}; shard.torch trains CPU and "
                         "CUDA models; nothing was registered")
    try:
        st = _shard.admin("topology", socket=socket)
    except Exception:  # no admin access: the registration's reply decides
        return dev
    backend = st.get("backend", "host")
    memory = "host" if backend in _HOST_MEMORY else backend
    gpus = st.get("devices") or []
    gpu = next((g for g in gpus if g.get("driven")), gpus[0] if gpus else None)
    cycle = st.get("rank_devices") or []
    k = ranks_per_node or st.get("ranks_per_node") or 0
    if cycle and gpus:
        local = rank % k if k else rank
        want = cycle[local % len(cycle)]
        gpu = next((g for g in gpus if g.get("index") == want), gpu)
    err = _placement_error(dev, memory, gpu, backend)
    if err:
        raise ValueError(f"shard.torch.wrap: {err}; nothing was registered")
    return dev


def _registration(model, optimizer=None, units=None, max_grad_norm=None):
    """What wrap registers for model and optimizer, in its order, without a daemon: opt (the
    translated optimizer), names ({id(param): its name}), reg_units and reg_params (the units
    with parameters of their own and their (name, param) lists), hooked and needs (every module
    hooked and the units it fetches) and tensors (shard.Tensor: name, shape, dtype, unit and
    param group of each registered tensor). shard.dcp builds a checkpoint in this order."""
    named = list(model.named_parameters())
    opt = _optimizer_of({"name": "adamw"} if optimizer is None else optimizer, named)
    if max_grad_norm is not None:
        opt.max_grad_norm = float(max_grad_norm)
    if units is None:
        units = _default_units(model)
    units = [model.get_submodule(m) if isinstance(m, str) else m for m in units]
    names = {id(p): n for n, p in named}
    owner = {}
    plist, borrows = [], []
    for u, m in enumerate(units):
        ps, borrow = [], []
        for _, p in m.named_parameters():
            if id(p) in owner:
                if owner[id(p)] != u and owner[id(p)] not in borrow:
                    borrow.append(owner[id(p)])  # tied: read from its first unit
                continue
            owner[id(p)] = u
            ps.append((names[id(p)], p))
        plist.append(ps)
        borrows.append(borrow)
    rest = [(n, p) for n, p in named if id(p) not in owner]
    if rest:
        units.append(model)
        plist.append(rest)
        borrows.append([])
    # units with parameters of their own are registered, in order; a module whose parameters
    # all belong to earlier units (an lm_head tied to the embedding) only fetches those
    index, reg_units, reg_params, hooked, needs = {}, [], [], [], []
    for m, ps in zip(units, plist):
        if ps:
            index[id(m)] = len(reg_units)
            reg_units.append(m)
            reg_params.append(ps)
    remap = [index.get(id(m)) for m in units]
    for own in (True, False):  # registered units first: hooked module u is unit u
        for m, ps, borrow, u in zip(units, plist, borrows, remap):
            if bool(ps) == own:
                hooked.append(m)
                needs.append(([u] if own else []) + [remap[b] for b in borrow])
    tensors = []
    for u, ps in enumerate(reg_params):
        dts = {p.dtype for _, p in ps}
        if len(dts) != 1 or next(iter(dts)) not in _DTYPES:
            raise ValueError(f"shard.torch.wrap: unit {u} mixes or uses unsupported dtypes "
                             f"{sorted(str(d) for d in dts)}; one of float32, bfloat16, float16 "
                             "per unit")
        for name, p in ps:
            tensors.append(_shard.Tensor(name, tuple(p.shape) or (1,), _DTYPES[p.dtype], u,
                                         opt.group_of.get(id(p), 0)))
    return types.SimpleNamespace(opt=opt, names=names, reg_units=reg_units,
                                 reg_params=reg_params, hooked=hooked, needs=needs,
                                 tensors=tensors)


# The forward hooks of hooked module m (partials of these, not closures: pickling a wrapped model
# then reaches _State.__reduce_ex__ and its message).
def _pre_forward_hook(state, m, module, inputs):
    return state._pre_forward(m)


def _post_forward_hook(state, m, module, inputs, outputs):
    return state._post_forward(m, outputs)


def wrap(model, socket=None, job=None, rank=None, world=None, plan="zero3", optimizer=None,
         units=None, max_live_bytes=0, max_grad_norm=None, broadcast_buffers=True, load=None,
         resume_timeout_ms=0, ranks_per_node=None, job_secret=None, leader=None,
         reduce_dtype=None, **foreign):
    """Register model's parameters with shardd and install the hooks; returns model.

    rank, world and job default from torchrun's RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID
    ("torch-<id>"), else Slurm's SLURM_PROCID, SLURM_NTASKS and SLURM_JOB_ID with SLURM_STEP_ID
    ("slurm-<id>.<step>"), else rank 0 of 1, job "torch"; socket from $SHARD_SOCKET.
    ranks_per_node: the job's ranks per node (ranks r with the same r // ranks_per_node share a
    node, any of the cluster's: the job's node r // ranks_per_node), by default torchrun's
    LOCAL_WORLD_SIZE or Slurm's SLURM_NTASKS_PER_NODE, else the daemon's ranks_per_node.
    job_secret: the job's secret (16-4096 bytes, the same on every rank and across restarts of
    the job: a resumed job's ranks give the one it ran with, or its nodes refuse them): the
    daemons form the job across nodes of the nodes whose ranks gave it, and refuse a node that
    reports the job without it. By default the bytes of the file $SHARD_JOB_SECRET_FILE names
    (made once per job, `head -c 32 /dev/urandom`, where every rank reads it), else none; a job
    across independent daemons (no cluster list) needs one.
    leader: "host[:port]" of the job's leader, the daemon of rank 0's node, which independent
    daemons meet through; by default $SHARD_LEADER, else torchrun's MASTER_ADDR, else the first
    host of Slurm's SLURM_STEP_NODELIST (port $SHARD_LEADER_PORT, else 7701).
    units: submodules (or their names) that become units, in forward order; by default every
    direct child with parameters, descending into ModuleList, ModuleDict and Sequential.
    Parameters outside them form one more unit fetched around the whole model's forward. A
    parameter shared by several units (tied weights) belongs to the first; the others fetch that
    unit too.
    optimizer: a torch.optim.AdamW, Adam or SGD (nesterov too) built on the model's parameters,
    its param groups and their hyperparameters translated (its step() then steps in shardd, so
    a scheduler built on it drives the learning rate); or {"name": "adamw"|"adam"|"sgd", "lr",
    "betas", "eps", "weight_decay", "momentum", "nesterov", "max_grad_norm", "param_groups":
    [{"params": [...], "lr": ...}, ...]} with torch's defaults (AdamW: lr 1e-3, betas (0.9,
    0.999), eps 1e-8, weight_decay 0.01; Adam: the same with weight_decay 0; SGD: lr 1e-3,
    momentum 0, weight_decay 0), unknown keys refused. shard.torch.optimizer(model)
    is the torch.optim.Optimizer to step and schedule. max_grad_norm: clip the global gradient
    norm (0: no clipping).
    broadcast_buffers: every step sets every rank's module buffers (BatchNorm's running
    statistics) to rank 0's, as DDP's broadcast_buffers=True does before each forward; ranks
    then never drift apart, and evaluation does not depend on the rank. Buffers only move in
    forwards and are read in eval, so at every step boundary they are what DDP has. False:
    each rank keeps its own.
    Parameters with requires_grad False are not updated; nor is, in a step, a parameter that no
    rank gave a gradient (torch's optimizers skip a .grad of None).
    plan: "topo:W/G/OS" (shard factors of the weights, gradients and optimizer states) or a
    preset: "ddp", "zero1", "zero2", "zero3", "mics:P", "topo", "topo-fp", "zeropp" (with
    ",no-hier", ",no-2hop", ",hop-ar", ",sec=S" and the quantized ",qw", ",qg", ",qsec", ",ef",
    ",qblock=B", ",gwire=bf16|fp16"; docs/plans.md). Every rank must build the same model;
    rank 0's values are the
    initial ones. FSDP's and DeepSpeed's names for plans and options ("FULL_SHARD", "hsdp",
    mesh=, mics_shard_size=, zero_hpz_partition_size=, mp_policy=, ...) are refused with
    shardd's spelling (docs/pytorch.md, FSDP2 and DeepSpeed).
    load: a checkpoint written by shard.torch.save (a directory of them, meaning its LATEST, or
    one checkpoint) to start from instead of rank 0's values, under any world and plan: the
    parameters, the optimizer's moments and step counts, and the param groups' hyperparameters
    (set into the optimizer's param_groups, as torch's load_state_dict does) are the
    checkpoint's, and each group's lr and the entries schedulers add (initial_lr) are as
    shard.torch.save found them; shard.torch.start_step(model) is its step, and a scheduler
    built with last_epoch=start_step - 1 goes on where it was. Module buffers are not in it.
    resume_timeout_ms: when a rank dies the job pauses for that long (0: the daemon's
    resume_timeout_ms, off unless configured): the other ranks' calls raise shard.ShardError
    with .status == shard.EPAUSED naming the rank and the step. Wrapping again (every rank, the
    same model and job) within it resumes the job from that step, as load= would:
    shard.torch.start_step(model) says which; a step half done is discarded.
    reduce_dtype: FSDP2's MixedPrecisionPolicy.reduce_dtype, the dtype gradients cross nodes
    in: torch.bfloat16 or torch.float16 sends them rounded once and sums them in fp32 at their
    owners (the plan option ",gwire=bf16|fp16", half the bytes); None or torch.float32: fp32."""
    global _current
    err = _foreign(plan, foreign)
    if err is not None:
        raise err
    plan = _with_reduce_dtype(plan, reduce_dtype)
    if load is not None and os.path.exists(os.path.join(os.fspath(load), ".metadata")):
        raise ValueError(f"shard.torch.wrap: load={os.fspath(load)!r} is a "
                         "torch.distributed.checkpoint (DCP) directory, not a shardd checkpoint: "
                         "convert it once with shard.dcp.to_shardd(dcp_dir, out, model, "
                         "optimizer) and load out (docs/pytorch.md, FSDP2)")
    job, rank, world = launcher(job, rank, world)
    named = list(model.named_parameters())
    dev = _check_devices(named, socket, rank, _ranks_per_node(ranks_per_node))
    reg = _registration(model, optimizer, units, max_grad_norm)
    opt, names, reg_units, reg_params = reg.opt, reg.names, reg.reg_units, reg.reg_params
    hooked, needs, tensors = reg.hooked, reg.needs, reg.tensors
    init = [p.detach().to("cpu", torch.float32).contiguous().reshape(-1)
            for ps in reg_params for _, p in ps] if rank == 0 else None
    bufs = _Buffers(model) if broadcast_buffers else None
    ctx = _shard.Context(socket)
    try:
        # libshard imports a GPU's memory into the calling thread's current device: the model's
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            if dev.type == "cuda":
                torch.empty(0, device=dev)  # its context made and current
            ctx.register(job=job, rank=rank, world=world, plan=plan, tensors=tensors,
                         optimizer=dict(opt.groups[0], name=opt.name,
                                        max_grad_norm=opt.max_grad_norm),
                         init=init, max_live_bytes=max_live_bytes,
                         groups=opt.groups, skip_unused=True,
                         bcast_bytes=bufs.nbytes if bufs else 0, load=load,
                         resume_timeout_ms=resume_timeout_ms,
                         ranks_per_node=_ranks_per_node(ranks_per_node),
                         job_secret=_job_secret(job_secret), leader=leader)
        err = _placement_error(dev, ctx.memory,
                               {"index": "of this rank", "name": "the daemon's",
                                "uuid": ctx.device_uuid},
                               ctx.memory)
        if err:
            raise ValueError(f"shard.torch.wrap: job '{job}': {err}")
    except Exception:
        ctx.detach()
        raise
    state = _State(model, ctx, reg_units, reg_params, needs, job,
                   _memory_for(dev))
    state.aliases = {n: names[id(p)]  # a tied parameter's other names, as state_dict has them
                     for n, p in torch.nn.Module.state_dict(model, keep_vars=True).items()
                     if id(p) in names and n != names[id(p)]}
    state.kind, state.n_groups = opt.name, len(opt.groups)
    state.group_of = opt.group_of
    if getattr(opt, "trainer", None) is not None:
        state.trainer = _TrainerStep(state, opt.torch_opt, *opt.trainer)
        state.trainer_names = {n: i + 1 for i, n in enumerate(opt.trainer[0])}
    state.plan = plan
    state.bufs = bufs if bufs and bufs.nbytes else None
    state.rank = rank
    for dt in {p.dtype for ps in reg_params for _, p in ps}:
        state.placeholder[dt] = torch.empty(0, dtype=dt, device=dev)
    saved = []  # (param, its data): put back if wrap fails half-way
    try:
        for m, mod in enumerate(hooked):
            state.handles.append(mod.register_forward_pre_hook(
                functools.partial(_pre_forward_hook, state, m)))
            state.handles.append(mod.register_forward_hook(
                functools.partial(_post_forward_hook, state, m)))
        for u, ps in enumerate(reg_params):
            for i, (_, p) in enumerate(ps):
                if p.requires_grad:
                    state._hook(u, i, p)
                saved.append((p, p.data))
                p.data = state.placeholder[p.dtype]  # the values live in shardd now
                p._shard_wrapped = True
        state.opt = _make_optimizer(state, opt, reg_params)
        if load or ctx.resumed:  # the checkpoint's (the paused job's) hyperparameters, as
            # torch's load_state_dict sets them
            for g, pg in enumerate(state.opt.param_groups):
                h = ctx.group_hparams(g)
                pg["lr"], pg["weight_decay"] = h["lr"], h["weight_decay"]
                if opt.name in _ADAM_LIKE:
                    pg["betas"], pg["eps"] = h["betas"], h["eps"]
                else:
                    pg["momentum"] = h["momentum"]
        saved_torch = _read_torch_json(load, ctx.start_step) if load else None
        if saved_torch is not None:  # the lr as it was at the save, and what schedulers keep
            # in the groups (initial_lr: a scheduler built with last_epoch resumes from it)
            if len(saved_torch["param_groups"]) != len(state.opt.param_groups):
                raise ValueError(f"shard.torch.wrap: the checkpoint has "
                                 f"{len(saved_torch['param_groups'])} param groups, the optimizer "
                                 f"{len(state.opt.param_groups)}")
            for pg, sg in zip(state.opt.param_groups, saved_torch["param_groups"]):
                for k, v in sg.items():
                    if k == "lr" or k not in pg:
                        pg[k] = tuple(v) if isinstance(v, list) else v
            state.saved_scaler = saved_torch.get("grad_scaler")
    except BaseException:  # no hooks left behind, the values back, the job left
        for h in state.handles:
            h.remove()
        for p, d in saved:
            p.data = d
            p.__dict__.pop("_shard_wrapped", None)
        ctx.detach()
        raise
    model._shard_state = state
    _patch_modules(model)
    _patch_clip()
    _guard_steps()
    _current = state
    return model


def _make_optimizer(state, opt, reg_params):
    """The ShardOptimizer of a wrapped model. Built from a torch optimizer, it shares that one's
    param_groups (a scheduler on either moves both), and the torch optimizer's step() becomes
    its step."""
    if opt.torch_opt is not None:
        groups = [{"params": list(g["params"])} for g in opt.torch_opt.param_groups]
    else:
        groups = [dict(g, params=[]) for g in opt.groups]
        for ps in reg_params:
            for _, p in ps:
                groups[opt.group_of.get(id(p), 0)]["params"].append(p)
        empty = [i for i, g in enumerate(groups) if not g["params"]]
        if empty:
            raise ValueError(f"shard.torch.wrap: param_groups[{empty[0]}] has no parameter")
    so = ShardOptimizer(state, groups, dict(opt.groups[0]))
    if opt.torch_opt is not None:
        so.param_groups = opt.torch_opt.param_groups
        so.defaults = opt.torch_opt.defaults

        def step(self, closure=None, grad_scaler=None):
            if hasattr(self, "_step_count"):  # a scheduler counts the steps
                self._step_count += 1
            if grad_scaler is not None:  # the scaler's found_inf is this optimizer's
                loss = None
                if closure is not None:
                    with torch.enable_grad():
                        loss = closure()
                norm = state.amp_step(self, grad_scaler)
                return norm if closure is None else loss
            return so.step(closure)

        step._with_counter = True  # what torch's schedulers mark a counted step() with
        opt.torch_opt.step = types.MethodType(step, opt.torch_opt)
        opt.torch_opt._step_supports_amp_scaling = True
        opt.torch_opt.state_dict = so.state_dict
        opt.torch_opt.load_state_dict = so.load_state_dict
        opt.torch_opt._shard_translated = True
    return so


def optimizer(model=None):
    """The torch.optim.Optimizer of a wrapped model: param_groups as registered (or the torch
    optimizer's own), whose lr, weight_decay, betas, eps and momentum each step() sends to
    shardd, so torch.optim.lr_scheduler schedulers work on it unchanged; step() returns the
    gradient norm; zero_grad() is accepted."""
    return _state_of(model).opt


def _full_state_dict_of(model, within, module, destination=None, prefix="", keep_vars=False):
    """state_dict() of a wrapped model or of one of its submodules (its names below within, a
    prefix of the model's names): the full tensors, as FSDP's full state dict. Inside
    full_state_dict, torch's recursion into the submodules runs as torch's own."""
    if getattr(_reading, "active", False):
        return torch.nn.Module.state_dict(module, destination=destination, prefix=prefix,
                                          keep_vars=keep_vars)
    out = full_state_dict(model)
    if destination is None:
        import collections
        destination = collections.OrderedDict()
    for k, v in out.items():
        if k.startswith(within):
            destination[prefix + k[len(within):]] = v
    return destination


def _write(st, t, what, value):
    """tensor t's values (any tensor of its elements) as what, through shard_write's fp32 copy in
    host memory"""
    v = value.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1)
    st.ctx.write(t, what, v.data_ptr(), v.numel())


def _params(st):
    """{id(param): (its tensor index in the job, its shape)} of every registered parameter"""
    return {id(p): (st.ctx.units[u]["tensors"][i], torch.Size(st.shapes[u][i]))
            for u, ps in enumerate(st.params) for i, (_, p) in enumerate(ps)}


def _load_state_dict_of(model, within, module, state_dict, strict=True, assign=False):
    """torch's Module.load_state_dict on a wrapped model (or a module in it, its names below
    within): parameters are written into shardd (masters and weights: every rank calls it with
    the same dict between the same two steps, each writing its own shards, as torch's on every
    rank of a DDP job), buffers copied in place; strict's missing and unexpected keys and size
    mismatches as torch reports them (then nothing is written). A tied parameter takes the last
    of its names the dict has, as torch's copies in order. assign is taken as a copy (the
    parameters are shardd's). Returns torch's _IncompatibleKeys."""
    del assign
    from torch.nn.modules.module import _IncompatibleKeys
    st = _state_of(model)
    if not isinstance(state_dict, collections.abc.Mapping):
        raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
    _reading.active = True  # torch's own names of the module: parameters and buffers
    try:
        mine = torch.nn.Module.state_dict(module, keep_vars=True)
    finally:
        _reading.active = False
    reg = _params(st)
    missing = [k for k in mine if k not in state_dict]
    unexpected = [k for k in state_dict if k not in mine]
    errors, params, buffers = [], {}, []
    for k, t in mine.items():
        if k not in state_dict:
            continue
        v = state_dict[k]
        if not isinstance(v, torch.Tensor):
            errors.append(f'While copying the parameter named "{k}", expected torch.Tensor or '
                          f'Tensor-like object from checkpoint but received {type(v)}')
            continue
        shape = reg[id(t)][1] if id(t) in reg else t.shape
        if tuple(v.shape) != tuple(shape):
            errors.append(f"size mismatch for {k}: copying a param with shape {v.shape} from "
                          f"checkpoint, the shape in current model is {torch.Size(shape)}.")
            continue
        if id(t) in reg:
            params[id(t)] = v  # (in the module's order: a tied one's last name wins)
        else:
            buffers.append((t, v))
    if strict:
        if unexpected:
            errors.insert(0, "Unexpected key(s) in state_dict: {}. ".format(
                ", ".join(f'"{k}"' for k in unexpected)))
        if missing:
            errors.insert(0, "Missing key(s) in state_dict: {}. ".format(
                ", ".join(f'"{k}"' for k in missing)))
    if errors:
        raise RuntimeError("Error(s) in loading state_dict for {} (nothing was loaded into "
                           "shardd):\n\t{}".format(module.__class__.__name__, "\n\t".join(errors)))
    with torch.no_grad():
        for t, v in buffers:
            t.copy_(v)
        for pid, v in params.items():
            _write(st, reg[pid][0], 0, v)
    st.ctx.write_done()  # (every rank, also one with nothing to write)
    return _IncompatibleKeys(missing, unexpected)


def _read_unit(st, u, what):
    """unit u's fp32 master weights (what 0) or optimizer state what, gathered from the job's
    nodes (this rank alone): a flat fp32 tensor in host memory"""
    buf = torch.empty(st.ctx.units[u]["numel"], dtype=torch.float32)
    st.ctx.read(u, what, buf.data_ptr())
    return buf


def _per_param(st, whats):
    """{id(param): ({what: its values (own tensors, its shape)}, param)} of every state in whats,
    read unit by unit (one unit's buffer at a time)"""
    out = {}
    for u, ps in enumerate(st.params):
        for what in whats:
            buf = _read_unit(st, u, what)
            for i, (_, p) in enumerate(ps):
                ti = st.ctx.tensors[st.ctx.units[u]["tensors"][i]]
                v = buf[ti["offset"]:ti["offset"] + ti["numel"]].view(st.shapes[u][i]).clone()
                out.setdefault(id(p), ({}, p))[0][what] = v
    return out


def _optimizer_state(st, so):
    """ShardOptimizer.state_dict: torch's layout"""
    names = _state_names(st)
    step_type = st.trainer.step_type if st.trainer is not None else (
        ("tensor", torch.float32) if st.kind in _ADAM_LIKE else None)
    reg = _params(st)
    values = _per_param(st, sorted(set(names.values())))
    state, groups, k = {}, [], 0
    for g in so.param_groups:
        ids = []
        for p in g["params"]:
            steps = st.ctx.read_steps(reg[id(p)][0])
            if steps > 0:  # (never stepped: no state, as torch's)
                entry = {}
                if step_type == "int":
                    entry["step"] = steps
                elif step_type is not None:
                    entry["step"] = torch.tensor(float(steps), dtype=step_type[1])
                for name, what in names.items():
                    if name != "momentum_buffer" or g.get("momentum", 0) != 0:
                        entry[name] = values[id(p)][0][what].to(p.dtype)
                state[k] = entry
            ids.append(k)
            k += 1
        groups.append(dict({kk: v for kk, v in g.items() if kk != "params"}, params=ids))
    return {"state": state, "param_groups": groups}


def _state_names(st):
    """{torch's name of each per-parameter state: shardd's state index} of the job's optimizer"""
    return st.trainer_names if st.trainer is not None else _TORCH_STATE[st.kind]


def _load_optimizer_state(st, so, state_dict):
    """ShardOptimizer.load_state_dict: torch's checks and layout"""
    if not isinstance(state_dict, collections.abc.Mapping) or "param_groups" not in state_dict \
            or "state" not in state_dict:
        raise ValueError("optimizer.load_state_dict: a torch optimizer's state_dict has 'state' "
                         "and 'param_groups'")
    groups, saved = so.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(sg["params"]) for g, sg in zip(groups, saved)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the "
                         "size of optimizer's group")
    names = _state_names(st)
    same = _TORCH_SAME.get(st.kind.replace("-nesterov", ""), {})
    for gi, sg in enumerate(saved):
        for k, want in same.items():
            if k in sg and sg[k] != want and not (want is None and sg[k] is False):
                raise ValueError(f"optimizer.load_state_dict: param_groups[{gi}] has {k}="
                                 f"{sg[k]}, which shardd's {st.kind} does not run")
    # a saved group's params name its parameters in order (torch's ints, or the FQNs
    # torch.distributed.checkpoint's set_optimizer_state_dict passes), the state is keyed alike
    by_index = {}
    for g, sg in zip(groups, saved):
        by_index.update(zip(sg["params"], g["params"]))
    states = {}
    for key, ps in state_dict["state"].items():
        k = key if key in by_index else (int(key) if isinstance(key, str) and key.isdigit()
                                         else str(key))
        if k not in by_index:
            raise ValueError(f"optimizer.load_state_dict: state of parameter {key!r}, which no "
                             "param group lists")
        states[k] = ps
    for key, ps in states.items():
        for name in ps:
            if name not in names and name != "step":
                raise ValueError(f"optimizer.load_state_dict: parameter {key}'s state '{name}' "
                                 f"is not {st.kind}'s (it keeps {', '.join(names)}, step)")
    reg = _params(st)
    with torch.no_grad():
        for k, p in by_index.items():
            ps = states.get(k, {})
            t, shape = reg[id(p)]
            for name, what in names.items():
                v = ps.get(name)
                if v is None:
                    v = torch.zeros(shape)
                elif tuple(v.shape) != tuple(shape):
                    raise ValueError(f"optimizer.load_state_dict: parameter {k}'s {name} has "
                                     f"shape {tuple(v.shape)}, the parameter {tuple(shape)}")
                _write(st, t, what, v)
            # (SGD keeps no step: a parameter with a momentum buffer counts as stepped, so that
            # state_dict returns it again; so a trainer optimizer's without one)
            step = ps.get("step", 1 if any(ps.get(n) is not None for n in names) else 0)
            st.ctx.write_steps(t, int(step.item() if torch.is_tensor(step) else step))
    st.ctx.write_done()
    st.trainer_steps = None  # (a trainer optimizer reads the new counts before its next step)
    for g, sg in zip(groups, saved):
        for k, v in sg.items():
            if k != "params":
                g[k] = tuple(v) if isinstance(v, list) else v


def _patch_modules(model):
    """model and each module in it that holds wrapped parameters: state_dict() returns the full
    tensors (under the module's own names), load_state_dict() writes them into shardd (torch's
    own would fail on the placeholders' shapes). Instance attributes, as unwrap removes them;
    functools.partial, so that pickling reaches _State.__reduce_ex__'s message."""
    for name, m in model.named_modules():
        if m is not model and not any(getattr(p, "_shard_wrapped", False)
                                      for p in m.parameters()):
            continue
        m.state_dict = functools.partial(_full_state_dict_of, model, name + "." if name else "",
                                         m)
        m.load_state_dict = functools.partial(_load_state_dict_of, model,
                                              name + "." if name else "", m)
    # FSDP2's accumulation call on the model (fully_shard's modules have it): the last
    # micro-step's backward then sends each unit across nodes as it is pushed
    model.set_requires_gradient_sync = functools.partial(_set_requires_gradient_sync, model)


def _set_requires_gradient_sync(model, requires_gradient_sync, *, recurse=True):
    """FSDP2's FSDPModule.set_requires_gradient_sync on a wrapped model (_State's)."""
    del recurse  # (one job: the whole model)
    _state_of(model).set_requires_gradient_sync(bool(requires_gradient_sync))


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


def save(directory, model=None, grad_scaler=None):
    """Save a checkpoint of the wrapped model's job into directory/step-NNNNNNNN and point
    directory/LATEST at it; returns the step saved. Every rank calls it after the same step, with
    the same directory (one every node sees). It holds one copy of the fp32 master weights, the
    optimizer's moments and step counts and the param groups' hyperparameters, in global
    coordinates: wrap(load=directory) resumes it under any world and plan, and
    shard.checkpoint.load_state_dict reads it without a daemon. Module buffers are not in it
    (save them with torch.save). Rank 0 adds torch.json: the optimizer's param_groups as they
    are now (lr, and what a scheduler keeps there: initial_lr) and the other names of tied
    parameters. Save after scheduler.step(), and resume a scheduler by building it with
    last_epoch=shard.torch.start_step(model) - 1 (docs/pytorch.md). With a torch.amp.GradScaler
    (grad_scaler, else the one the last step came from; after scaler.update()), its state_dict
    (the scale, the growth tracker, the factors) goes into torch.json too:
    scaler.load_state_dict(shard.torch.grad_scaler_state_dict(model)) resumes it."""
    st = _state_of(model)
    if grad_scaler is None:
        grad_scaler = st.grad_scaler
    st._push_partial()
    step = st.ctx.save(directory)
    if st.rank == 0:
        _write_torch_json(os.path.join(os.fspath(directory), f"step-{step:08d}"), st,
                          grad_scaler)
    return step


# What torch knows that the daemon's checkpoint does not, beside it in TORCH_JSON: every param
# group's entries that are plain values (the lr at save time, and what schedulers add: initial_lr,
# max_lr, ...), and the other names of tied parameters (the checkpoint has each tensor once).
TORCH_JSON = _checkpoint.TORCH_JSON


def _scaler_state(scaler):
    """a GradScaler's state_dict as plain numbers (empty where it is disabled, as torch's)"""
    return {k: (v.item() if isinstance(v, torch.Tensor) else v)
            for k, v in scaler.state_dict().items()}


def _write_torch_json(path, st, grad_scaler=None):
    groups = [{k: v for k, v in g.items() if k != "params" and
               isinstance(v, (int, float, str, bool, type(None), tuple, list))}
              for g in st.opt.param_groups]
    doc = {"format": "shard.torch", "version": 1, "param_groups": groups,
           "aliases": st.aliases}
    if grad_scaler is not None:
        doc["grad_scaler"] = _scaler_state(grad_scaler)
    if st.trainer is not None:  # torch's names of a trainer optimizer's states (shard.dcp)
        doc["trainer_states"] = list(st.trainer.names)
        doc["trainer_step"] = _step_name(st.trainer.step_type)
    tmp = os.path.join(path, f".{TORCH_JSON}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, TORCH_JSON))


def _read_torch_json(load, step):
    """the TORCH_JSON of the checkpoint wrap(load=) started from, or None"""
    path = os.fspath(load)
    if not os.path.exists(os.path.join(path, "MANIFEST")):
        path = os.path.join(path, f"step-{step:08d}")
    return _checkpoint.torch_json(path)


def grad_scaler_state_dict(model=None):
    """The torch.amp.GradScaler state_dict saved with the checkpoint the wrapped model's job
    started from (wrap(load=...)), for scaler.load_state_dict; None where it holds none."""
    sd = _state_of(model).saved_scaler
    return dict(sd) if sd is not None else None


def start_step(model=None):
    """The steps the wrapped model's job had taken when it was wrapped: the checkpoint's step with
    wrap(load=...), else 0 (the first step to run; a learning-rate scheduler resumes from it)."""
    return _state_of(model).ctx.start_step


def full_state_dict(model=None, device=None):
    """The full current parameters and the model's buffers as ordinary tensors, under every name
    torch's state_dict() gives them (a tied parameter under each of its names), in its order.
    Any rank may call it alone (if rank == 0: torch.save(...)). device: where the tensors are
    (None: the model's device, as torch's state_dict(); "cpu": copies in host memory). Under a
    plan that gathers int8 weights (zeropp, topo, ,qw, ,qsec) the parameters are the fp32
    master weights (rounded to their dtype), read from the job's nodes, not the int8 blocks."""
    st = _state_of(model)
    to = torch.device(device) if device is not None else None
    values = {}
    if _quantized_weights(st.plan):  # the forward's weights are int8 blocks: the fp32 masters
        for pid, (v, p) in _per_param(st, [0]).items():
            values[pid] = v[0].to(dtype=p.dtype, device=to if to is not None else p.device)
    for u, ps in enumerate(st.params if not values else ()):
        held = st.refs[u] > 0
        if not held:  # outside the schedule: rank 0 alone may save
            st._attach_views(u, *st.ctx.fetch_aside(u))
        try:
            for _, p in ps:
                values[id(p)] = (p.detach().clone() if to is None or to == p.device else
                                 p.detach().to(to))
        finally:
            if not held:  # the copies read the slot: the stream signals the release after them
                st.mem.release(st.ctx, u, True)
                for _, p in ps:
                    p.data = st.placeholder[p.dtype]
    out = {}
    _reading.active = True  # the submodules' state_dict (_patch_modules) are torch's here
    try:
        names = torch.nn.Module.state_dict(st.model, keep_vars=True)
    finally:
        _reading.active = False
    for name, t in names.items():
        if id(t) in values:
            out[name] = values[id(t)]
        else:
            out[name] = t.detach().clone() if to is None else t.detach().to(to, copy=True)
    return out


def _quantized_weights(plan):
    """does plan gather int8 weights (zeropp, topo, ,qw, ,qsec)?"""
    base, *opts = str(plan).split(",")
    return base in ("zeropp", "topo") or "qw" in opts or "qsec" in opts


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
    for m in st.model.modules():
        m.__dict__.pop("state_dict", None)
        m.__dict__.pop("load_state_dict", None)
    st.model.__dict__.pop("set_requires_gradient_sync", None)
    del st.model._shard_state
