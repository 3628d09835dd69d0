#!/usr/bin/env bash
# Install what is missing, build, start an emulated cluster of shardd daemons on this machine,
# train the example MLP through it, and print what happened: progress, loss, bytes moved per
# link class next to the formulas, time; then load the run's last checkpoint under another plan,
# train on, and compare with a reader of the checkpoint files that does not use shardd.
# Then, where PyTorch 2.x is installed in shardd's venv (tools/torch-venv.sh; it offers to make it
# when it is not), train a small GPT through shardd on a 2-node x 2-rank cluster next to PyTorch
# DDP (gloo) and plot both loss curves. It builds into build/, the README's build directory.
# Usage: tools/demo.sh [--nodes N] [--ranks-per-node K] [--plan PLAN] [--steps S] [--netns]
#                      [--torch | --no-torch]   (make the PyTorch venv without asking / skip the GPT)
#                      [--build DIR]            (the binaries of a build tree: no install, no build)
set -euo pipefail
cd "$(dirname "$0")/.."
nodes=4 k=2 plan=mics:4 steps=20 accum=2 netns=() torch=ask build=
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) nodes=$2; shift 2 ;;
    --ranks-per-node) k=$2; shift 2 ;;
    --plan) plan=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --netns) netns=(--netns --inter-rate 1gbit); shift ;;
    --torch) torch=yes; shift ;;
    --no-torch) torch=no; shift ;;
    --build) build=$2; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -n "$build" ]; then
  B=$build
else
  tools/deps.sh >/dev/null
  echo "== building"
  cmake -S . -B build >/dev/null # the README's build line, so that neither builds twice
  cmake --build build -j"$(nproc)" >/dev/null
  B=build
fi
dir=$(mktemp -d /tmp/shardd-demo-XXXXXX)
cleanup() {
  tools/local-cluster.sh stop --dir "$dir" >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap cleanup EXIT
world=$((nodes * k))

# start_ranks JOB LOG DUMP OPTIONS...: the world's mlp_train ranks of JOB, rank r on node r / k,
# logs in $dir/LOG<r>.log, rank 0 dumping its parameters into DUMP; their pids in pids
start_ranks() {
  local job=$1 log=$2 dump=$3 r
  shift 3
  for r in $(seq 0 $((world - 1))); do
    local own=()
    [ "$r" = 0 ] && own=(--dump-params "$dump")
    : >"$dir/$log$r.log" # there before the background rank opens it: tail -f follows it at once
    $B/client/examples/mlp_train --socket "$dir/node$((r / k))/shardd.sock" --job "$job" \
      --rank "$r" --world "$world" "${own[@]}" "$@" >"$dir/$log$r.log" 2>&1 &
    pids[$r]=$!
  done
}
# wait_ranks LOG: every rank exited 0, else its log and exit 1
wait_ranks() {
  local r
  for r in "${!pids[@]}"; do
    wait "${pids[$r]}" || { echo "rank $r failed:"; cat "$dir/$1$r.log"; exit 1; }
  done
}
# compare_dumps A B WHAT FAILURE: the max difference of two parameter dumps, printed after
# WHAT; exit with FAILURE beyond 1e-4 (fp32 sums in another order differ by about 1e-6)
compare_dumps() {
  python3 - "$@" <<'PY'
import struct, sys
pa, pb, what, failure = sys.argv[1:]
a = open(pa, 'rb').read(); b = open(pb, 'rb').read()
x = struct.unpack(f'{len(a)//4}f', a); y = struct.unpack(f'{len(b)//4}f', b)
d = max((abs(p - q) for p, q in zip(x, y)), default=float("inf"))
print(f"{what}: {len(x)} values, max |diff| {d:.3g}" + (" (bitwise identical)" if a == b else ""))
if len(a) != len(b) or not len(a) or d > 1e-4:
    sys.exit(failure)
PY
}

echo "== starting $nodes shardd daemons x $k ranks (libfabric tcp;ofi_rxm on loopback${netns:+, network namespaces with 1 Gbit/s links})"
tools/local-cluster.sh start --nodes "$nodes" --ranks-per-node "$k" --dir "$dir" \
  --shardd "$B/daemon/shardd" "${netns[@]}" -- --log-level warn
$B/tools/shardctl --socket "$dir/node0/shardd.sock" topology | sed 's/^/  /'

echo "== training a 4-layer MLP (327k parameters) on $world ranks, plan $plan, $steps steps, accum $accum"
t0=$(date +%s.%N)
start_ranks demo rank "$dir/params.bin" --plan "$plan" --steps "$steps" --accum "$accum" \
  --save-every $(((steps + 1) / 2)) --save-dir "$dir/ck"
tail -n +1 -f "$dir/rank0.log" --pid "${pids[0]}" 2>/dev/null | sed 's/^/  /' || true
wait_ranks rank
t1=$(date +%s.%N)

echo "== partition and replication groups"
$B/tools/shardctl --socket "$dir/node0/shardd.sock" --job demo groups | sed 's/^/  /'
echo "== bytes moved per link class, per node, next to the formulas"
for i in $(seq 0 $((nodes - 1))); do
  $B/tools/shardctl --socket "$dir/node$i/shardd.sock" --job demo stats --json >"$dir/stats$i.json"
done
$B/tools/shardctl --socket "$dir/node0/shardd.sock" --job demo jobs --json >"$dir/jobs.json"
python3 - "$dir" "$nodes" "$k" "$plan" "$steps" "$accum" <<'PY'
import json, sys
d, N, K, plan, T, s = sys.argv[1], *map(int, sys.argv[2:4]), sys.argv[4], *map(int, sys.argv[5:7])
W = N * K
S = json.load(open(f"{d}/jobs.json"))["jobs"][0]["parameters"] * 4
p = 1 if plan.startswith("ddp") else W if plan.startswith("zero3") else int(plan.split(":")[1].split(",")[0])
G = p // K if p > K else 1
R = N // G
two_hop, hier = "no-2hop" not in plan, "no-hier" not in plan
block = S // G
print(f"  S = {S} bytes of padded parameters, p = {p}, k = {K}, N = {N}: partition groups span "
      f"{G} node(s), gradients sync across {R} node(s)")
print(f"  {'node':>4} {'link class':<28} {'measured':>12} {'formula':>12}")
bad = 0
for n in range(N):
    st = json.load(open(f"{d}/stats{n}.json"))["jobs"][0]
    gathers = (T + (1 if n == 0 else 0)) * (1 if hier else K) if G > 1 else 0
    ar = 2 * (R - 1) * (block if G > 1 else S) // R if R > 1 else 0
    rows = [
        ("copies within a package", st["bytes"]["intra_package"], None),
        ("copies between packages", st["bytes"]["intra_node"], None),
        ("fetch: inter-node received", st["ops"]["fetch"]["bytes"]["inter_node_recv"], gathers * (G - 1) * block),
        ("push: inter-node sent", st["ops"]["push"]["bytes"]["inter_node_sent"],
         T * s * (G - 1) * block + (0 if two_hop else T * s * ar)),
        # the step's norm exchange: 32 bytes to every other node (daemon/ops/schedule.h)
        ("step: inter-node sent", st["ops"]["step"]["bytes"]["inter_node_sent"], T * ((ar if two_hop else 0) + 32 * (N - 1))),
    ]
    for name, got, want in rows:
        mark = "" if want is None else ("  ok" if got == want else "  MISMATCH")
        bad += want is not None and got != want
        print(f"  {n:>4} {name:<28} {got:>12} {'' if want is None else want:>12}{mark}")
if bad:
    sys.exit(f"demo.sh: {bad} byte counts differ from their formulas")
PY
ref_loss=$($B/client/examples/mlp_train --reference --world "$world" --steps "$steps" --accum "$accum" \
  --dump-params "$dir/ref.bin" | tail -1)
compare_dumps "$dir/params.bin" "$dir/ref.bin" \
  "== parameters vs plain data-parallel training of the same global batch" \
  "demo.sh: the parameters are not those of plain data-parallel training"
echo "   reference, last step: $ref_loss"
printf "== %d steps on %d ranks over %d nodes in %.2f s\n" "$steps" "$world" "$nodes" \
  "$(python3 -c "print($t1 - $t0)")"

# ---- checkpoints: the run saved half-way and at the end; load the last under another plan
more=$((steps + 10)) plan2=zero3
[ "$plan" = zero3 ] && plan2=ddp
echo "== checkpoints: the run saved every $(((steps + 1) / 2)) steps into $dir/ck (LATEST names the newest)"
$B/tools/shardctl checkpoint-info "$dir/ck" | sed 's/^/  /'
echo "== a new job loads it under $plan2 (each daemon reads only the extents its ranks' shards need) and trains to step $more"
start_ranks demo-load load "$dir/params2.bin" --plan "$plan2" --steps "$more" --accum "$accum" \
  --load "$dir/ck" --quiet
wait_ranks load
$B/tools/shardctl --socket "$dir/node0/shardd.sock" --job demo-load jobs --json | python3 -c '
import json, sys
j = [j for j in json.load(sys.stdin)["jobs"] if j["name"] == "demo-load"][-1]["checkpoint"]
got, path, ms = j["loaded_bytes"], j["loaded_from"], j["load_ms"]
print(f"  node 0 read {got} bytes of {path} in {ms:.1f} ms")'
$B/client/examples/mlp_train --reference --world "$world" --steps "$more" --accum "$accum" \
  --load "$dir/ck" --dump-params "$dir/ref2.bin" >/dev/null
compare_dumps "$dir/params2.bin" "$dir/ref2.bin" \
  "  parameters vs the reference that reads the checkpoint files itself (without libshard) and trains on" \
  "demo.sh: the loaded job's parameters are not the reference's"

# ---- a PyTorch transformer through shardd, next to DDP
# under torch 2.x in shardd's venv (tools/torch-venv.sh: Debian's torch is 1.13)
py=${SHARD_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/shardd/venv}/bin/python
if [ "$torch" != no ] && ! "$py" -c "import torch, matplotlib" 2>/dev/null; then
  if [ "$torch" = ask ] && [ -t 0 ]; then
    read -r -p "== PyTorch 2.x is not installed; make its venv now (pip, ~5 GiB with CUDA's libraries)? [y/N] " yn
    [[ "$yn" =~ ^[Yy] ]] && torch=yes
  fi
  if [ "$torch" = yes ]; then
    py=$(tools/torch-venv.sh)
  else
    echo "== skipping the PyTorch example: no venv with torch 2.x at $py" \
         "(tools/demo.sh --torch makes it with tools/torch-venv.sh)"
  fi
fi
if [ "$torch" != no ] && "$py" -c "import torch" 2>/dev/null; then
  tools/local-cluster.sh stop --dir "$dir" >/dev/null
  gdir=$(mktemp -d /tmp/shardd-gpt-XXXXXX)
  trap 'cleanup; tools/local-cluster.sh stop --dir "$gdir" >/dev/null 2>&1 || true; rm -rf "$gdir"' EXIT
  echo "== a 4-layer GPT (width 128) through shardd on 2 nodes x 2 ranks (mics:2), then DDP (gloo)"
  tools/local-cluster.sh start --nodes 2 --ranks-per-node 2 --dir "$gdir" \
    --shardd "$B/daemon/shardd" -- --log-level warn >/dev/null
  SHARD_LIBRARY=$B/client/libshard.so.0 "$py" client/examples/train_gpt.py --launch \
    --cluster-dir "$gdir" --nodes 2 --ranks-per-node 2 --plan mics:2 --steps 20 \
    --plot "$B/gpt_loss.png" | sed 's/^/  /'
fi
