#!/bin/bash
# Time spent inside shard_step (the optimizer's part of a step) for two builds, alternating runs
# on one daemon with two ranks: a before/after check for changes to the step's hot path.
#   tools/bench/step_before_after.sh OLD_BUILD_DIR NEW_BUILD_DIR [RUNS] [-- mlp_train options]
# Defaults: 3 runs each, mlp_train --plan zero3 --hidden 2048 --layers 8 (33.6M parameters),
# 15 steps; prints the total time and the mean time inside shard_step over steps 3..15.
set -euo pipefail
old=$1 new=$2 runs=${3:-3}
shift $(($# < 3 ? $# : 3))
[ "${1:-}" = "--" ] && shift
opts=("$@")
[ ${#opts[@]} -eq 0 ] && opts=(--plan zero3 --hidden 2048 --layers 8)
one() {
    local build=$1 tag=$2 d
    d=$(mktemp -d)
    "$build/daemon/shardd" --runtime-dir "$d" --log-level warn >"$d/log" 2>&1 &
    local pid=$!
    for _ in $(seq 100); do [ -S "$d/shardd.sock" ] && break; sleep 0.1; done
    local ranks=()
    for r in 0 1; do
        "$build/client/examples/mlp_train" --socket "$d/shardd.sock" --job b --rank $r --world 2 \
            --steps 15 --timing "${opts[@]}" >"$d/r$r.log" 2>&1 &
        ranks+=($!)
    done
    wait "${ranks[@]}"
    printf '%s %s; ' "$tag" "$(grep -h 'steps in' "$d/r0.log")"
    grep -h '^timing' "$d/r0.log" | awk 'NR > 2 { s += $14 } END { printf "in shard_step %.4f s per step\n", s / (NR - 2) }'
    kill $pid
    wait $pid 2>/dev/null || true
    rm -rf "$d"
}
for _ in $(seq "$runs"); do
    one "$old" before
    one "$new" after
done
