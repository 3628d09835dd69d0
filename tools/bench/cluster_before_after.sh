#!/usr/bin/env bash
# Step time of two builds on a loopback cluster, alternately: a before/after check for changes
# to a path across nodes (push rounds, the step's all-reduce, gathers).
#   tools/bench/cluster_before_after.sh OLD_BUILD_DIR NEW_BUILD_DIR [RUNS] [--nodes N]
#        [--ranks-per-node K] [--plan PLAN] [-- mlp_train options]
# Defaults: 3 runs each, 4 nodes x 2 ranks, zero3, mlp_train --hidden 1024 --layers 8 --accum 2
# --steps 14; prints rank 0's time for all steps and its mean step time over steps 3.. (the
# first two record the schedule). Build each tree with -DCMAKE_BUILD_TYPE=Release.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
old=$1 new=$2
shift 2
runs=3
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then runs=$1; shift; fi
nodes=4 k=2 plan=zero3 opts=()
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) nodes=$2; shift 2 ;;
    --ranks-per-node) k=$2; shift 2 ;;
    --plan) plan=$2; shift 2 ;;
    --) shift; opts=("$@"); break ;;
    *) echo "cluster_before_after.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ ${#opts[@]} -eq 0 ] && opts=(--hidden 1024 --layers 8 --accum 2 --steps 14)
here=$(cd "$(dirname "$0")/../.." && pwd)
one() {
  local build=$1 tag=$2 d r
  d=$(mktemp -d)
  bash "$here/tools/local-cluster.sh" start --nodes "$nodes" --ranks-per-node "$k" --dir "$d" \
    --shardd "$build/daemon/shardd" --shardctl "$build/tools/shardctl" -- --log-level warn >/dev/null
  local pids=() world=$((nodes * k))
  for r in $(seq 0 $((world - 1))); do
    "$build/client/examples/mlp_train" --socket "$d/node$((r / k))/shardd.sock" --job b \
      --rank "$r" --world "$world" --ranks-per-node "$k" --plan "$plan" "${opts[@]}" \
      >"$d/r$r.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  printf '%-6s %s: %s; ' "$tag" "$plan" "$(grep -h 'steps in' "$d/r0.log")"
  grep -h '^step [0-9]* loss' "$d/r0.log" |
    awk 'NR > 2 { n++; s += $(NF - 1) } END { printf "mean step (3..) %.4f s\n", s / n }'
  bash "$here/tools/local-cluster.sh" stop --dir "$d" >/dev/null
  rm -rf "$d"
}
for _ in $(seq "$runs"); do
  one "$old" before
  one "$new" after
done
