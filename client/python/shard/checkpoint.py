"""Read shardd checkpoints without a daemon (docs/checkpoints.md, Checkpoint format).

load_state_dict(directory) returns the full fp32 tensors of a checkpoint that shard_save or
shard.torch.save wrote, under whatever world and plan: for evaluation, export, or
model.load_state_dict of an unwrapped torch model. directory is a checkpoint, or a directory of
them (the one its LATEST names)."""
import json
import os

from . import _lib, _c

__all__ = ["info", "load_state_dict", "torch_json"]

# what shard.torch.save adds beside a checkpoint's MANIFEST (shard/torch.py)
TORCH_JSON = "torch.json"


def _resolve(directory):
    directory = os.fspath(directory)
    if os.path.exists(os.path.join(directory, "MANIFEST")):
        return directory
    latest = os.path.join(directory, "LATEST")
    if not os.path.exists(latest):
        raise FileNotFoundError(f"{directory}: neither a checkpoint (no MANIFEST) nor a "
                                "directory of them (no LATEST)")
    with open(latest) as f:
        name = f.readline().strip()
    if not name or name.startswith(".") or "/" in name:
        raise ValueError(f"{latest} does not name a checkpoint in its directory ('{name}')")
    return os.path.join(directory, name)


def info(directory):
    """The checkpoint's MANIFEST (a dict) with "path", the checkpoint's directory, added."""
    path = _resolve(directory)
    with open(os.path.join(path, "MANIFEST")) as f:
        man = json.load(f)
    if man.get("format") != "shardd-checkpoint" or man.get("version") != 1:
        raise ValueError(f"{path}/MANIFEST: not a shardd checkpoint of format version 1")
    man["path"] = path
    return man


def load_state_dict(directory, optimizer_states=False, verify=True, to_torch=True):
    """{tensor name: fp32 tensor of its registered shape} of the checkpoint's master weights;
    with a checkpoint of shard.torch.save, a tied parameter under each of its names (the same
    tensor), so that an unwrapped model's load_state_dict(sd) is strict.

    optimizer_states: also {"optimizer": {name: {"exp_avg": ..., "exp_avg_sq": ..., "step": n}}}
    (SGD: "momentum_buffer") and {"step": the checkpoint's step}. verify: check every extent's
    crc32c (a mismatch raises ValueError naming the file and the extent). to_torch: torch
    tensors (else bytearrays of little-endian fp32)."""
    man = info(directory)
    path = man["path"]
    tensors = man["tensors"]
    bufs = {}
    for st in man["states"]:
        if st != "master" and not optimizer_states:
            continue
        bufs[st] = [bytearray(4 * _numel(t["shape"])) for t in tensors]
    files = {}
    try:
        for i, x in enumerate(man["extents"]):
            if x["state"] not in bufs:
                continue
            b, e = x["range"]
            n = 4 * (e - b)
            f = files.get(x["file"])
            if f is None:
                f = files[x["file"]] = open(os.path.join(path, x["file"]), "rb")
            f.seek(x["offset"])
            data = f.read(n)
            if len(data) != n:
                raise ValueError(f"{path}/{x['file']}: extent {i} ends past the file's end")
            if verify:
                crc = _lib.shard_crc32c(0, _c.c_char_p(data), n)
                if crc != x["crc32c"]:
                    raise ValueError(f"extent {i} in {x['file']} is corrupt (crc32c {crc:#010x}, "
                                     f"the manifest says {x['crc32c']:#010x}): {x['state']} of "
                                     f"tensor '{tensors[x['tensor']]['name']}' [{b}, {e}) in "
                                     f"{path}")
            bufs[x["state"]][x["tensor"]][4 * b:4 * e] = data
    finally:
        for f in files.values():
            f.close()

    def out(buf, t):
        if not to_torch:
            return buf
        import torch
        return torch.frombuffer(buf, dtype=torch.float32).reshape(t["shape"]).clone()

    sd = {t["name"]: out(bufs["master"][i], t) for i, t in enumerate(tensors)}
    # shard.torch.save notes the other names of tied parameters: the same tensor under each,
    # as torch's state_dict() has it (a strict load_state_dict needs every key)
    extra = torch_json(path)
    for alias, name in (extra["aliases"] if extra else {}).items():
        if name in sd and alias not in sd:
            sd[alias] = sd[name]
    if optimizer_states:
        opt = {}
        for i, t in enumerate(tensors):
            opt[t["name"]] = {st: out(bufs[st][i], t) for st in man["states"] if st != "master"}
            opt[t["name"]]["step"] = t["steps"]
        sd["optimizer"] = opt
        sd["step"] = man["step"]
    return sd


def torch_json(path):
    """The TORCH_JSON shard.torch.save wrote into checkpoint `path` (param groups, aliases of tied
    parameters), or None where there is none (shard_save from C, shardctl checkpoint)."""
    try:
        with open(os.path.join(path, TORCH_JSON)) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    if doc.get("format") != "shard.torch" or doc.get("version") != 1:
        raise ValueError(f"{path}/{TORCH_JSON}: not a shard.torch file of version 1")
    return doc


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n
