#!/usr/bin/env bash
# The boundary hop overlapped with the last backward (shard_last_micro_step, mlp_train
# --mark-last) against the same training without the promise, alternately on one shaped
# cluster: step time of each, the ratio, and the bytes across nodes (the same).
#   tools/bench/overlap.sh [--nodes 4] [--ranks-per-node 2] [--plan mics:2] [--hidden 2048]
#                          [--layers 4] [--accum 4] [--steps 4] [--compute-ms 150]
#                          [--rate 1gbit] [--repeat 3]
# --compute-ms is each layer's compute in the forward and in the backward, slept (a GPU's
# kernels: the 2 cores here stay the daemons'), so that the backward has time to hide the hop.
set -euo pipefail
cd "$(dirname "$0")/../.."
nodes=4 k=2 plan=mics:2 hidden=2048 layers=4 accum=4 steps=4 compute=150 rate=1gbit repeat=3
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) nodes=$2; shift 2 ;;
    --ranks-per-node) k=$2; shift 2 ;;
    --plan) plan=$2; shift 2 ;;
    --hidden) hidden=$2; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    --accum) accum=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --compute-ms) compute=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "overlap.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
. tools/bench/lib.sh
bench_build
dir=$(mktemp -d /tmp/shardd-overlap-XXXXXX)
trap 'tools/local-cluster.sh stop --dir "$dir" >/dev/null 2>&1; rm -rf "$dir"' EXIT
world=$((nodes * k))
tools/local-cluster.sh start --nodes "$nodes" --ranks-per-node "$k" --dir "$dir" --netns \
  --inter-rate "$rate" --shardd "$B/daemon/shardd" -- --log-level warn \
  --op-timeout-ms 120000 >/dev/null
out=$dir/results
: >"$out"
for i in $(seq 1 "$repeat"); do
  for mode in plain marked; do
    job=$mode-$i
    extra=()
    [ "$mode" = marked ] && extra=(--mark-last)
    run_ranks "$dir" "$k" "$world" "$job" --plan "$plan" --steps "$steps" --accum "$accum" \
      --hidden "$hidden" --layers "$layers" --batch 1 --compute-ms "$compute" \
      --compute-mode sleep "${extra[@]}"
    s=$(grep -oE "in [0-9.]+ s" "$dir/0.log" | grep -oE "[0-9.]+")
    stats=$($B/tools/shardctl --socket "$dir/node0/shardd.sock" --job "$job" stats --json)
    python3 - "$mode" "$s" "$stats" "$steps" >>"$out" <<'PY'
import json, sys
mode, s, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[4])
j = json.loads(sys.argv[3])["jobs"][0]
print(json.dumps({"mode": mode, "step_s": s / steps, "early": j.get("boundary_hops_early", 0),
                  "units": j["units"], "step_sent": j["ops"]["step"]["bytes"]["inter_node_sent"]}))
PY
  done
done
python3 - "$out" "$nodes" "$k" "$plan" "$hidden" "$layers" "$accum" "$compute" "$rate" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
nodes, k, plan, hidden, layers, accum, compute, rate = sys.argv[2:]
med = {m: statistics.median(r["step_s"] for r in rows if r["mode"] == m) for m in ("plain", "marked")}
sent = {m: [r["step_sent"] for r in rows if r["mode"] == m][0] for m in ("plain", "marked")}
early = [r["early"] for r in rows if r["mode"] == "marked"][0]
units = rows[0]["units"]
print(f"{nodes} nodes x {k} ranks, {plan}, mlp_train --hidden {hidden} --layers {layers} "
      f"--accum {accum}, compute {compute} ms a layer (slept), links {rate}, "
      f"{len(rows) // 2} runs each, medians:")
print("| mode | step time (s) | vs without | boundary hops during the backward (node 0) | "
      "step bytes sent (node 0) |")
print("|---|---|---|---|---|")
print(f"| without the promise | {med['plain']:.3f} | 1.00 | 0 | {sent['plain']} |")
print(f"| --mark-last | {med['marked']:.3f} | {med['marked'] / med['plain']:.2f} | {early} of "
      f"{units} units x steps | {sent['marked']} |")
PY
echo "(tools/bench/overlap.sh --nodes $nodes --ranks-per-node $k --plan $plan --hidden $hidden" \
     "--layers $layers --accum $accum --compute-ms $compute --rate $rate --repeat $repeat)"
