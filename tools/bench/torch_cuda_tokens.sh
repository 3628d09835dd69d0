#!/bin/bash
# Issue 37's throughput target on one GPU: the GPT example (client/examples/train_gpt.py) through
# shardd at world 1 (one daemon, --backend cuda, the model on its GPU) against the same model in
# one process without shardd, in one run; prints both tokens/s and the ratio (target >= 0.8).
#   tools/bench/torch_cuda_tokens.sh BUILD_DIR [OUT_DIR] [-- train_gpt options]
# Default model: 12 layers of width 1024 (16 heads), sequences of 256, 16 a micro-batch,
# accumulation 2 (about 152M parameters: the GPU is busy), 12 steps, zero3, fp32.
# Writes OUT_DIR/torch_cuda_tokens.json: {"shardd_tokens_per_s", "single_tokens_per_s", "ratio",
# "params", "target"}. Exit 77 without CUDA in python3's torch or a daemon on cuda.
set -uo pipefail
build=$(cd "$1" && pwd)
out=${2:-$(mktemp -d)}
shift $(($# < 2 ? $# : 2))
[ "${1:-}" = "--" ] && shift
opts=("$@")
[ ${#opts[@]} -eq 0 ] && opts=(--layers 12 --width 1024 --heads 16 --seq 256 --batch 16
                              --accum 2 --steps 12 --plan zero3)
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    { echo "torch_cuda_tokens: skipped: python3's torch has no CUDA device"; exit 77; }
c=$(mktemp -d)
if ! bash "$root/tools/local-cluster.sh" start --nodes 1 --ranks-per-node 1 --dir "$c" \
        --shardd "$build/daemon/shardd" -- --backend cuda --log-level warn \
        >"$out/cluster.log" 2>&1; then
    echo "torch_cuda_tokens: skipped: shardd --backend cuda does not start: $(tail -2 "$out/cluster.log")"
    exit 77
fi
SHARD_LIBRARY="$build/client/libshard.so.0" python3 "$root/client/examples/train_gpt.py" \
    --launch --device cuda --cluster-dir "$c" --nodes 1 --ranks-per-node 1 --out "$out" \
    --quiet "${opts[@]}" >"$out/train.log" 2>&1
rc=$?
bash "$root/tools/local-cluster.sh" stop --dir "$c" >/dev/null 2>&1
rm -rf "$c"
[ $rc -eq 0 ] || { echo "torch_cuda_tokens: train_gpt failed:"; tail -20 "$out/train.log"; exit 1; }
python3 - "$out" "${opts[*]}" <<'PY'
import json, sys
out = sys.argv[1]
s = json.load(open(f"{out}/shardd-0.json"))
d = json.load(open(f"{out}/single-0.json"))
r = {"shardd_tokens_per_s": s["tokens_per_s"], "single_tokens_per_s": d["tokens_per_s"],
     "ratio": s["tokens_per_s"] / d["tokens_per_s"], "params": s.get("params", 0),
     "options": sys.argv[2], "target": 0.8}
json.dump(r, open(f"{out}/torch_cuda_tokens.json", "w"))
print(f"GPT ({r['params'] / 1e6:.0f}M parameters; {sys.argv[2]}) at world 1 on one GPU: "
      f"shardd {r['shardd_tokens_per_s']:.0f} tokens/s, one process without shardd "
      f"{r['single_tokens_per_s']:.0f} tokens/s: {r['ratio']:.3f} (target 0.8: "
      f"{'met' if r['ratio'] >= 0.8 else 'NOT met'})")
sys.exit(0 if r["ratio"] >= 0.8 else 1)
PY
