#!/usr/bin/env bash
# Install what is missing, build, start shardd on this machine, train the example MLP through it
# with 4 ranks, and print what happened: progress, loss, bytes per link class, time.
# Usage: tools/demo.sh [--plan PLAN] [--steps N] [--ranks K]
set -euo pipefail
cd "$(dirname "$0")/.."
plan=mics:2 steps=30 ranks=4
while [ $# -gt 0 ]; do
  case $1 in
    --plan) plan=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    -h|--help) sed -n '2,4p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
tools/deps.sh >/dev/null
echo "== building"
cmake -S . -B build/demo -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/demo -j"$(nproc)" >/dev/null
B=build/demo
dir=$(mktemp -d /tmp/shardd-demo-XXXXXX)
cleanup() { [ -n "${dpid:-}" ] && kill "$dpid" 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT

echo "== starting shardd (1 node, host backend) in $dir"
$B/daemon/shardd --runtime-dir "$dir/run" --log-level warn >"$dir/shardd.log" 2>&1 &
dpid=$!
for _ in $(seq 100); do [ -S "$dir/run/shardd.sock" ] && break; sleep 0.05; done
S="$dir/run/shardd.sock"

echo "== training a 4-layer MLP (327k parameters) with $ranks ranks, plan $plan, $steps steps, accum 2"
t0=$(date +%s.%N)
for r in $(seq 0 $((ranks - 1))); do
  $B/client/examples/mlp_train --socket "$S" --job demo --rank "$r" --world "$ranks" \
    --plan "$plan" --steps "$steps" --accum 2 --dump-params "$dir/params$r.bin" \
    >"$dir/rank$r.log" 2>&1 &
  pids[$r]=$!
done
# rank 0's progress, live
tail -n +1 -f "$dir/rank0.log" --pid "${pids[0]}" 2>/dev/null | sed 's/^/  /'
for r in "${!pids[@]}"; do wait "${pids[$r]}" || { echo "rank $r failed:"; cat "$dir/rank$r.log"; exit 1; }; done
t1=$(date +%s.%N)
echo "== partition and replication groups"
$B/tools/shardctl --socket "$S" groups --job demo
echo "== daemon statistics (bytes moved per link class, latency per operation)"
$B/tools/shardctl --socket "$S" stats --job demo
$B/client/examples/mlp_train --reference --world "$ranks" --steps "$steps" --accum 2 \
  --dump-params "$dir/ref.bin" --quiet
python3 - "$dir/params0.bin" "$dir/ref.bin" <<'PY'
import struct, sys
a = open(sys.argv[1], 'rb').read(); b = open(sys.argv[2], 'rb').read()
x = struct.unpack(f'{len(a)//4}f', a); y = struct.unpack(f'{len(b)//4}f', b)
d = max(abs(p - q) for p, q in zip(x, y))
print(f"== parameters vs plain data-parallel reference: {len(x)} values, max |diff| {d:.3g}"
      + (" (bitwise identical)" if a == b else ""))
PY
printf "== %d steps on %d ranks in %.2f s\n" "$steps" "$ranks" "$(echo "$t1 - $t0" | bc -l 2>/dev/null || python3 -c "print($t1-$t0)")"
