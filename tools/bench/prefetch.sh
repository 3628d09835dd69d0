#!/usr/bin/env bash
# Step time with prefetch vs without (the frozen schedule of issue 4) on an emulated cluster
# whose inter-node links are shaped (network namespaces, tc), next to max(compute,
# communication) and compute + communication; and the daemon CPU time per fetch once the
# schedule is frozen vs in the first step.
#   tools/bench/prefetch.sh [--nodes 4] [--ranks-per-node 2] [--hidden 724] [--layers 16]
#                           [--accum 1] [--steps 8] [--rate 1gbit] [--plan zero3]
#                           [--depth 2] [--compute-ms MS]   (default: balanced against the measured
#                                                communication)
# docs/benchmarks.md's table also runs --layers 8 --hidden 1024: the same 34 MB in half the units.
# Communication alone is the steady-state step time with no compute (prefetch off). Compute
# alone is all ranks computing at once with no shardd at all (mlp_train --compute-only: the
# calibrated wait, 2 x layers x accum x compute_ms per step, plus their own matrix products,
# which 8 ranks on a small host slow down); the target compares against it. Also shown: the
# calibrated wait alone, and rank 0's time outside shardd's calls in the prefetch run. The time
# inside the calls (mlp_train --timing) is the communication left exposed. The waits sleep
# (--compute-mode sleep, like a host waiting for a GPU kernel): a 2-core machine cannot
# busy-wait 8 ranks without starving the daemons. Steady state: steps after the first two (the
# first records the schedule).
set -euo pipefail
cd "$(dirname "$0")/../.."
nodes=4 k=2 hidden=724 layers=16 accum=1 steps=8 rate=1gbit plan=zero3 cms= depth=2
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) nodes=$2; shift 2 ;;
    --ranks-per-node) k=$2; shift 2 ;;
    --hidden) hidden=$2; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    --accum) accum=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --plan) plan=$2; shift 2 ;;
    --compute-ms) cms=$2; shift 2 ;;
    --depth) depth=$2; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "prefetch.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
. tools/bench/lib.sh
bench_build
dir=$(mktemp -d /tmp/shardd-prefetch-XXXXXX)
trap 'tools/local-cluster.sh stop --dir "$dir" >/dev/null 2>&1; rm -rf "$dir"' EXIT
world=$((nodes * k))

# $1: prefetch depth, $2: compute ms, $3: job; prints the mean steady-state step time and the
# mean time rank 0 spent inside shardd's calls
run() {
  tools/local-cluster.sh start --nodes "$nodes" --ranks-per-node "$k" --dir "$dir" --netns \
    --inter-rate "$rate" --shardd "$B/daemon/shardd" -- --log-level warn \
    --op-timeout-ms 120000 --prefetch-depth "$1" >/dev/null
  run_ranks "$dir" "$k" "$world" "$3" --plan "$plan" --steps "$steps" --accum "$accum" \
    --hidden "$hidden" --layers "$layers" --batch 1 --compute-ms "$2" --compute-mode sleep --timing
  $B/tools/shardctl --socket "$dir/node0/shardd.sock" --job "$3" schedule --json >"$dir/$3.json"
  tools/local-cluster.sh stop --dir "$dir" >/dev/null
  step=$(grep -oE "^step [0-9]+ .* [0-9.]+ s$" "$dir/0.log" | awk 'NR > 2 { s += $(NF-1); n++ }
    END { printf "%.4f\n", s / n }')
  inside=$(grep -E "^timing step" "$dir/0.log" | awk 'NR > 2 { s += $6 + $10 + $14; n++ }
    END { printf "%.4f\n", s / n }')
  echo "$step $inside"
}

read -r comm _ < <(run 0 0 comm)
if [ -z "$cms" ]; then
  cms=$(python3 -c "print(round($comm * 1000 / (2 * $layers * $accum), 3))")
fi
# compute alone: the same ranks at the same time, each on its own copy of the weights, no shardd
# (mlp_train --compute-only): the matrix products and waits under the same CPU contention
run_ranks "$dir" "$k" "$world" alone --steps "$steps" --accum "$accum" --hidden "$hidden" \
  --layers "$layers" --batch 1 --compute-ms "$cms" --compute-mode sleep --compute-only
alone=$(grep -oE "^step [0-9]+ .* [0-9.]+ s$" "$dir/0.log" | awk 'NR > 2 { s += $(NF-1); n++ }
  END { printf "%.4f\n", s / n }')
read -r off off_in < <(run 0 "$cms" off)
read -r on on_in < <(run "$depth" "$cms" on)
python3 - "$comm" "$off" "$on" "$cms" "$layers" "$accum" "$dir/on.json" "$plan" "$rate" \
  "$nodes" "$k" "$hidden" "$depth" "$on_in" "$off_in" "$alone" <<'PY'
import json, sys
comm, off, on, cms = map(float, sys.argv[1:5])
layers, accum = int(sys.argv[5]), int(sys.argv[6])
sc = json.load(open(sys.argv[7]))["jobs"][0]
plan, rate, nodes, k, hidden, depth = sys.argv[8:14]
on_in, off_in, alone = float(sys.argv[14]), float(sys.argv[15]), float(sys.argv[16])
wait = 2 * layers * accum * cms / 1000  # the calibrated waits alone
best, serial = max(alone, comm), alone + comm
measured = on - on_in  # rank 0 outside shardd's calls, in the prefetch run
print(f"{plan} on {nodes} nodes x {k} ranks, links {rate}, MLP {layers} layers of width {hidden}, "
      f"accum {accum}; steady-state s/step")
print(f"  communication alone (no compute)     {comm:8.4f}")
print(f"  compute alone (all ranks, no shardd) {alone:8.4f}  (waits of {cms} ms per layer pass: "
      f"{wait:.4f}, plus the ranks' matrix products)")
print(f"  max(compute, communication)          {best:8.4f}")
print(f"  compute + communication              {serial:8.4f}")
print(f"  without prefetch (prefetch_depth 0)  {off:8.4f}  = {off / best:.2f} x max")
print(f"  with prefetch (prefetch_depth {depth})     {on:8.4f}  = {on / best:.2f} x max  "
      f"(target <= 1.15)")
print(f"  rank 0 inside shardd calls (exposed)  {on_in:8.4f} with prefetch, {off_in:.4f} without")
print(f"  compute measured (outside the calls)  {measured:8.4f}  -> prefetch step = "
      f"{on / max(measured, comm):.2f} x max(measured compute, communication)")
print(f"  against the calibrated waits alone    {wait:8.4f}  -> prefetch step = "
      f"{on / max(wait, comm):.2f} x max(waits, communication)")
print(f"  daemon CPU per fetch on node 0: {sc['fetch_cpu_us_frozen']:.2f} us frozen vs "
      f"{sc['fetch_cpu_us_unfrozen']:.2f} us in the first step; starting gathers "
      f"{sc['fetch_issue_cpu_us_frozen']:.2f} vs {sc['fetch_issue_cpu_us_unfrozen']:.2f}; prefetches {sc['prefetches']}, "
      f"fetches found ready {sc['prefetch_hits']}, waits {sc['waits']}")
print(f"  pool peak {sc['pool_peak_bytes']} B = "
      f"{sc['pool_peak_bytes'] / max(1, sc['pool_lower_bound_bytes']):.3f} x the lower bound")
PY
