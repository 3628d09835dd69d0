"""PyTorch Distributed Checkpoint (DCP) directories to and from shardd checkpoints, without a daemon.

FSDP2 users save with torch.distributed.checkpoint: a directory of a pickled `.metadata` and
per-rank `__R_0.distcp` files of torch.save'd chunks, under the keys of
torch.distributed.checkpoint.state_dict.get_state_dict:

    {"model": {fqn: tensor}, "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}},
                                      "param_groups": [{"lr", ..., "params": [fqn, ...]}]}}

  from_shardd(checkpoint, out)            a shardd checkpoint (shard.torch.save, shard_save) as
                                          such a DCP directory: FSDP2 dcp.load's it at any world
                                          and mesh, then set_state_dict (docs/pytorch.md, FSDP2)
  to_shardd(dcp_dir, out, model, opt)     a DCP directory (FSDP2's dcp.save, any world) as a
                                          shardd checkpoint for wrap(model, optimizer=opt,
                                          load=out): the same tensors, order and param groups
                                          as that wrap registers
  read(dcp_dir)                           the DCP checkpoint's full tensors and values, {path: x}

    python -m shard.dcp from-shardd CHECKPOINT OUT
    python -m shard.dcp info DCP_DIR

Writing goes through DCP's own writer (torch.distributed.checkpoint.save, no process group), so
the files are DCP's format exactly and hold only what DCP writes. Reading does not run DCP's
pickle.load: `.metadata` is unpickled by an unpickler that builds DCP's metadata classes, torch
sizes, dtypes and layouts and nothing else (a checkpoint naming any other class is refused
before anything runs), the chunks with torch.load(weights_only=True), and every tensor must be
covered by its chunks exactly once. The model's module buffers are not in a shardd checkpoint:
from_shardd takes them (buffers=), to_shardd returns the checkpoint's (apply them with
model.load_state_dict(..., strict=False) before wrap).
"""
import io
import json
import os
import pickle
import shutil

from . import _c, _lib
from . import checkpoint as _checkpoint

__all__ = ["DcpError", "read", "from_shardd", "to_shardd", "MODEL", "OPTIM"]

MODEL, OPTIM = "model", "optim"  # get_state_dict's keys, as FSDP2's tutorials save them
_OPTIM_KEYS = (OPTIM, "optimizer")  # torchtitan's name of the optimizer's part
_META = ".metadata"
_MD = "torch.distributed.checkpoint.metadata"


class DcpError(ValueError):
    """A DCP directory that is not one, is corrupt, or does not fit the model"""


def _enum_member(cls, name):
    """builtins.getattr as DCP's metadata uses it (a member of its memory-format enum), and
    nothing else: a pickle's getattr could otherwise reach any method of any allowed object"""
    import enum
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
        return cls.__members__[name]
    raise DcpError(f"the metadata asks for attribute '{name}' of {cls!r}: refused")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch.Size, dtypes, layouts, memory formats, paths: nothing else"""

    def find_class(self, module, name):
        import torch
        if module == "builtins" and name == "getattr":
            return _enum_member
        ok = ((module == _MD and name.lstrip("_")[:1].isupper()) or
              (module, name) in {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                 ("torch", "Size"), ("torch.serialization", "_get_layout"),
                                 ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                                 ("collections", "OrderedDict")} or
              (module == "torch" and isinstance(getattr(torch, name, None),
                                                (torch.dtype, torch.memory_format))))
        if not ok:
            raise DcpError(f"its {_META} names {module}.{name}, which DCP's metadata never "
                           "holds: refused without loading it (not a DCP checkpoint of torch's "
                           "FileSystemWriter, or a crafted one)")
        return super().find_class(module, name)


class _Dcp:
    """An opened DCP directory: metadata, and full tensors and values by key"""

    def __init__(self, path):
        self.path = os.fspath(path)
        meta = os.path.join(self.path, _META)
        if not os.path.isfile(meta):
            if any(os.path.exists(os.path.join(self.path, n)) for n in ("MANIFEST", "LATEST")):
                raise DcpError(f"{self.path}: a shardd checkpoint, not a DCP directory (load it "
                               "with shard.torch.wrap(load=...) or shard.checkpoint)")
            raise DcpError(f"{self.path}: not a torch.distributed.checkpoint directory (no {_META})")
        try:
            with open(meta, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except DcpError as e:
            raise DcpError(f"{meta}: {e}") from None
        except Exception as e:  # truncated or not a pickle
            raise DcpError(f"{meta}: not DCP metadata ({type(e).__name__}: {e})") from None
        if type(md).__name__ != "Metadata" or not hasattr(md, "state_dict_metadata"):
            raise DcpError(f"{meta}: holds a {type(md).__name__}, not DCP's Metadata")
        self.md = md
        self.files = {}
        # planner_data: each flattened key's path in the saved nested dict
        self.paths = {k: tuple(v) if isinstance(v, (tuple, list)) else (k,)
                      for k, v in (md.planner_data or {}).items()}
        for k in md.state_dict_metadata:
            self.paths.setdefault(k, (k,))

    def close(self):
        for f in self.files.values():
            f.close()

    def _bytes(self, key, index, what):
        info = self.md.storage_data.get(index)
        if info is None:
            raise DcpError(f"{self.path}: {what} of '{key}' has no storage entry in {_META}")
        if getattr(info, "transform_descriptors", None):
            raise DcpError(f"{self.path}: '{key}' was written with DCP extensions "
                           f"{list(info.transform_descriptors)}, which this reader does not "
                           "apply (save without extensions)")
        name = info.relative_path
        if not isinstance(name, str) or "/" in name or name.startswith(".") or not name:
            raise DcpError(f"{self.path}: '{key}' is stored in '{name}', not a file of the "
                           "checkpoint's directory")
        f = self.files.get(name)
        if f is None:
            try:
                f = self.files[name] = open(os.path.join(self.path, name), "rb")
            except OSError as e:
                raise DcpError(f"{self.path}: '{key}' is in {name}: {e.strerror}") from None
        f.seek(info.offset)
        data = f.read(info.length)
        if len(data) != info.length or info.offset < 0:
            raise DcpError(f"{self.path}/{name}: {what} of '{key}' [{info.offset}, "
                           f"+{info.length}) ends past the file's end (truncated)")
        return data

    def _load(self, data, key, name):
        import torch
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            raise DcpError(f"{self.path}: '{key}' in {name} is not data torch.load can read "
                           f"with weights_only=True (corrupt?): {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}") from None

    def get(self, key):
        """the full tensor (every chunk put in place) or the value saved under key"""
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex
        m = self.md.state_dict_metadata[key]
        if not hasattr(m, "chunks"):  # bytes: a value DCP torch.save'd
            idx = MetadataIndex(key)
            info = self.md.storage_data.get(idx)
            return self._load(self._bytes(key, idx, "the value"), key,
                              info.relative_path if info else "?")
        out = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        seen = torch.zeros(tuple(m.size), dtype=torch.bool)
        for i, ch in enumerate(m.chunks):
            idx = MetadataIndex(key, ch.offsets, i)
            t = self._load(self._bytes(key, idx, f"chunk {i}"), key,
                           self.md.storage_data[idx].relative_path)
            if (not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(ch.sizes) or
                    len(ch.offsets) != out.dim()):
                raise DcpError(f"{self.path}: chunk {i} of '{key}' holds "
                               f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}, "
                               f"the metadata says {tuple(ch.sizes)} at {tuple(ch.offsets)}")
            where = tuple(slice(o, o + s) for o, s in zip(ch.offsets, ch.sizes))
            if any(o < 0 or o + s > d for o, s, d in zip(ch.offsets, ch.sizes, m.size)):
                raise DcpError(f"{self.path}: chunk {i} of '{key}' at {tuple(ch.offsets)} size "
                               f"{tuple(ch.sizes)} lies outside {tuple(m.size)}")
            if seen[where].any():
                raise DcpError(f"{self.path}: chunks of '{key}' overlap at chunk {i}")
            seen[where] = True
            out[where] = t.to(out.dtype)
        if not bool(seen.all()):
            raise DcpError(f"{self.path}: the chunks of '{key}' leave "
                           f"{int((~seen).sum())} of its {seen.numel()} elements missing")
        return out


def read(dcp_dir):
    """{path in the saved nested dict (a tuple, e.g. ("model", "fc.weight")): full tensor or
    value} of a DCP directory, each tensor assembled from its chunks (any world that saved it)"""
    d = _Dcp(dcp_dir)
    try:
        return {d.paths[k]: d.get(k) for k in d.md.state_dict_metadata}
    finally:
        d.close()


# ---- shardd -> DCP

def _layout(kind):
    """the optimizer whose states kind keeps: "adamw" (AdamW, Adam: step, exp_avg, exp_avg_sq),
    "sgd" (SGD, with or without Nesterov momentum: momentum_buffer), or "trainer" (any other,
    run in the trainers: the states shard.torch named)"""
    if kind.startswith("trainer"):
        return "trainer"
    return "adamw" if kind in ("adamw", "adam") else "sgd"


def _spec(kind, names=None, step=None):
    """(torch's names of kind's per-parameter states in the checkpoint's order after the master,
    the checkpoint's names of them, how torch keeps the step: "tensor", "int" or None);
    a trainer optimizer's names and step type come from shard.torch (names, step)"""
    layout = _layout(kind)
    if layout == "adamw":
        return ["exp_avg", "exp_avg_sq"], ["exp_avg", "exp_avg_sq"], "tensor"
    if layout == "sgd":
        return ["momentum_buffer"], ["momentum_buffer"], None
    if names is None:
        raise DcpError(f"the optimizer ({kind}) ran in the trainers and its states' torch names "
                       "are not known: a checkpoint of shard.torch.save names them")
    return list(names), [f"state{i + 1}" for i in range(len(names))], step


def _torch_group(kind, g):
    """torch's param group entries of a MANIFEST group"""
    if _layout(kind) == "trainer":
        return {"lr": g["lr"], "weight_decay": g["weight_decay"]}
    if _layout(kind) == "adamw":
        return {"lr": g["lr"], "betas": (g["beta1"], g["beta2"]), "eps": g["eps"],
                "weight_decay": g["weight_decay"]}
    return {"lr": g["lr"], "momentum": g["momentum"], "weight_decay": g["weight_decay"],
            "dampening": 0.0, "nesterov": kind == "sgd-nesterov"}


def from_shardd(checkpoint, out, buffers=None):
    """Write the shardd checkpoint (a checkpoint, or a directory of them: its LATEST) into the
    new directory out as a DCP checkpoint with get_state_dict's keys: "model" (every parameter
    under every name model.state_dict() gives it, tied ones too, and buffers=, a {name: tensor}
    of the module buffers the training saved itself) and "optim" (torch's optimizer state per
    parameter name: AdamW's step, exp_avg, exp_avg_sq; SGD's momentum_buffer; param_groups with
    what shard.torch.save kept of them, initial_lr included). Returns the step."""
    import torch
    import torch.distributed.checkpoint as dcp
    man = _checkpoint.info(checkpoint)
    sd = _checkpoint.load_state_dict(man["path"], optimizer_states=True)
    extra = _checkpoint.torch_json(man["path"]) or {}
    kind = man["optimizer"]["kind"]
    tensors = man["tensors"]
    model = {}
    for t in tensors:
        model[t["name"]] = sd[t["name"]]
    for alias, name in extra.get("aliases", {}).items():
        model[alias] = sd[name]
    for k, v in (buffers or {}).items():
        if k in model:
            raise DcpError(f"from_shardd: buffer '{k}' is a parameter of the checkpoint")
        model[k] = v.detach().cpu()
    torch_names, ck_names, step_type = _spec(kind, extra.get("trainer_states"),
                                             extra.get("trainer_step"))
    state = {}
    for t in tensors:
        opt = sd["optimizer"][t["name"]]
        if t["steps"] == 0:  # torch makes a parameter's state at its first step
            continue
        if _layout(kind) == "sgd" and man["groups"][t["group"]]["momentum"] == 0:
            continue  # (torch's SGD without momentum keeps none)
        entry = {tn: opt[cn] for tn, cn in zip(torch_names, ck_names)}
        if step_type == "tensor":
            entry["step"] = torch.tensor(float(t["steps"]))
        elif step_type == "int":
            entry["step"] = int(t["steps"])
        state[t["name"]] = entry
    saved = extra.get("param_groups") or []
    groups = []
    for g, mg in enumerate(man["groups"]):
        pg = _torch_group(kind, mg)
        if g < len(saved):  # shard.torch.save's copy: torch's own entries (initial_lr, ...)
            pg.update({k: tuple(v) if k == "betas" else v for k, v in saved[g].items()})
        pg["params"] = [t["name"] for t in tensors if t["group"] == g]
        groups.append(pg)
    if os.path.exists(out) and os.listdir(out):
        raise DcpError(f"from_shardd: {out} exists and is not empty")
    dcp.save({MODEL: model, OPTIM: {"state": state, "param_groups": groups}},
             storage_writer=dcp.FileSystemWriter(os.fspath(out)), no_dist=True)
    return man["step"]


# ---- DCP -> shardd

def _parts(d):
    """(model {fqn: key}, optimizer state {(fqn, name): key}, param_groups {(i, entry): key})"""
    model, state, groups = {}, {}, {}
    for key, path in d.paths.items():
        if key not in d.md.state_dict_metadata:
            continue
        if len(path) == 2 and path[0] == MODEL:
            model[path[1]] = key
        elif len(path) == 4 and path[0] in _OPTIM_KEYS and path[1] == "state":
            state[(path[2], path[3])] = key
        elif len(path) == 4 and path[0] in _OPTIM_KEYS and path[1] == "param_groups":
            groups[(path[2], path[3])] = key
        elif len(path) == 3 and path[0] in _OPTIM_KEYS and path[1] == "param_groups":
            groups[(path[2], None)] = key  # a whole group saved as one value
    return model, state, groups


def _saved_groups(d, groups):
    """[{entry: value}] of the saved param_groups"""
    out = {}
    for (i, entry), key in groups.items():
        v = d.get(key)
        if entry is None:
            out.setdefault(i, {}).update(v)
        else:
            out.setdefault(i, {})[entry] = v
    return [out[i] for i in sorted(out)]


def _f32(t):
    return t.detach().to("cpu").float().contiguous().reshape(-1)


def _write_checkpoint(out, step, job, kind, max_grad_norm, groups, tensors, states, torch_doc,
                      names):
    """a shardd checkpoint (docs/checkpoints.md, Checkpoint format) of tensors [(name, shape,
    dtype, unit, group, steps)] with states {state: [flat fp32 tensor per tensor]} (names: the
    checkpoint's states, in order, "master" first) into out/step-NNNNNNNN, then out/LATEST
    naming it"""
    import torch
    os.makedirs(out, exist_ok=True)
    final = os.path.join(out, f"step-{step:08d}")
    tmp = os.path.join(out, f".step-{step:08d}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    extents, total, at = [], 0, 0
    chunk = 1 << 20  # elements per extent (SD_CKPT_EXTENT_ELEMS)
    with open(os.path.join(tmp, "data-0"), "wb") as f:
        for s in names:
            for ti, flat in enumerate(states[s]):
                for b in range(0, flat.numel(), chunk):
                    e = min(flat.numel(), b + chunk)
                    data = flat[b:e].numpy().astype("<f4").tobytes()
                    crc = _lib.shard_crc32c(0, _c.c_char_p(data), len(data))
                    f.write(data)
                    extents.append({"state": s, "tensor": ti, "range": [b, e], "file": "data-0",
                                    "offset": at, "crc32c": crc})
                    at += len(data)
                    total += len(data)
        f.flush()
        os.fsync(f.fileno())
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    man = {"format": "shardd-checkpoint", "version": 1, "job": job, "step": step, "plan": "dcp",
           "world": 1, "ranks_per_node": 1, "nodes": 1, "bytes": total, "states": names,
           "optimizer": {"kind": kind, "max_grad_norm": max_grad_norm}, "groups": groups,
           "files": ["data-0"],
           "tensors": [{"name": n, "shape": list(sh), "dtype": dtype[dt], "unit": u,
                        "group": g, "steps": st} for n, sh, dt, u, g, st in tensors],
           "extents": extents}
    for name, doc in (("MANIFEST", man), (_checkpoint.TORCH_JSON, torch_doc)):
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest = os.path.join(out, f".LATEST.{os.getpid()}")
    with open(latest, "w") as f:
        f.write(f"step-{step:08d}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest, os.path.join(out, "LATEST"))
    return final


def to_shardd(dcp_dir, out, model, optimizer=None, units=None, job="dcp"):
    """Write the DCP checkpoint dcp_dir (get_state_dict's "model"/"optim" keys, from any world
    of FSDP2 or of torch's DCP) into out/step-NNNNNNNN as a shardd checkpoint that
    shard.torch.wrap(model, optimizer=optimizer, units=units, load=out) resumes, under any world
    and plan: the parameters' values, the optimizer's state (AdamW: step, exp_avg, exp_avg_sq;
    SGD: momentum_buffer) and the saved param groups' hyperparameters (lr, initial_lr, ...), as
    torch's load_state_dict would set them. model and optimizer are the ones the job will wrap
    (their values are not read, only names, shapes and groups). Returns {"step": the step,
    "path": the checkpoint written, "buffers": {name: tensor} of the checkpoint's model entries
    that are not parameters (module buffers)}."""
    from . import torch as _st
    reg = _st._registration(model, optimizer, units)
    kind = reg.opt.name
    layout = _layout(kind)
    trainer = reg.opt.trainer or (None, None)
    want, ck_names, step_type = _spec(kind, trainer[0], _st._step_name(trainer[1]))
    d = _Dcp(dcp_dir)
    try:
        mkeys, skeys, gkeys = _parts(d)
        if not mkeys:
            raise DcpError(f"{d.path}: no '{MODEL}.<name>' entries: not saved as "
                           "dcp.save({'model': ..., 'optim': ...}) with get_state_dict's keys")
        saved_groups = _saved_groups(d, gkeys)
        tensors, states = [], {s: [] for s in ["master"] + want}
        step = 0
        for t in reg.tensors:
            if t.name not in mkeys:
                raise DcpError(f"{d.path}: has no '{MODEL}.{t.name}', a parameter of the model")
            w = d.get(mkeys[t.name])
            shape = tuple(t.dims)
            if tuple(w.shape) != shape and not (w.dim() == 0 and shape == (1,)):
                raise DcpError(f"{d.path}: '{t.name}' has shape {tuple(w.shape)} in the "
                               f"checkpoint, {shape} in the model")
            states["master"].append(_f32(w))
            have = [n for n in want if (t.name, n) in skeys]
            steps = 0
            if have and len(have) != len(want):
                raise DcpError(f"{d.path}: the optimizer state of '{t.name}' has {have}, "
                               f"{kind} needs {list(want)}")
            for n in want:
                if n in have:
                    v = d.get(skeys[(t.name, n)])
                    if v.numel() != w.numel():
                        raise DcpError(f"{d.path}: {n} of '{t.name}' has {v.numel()} elements, "
                                       f"the parameter {w.numel()}")
                    states[n].append(_f32(v))
                else:  # never stepped (or frozen): torch has no state for it
                    states[n].append(_f32(w) * 0)
            if step_type is not None and have:
                if (t.name, "step") not in skeys:
                    raise DcpError(f"{d.path}: the optimizer state of '{t.name}' has no step")
                steps = int(float(d.get(skeys[(t.name, "step")])))
            bad = [n for (p, n) in skeys if p == t.name and n not in want and
                   (n != "step" or step_type is None)]
            if bad:
                raise DcpError(f"{d.path}: the optimizer state of '{t.name}' has entries "
                               f"{kind} does not keep: {bad} (it keeps {list(want)}"
                               f"{', step' if step_type else ''})")
            step = max(step, steps)
            tensors.append((t.name, shape, _st._TORCH[t.dtype], t.unit, t.group, steps))
        params = {p for p, _ in skeys}
        unknown = sorted(params - {t.name for t in reg.tensors})
        if unknown:
            raise DcpError(f"{d.path}: optimizer state for '{unknown[0]}', which the model "
                           "does not have as a parameter")
        buffers = {n: d.get(k) for n, k in mkeys.items()
                   if n not in {t.name for t in reg.tensors} and n not in
                   {a for a, p in _aliases(model).items()}}
    finally:
        d.close()
    groups, torch_groups = _groups_for(reg, saved_groups, kind, d.path)
    torch_doc = {"format": "shard.torch", "version": 1, "param_groups": torch_groups,
                 "aliases": _aliases(model)}
    if layout == "trainer":
        torch_doc["trainer_states"], torch_doc["trainer_step"] = list(want), step_type
    path = _write_checkpoint(os.fspath(out), step, job, kind, reg.opt.max_grad_norm, groups,
                             tensors, {c: states[w] for c, w in
                                       zip(["master"] + ck_names, ["master"] + want)},
                             torch_doc, ["master"] + ck_names)
    return {"step": step, "path": path, "buffers": buffers}


def _aliases(model):
    """{other name: first name} of tied parameters, as model.state_dict() has them"""
    import torch
    names = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    return {n: names[id(t)] for n, t in torch.nn.Module.state_dict(model, keep_vars=True).items()
            if id(t) in names and n != names[id(t)]}


def _groups_for(reg, saved, kind, path):
    """(MANIFEST groups, torch.json param_groups) of the job's groups, each from the saved group
    holding its parameters (torch's load_state_dict sets the saved hyperparameters), else the
    optimizer's own"""
    by_param = {}
    for i, g in enumerate(saved):
        for p in g.get("params", []):
            by_param[p] = i
    members = {}
    for t in reg.tensors:
        members.setdefault(t.group, []).append(t.name)
    groups, torch_groups = [], []
    for g, base in enumerate(reg.opt.groups):
        hp = dict(base)
        src = {by_param[n] for n in members.get(g, []) if n in by_param}
        if len(src) > 1:
            raise DcpError(f"{path}: the parameters of the optimizer's param group {g} are in "
                           f"the checkpoint's param groups {sorted(src)}: the groups differ")
        tg = {}
        if src:
            sg = saved[src.pop()]
            tg = {k: v for k, v in sg.items() if k != "params" and
                  isinstance(v, (int, float, str, bool, type(None), tuple, list))}
            for k in ("lr", "eps", "weight_decay", "momentum"):
                if k in sg:
                    hp[k] = float(sg[k])
            if "betas" in sg:
                hp["betas"] = tuple(float(b) for b in sg["betas"])
        betas = hp.get("betas", (0.9, 0.999))
        groups.append({"lr": hp["lr"], "beta1": betas[0], "beta2": betas[1],
                       "eps": hp.get("eps", 1e-8), "weight_decay": hp.get("weight_decay", 0.0),
                       "momentum": hp.get("momentum", 0.0)})
        torch_groups.append(tg)
    return groups, torch_groups


def _main(argv):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m shard.dcp", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("from-shardd", help="a shardd checkpoint as a DCP directory")
    f.add_argument("checkpoint")
    f.add_argument("out")
    i = sub.add_parser("info", help="the keys, shapes and dtypes of a DCP directory")
    i.add_argument("dcp_dir")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "from-shardd":
            step = from_shardd(a.checkpoint, a.out)
            print(f"step {step}: {a.out}")
        else:
            d = _Dcp(a.dcp_dir)
            for k, m in d.md.state_dict_metadata.items():
                size = tuple(m.size) if hasattr(m, "size") else "value"
                chunks = len(m.chunks) if hasattr(m, "chunks") else 1
                print(f"{'.'.join(map(str, d.paths[k]))}\t{size}\t{chunks} chunk(s)")
    except (DcpError, OSError, ValueError) as e:
        print(f"shard.dcp: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(_main(sys.argv[1:]))
