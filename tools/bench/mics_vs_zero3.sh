#!/usr/bin/env bash
# Step time of mlp_train under mics:2 and zero3 on an emulated cluster whose inter-node links are
# shaped (network namespaces, tc), next to the ratio the MiCS cost model predicts.
#   tools/bench/mics_vs_zero3.sh [--nodes 4] [--ranks-per-node 2] [--hidden 2048] [--accum 4]
#                                [--steps 4] [--rate 1gbit]
set -euo pipefail
cd "$(dirname "$0")/../.."
nodes=4 k=2 hidden=2048 accum=4 steps=4 rate=1gbit
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) nodes=$2; shift 2 ;;
    --ranks-per-node) k=$2; shift 2 ;;
    --hidden) hidden=$2; shift 2 ;;
    --accum) accum=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
    *) echo "mics_vs_zero3.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
. tools/bench/lib.sh
bench_build
dir=$(mktemp -d /tmp/shardd-mics-XXXXXX)
trap 'tools/local-cluster.sh stop --dir "$dir" >/dev/null 2>&1; rm -rf "$dir"' EXIT
world=$((nodes * k))
gbps=$(echo "$rate" | sed 's/gbit//; s/mbit/e-3/')
declare -A t
# run both plans on a cluster; $1: netns options (none: loopback), $2: key prefix
run_plans() {
  tools/local-cluster.sh start --nodes "$nodes" --ranks-per-node "$k" --dir "$dir" $1 \
    --shardd "$B/daemon/shardd" -- --log-level warn --op-timeout-ms 120000 >/dev/null
  for plan in mics:2 zero3; do
    run_ranks "$dir" "$k" "$world" "b-${plan/:/}" --plan "$plan" --steps "$steps" \
      --accum "$accum" --hidden "$hidden" --batch 1
    t[$2$plan]=$(grep -oE "in [0-9.]+ s" "$dir/0.log" | grep -oE "[0-9.]+")
  done
  params=$($B/tools/shardctl --socket "$dir/node0/shardd.sock" --job b-mics2 jobs --json |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["parameters"])')
  tools/local-cluster.sh stop --dir "$dir" >/dev/null
}
# compute time per plan: the same training on an unshaped loopback cluster
run_plans "" loop-
run_plans "--netns --inter-rate $rate" shaped-
m=$($B/tools/shard-bench model --plan mics:2 --params "$params" --nodes "$nodes" --ranks-per-node "$k" --accum "$accum" --gbps "$gbps" --json)
z=$($B/tools/shard-bench model --plan zero3 --params "$params" --nodes "$nodes" --ranks-per-node "$k" --accum "$accum" --gbps "$gbps" --json)
python3 - "$params" "$steps" "$rate" "${t[loop-mics:2]}" "${t[loop-zero3]}" \
  "${t[shaped-mics:2]}" "${t[shaped-zero3]}" "$m" "$z" <<'PY'
import json, sys
params, steps, rate = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
lm, lz, sm, sz = (float(x) / steps for x in sys.argv[4:8])
m, z = json.loads(sys.argv[8]), json.loads(sys.argv[9])
pm, pz = lm + m["comm_s"], lz + z["comm_s"]
print(f"{params} parameters ({params * 4 / 1e6:.1f} MB fp32), {steps} steps, links {rate}")
print(f"{'plan':<8}{'loopback s/step':>17}{'model comm s':>14}{'predicted':>11}{'measured':>10}")
print(f"{'mics:2':<8}{lm:>17.3f}{m['comm_s']:>14.3f}{pm:>11.3f}{sm:>10.3f}")
print(f"{'zero3':<8}{lz:>17.3f}{z['comm_s']:>14.3f}{pz:>11.3f}{sz:>10.3f}")
print(f"zero3 / mics:2 step time: measured {sz / sm:.2f}x, cost model {pz / pm:.2f}x "
      f"(communication alone {z['comm_s'] / m['comm_s']:.2f}x)")
PY
