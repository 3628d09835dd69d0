#!/usr/bin/env bash
# Step time, per-rank memory and inter-node bytes of several plans for mlp_train on an emulated
# cluster whose inter-node links are shaped (network namespaces, tc), next to the cost model's
# prediction (shardctl plan) for each. Compute time per plan comes from the same training on an
# unshaped loopback cluster.
#   tools/bench/plans.sh [--nodes 4] [--ranks-per-node 2] [--hidden 2048] [--accum 4]
#                        [--steps 4] [--rate 1gbit] [--plans "zero3 zero2 mics:2 topo:2/2/8"]
#                        [--max-live-bytes B]  (a gather pool of B bytes per job: below the
#                        model's size the forward's units are gathered again for the backward)
set -euo pipefail
cd "$(dirname "$0")/../.."
nodes=4 k=2 hidden=2048 accum=4 steps=4 rate=1gbit plans="zero3 zero2 mics:2 topo:2/2/8"
live=0
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) nodes=$2; shift 2 ;;
    --ranks-per-node) k=$2; shift 2 ;;
    --hidden) hidden=$2; shift 2 ;;
    --accum) accum=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --plans) plans=$2; shift 2 ;;
    --max-live-bytes) live=$2; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "plans.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
. tools/bench/lib.sh
bench_build
dir=$(mktemp -d /tmp/shardd-plans-XXXXXX)
trap 'tools/local-cluster.sh stop --dir "$dir" >/dev/null 2>&1; rm -rf "$dir"' EXIT
world=$((nodes * k))
gbit=$(echo "$rate" | sed 's/gbit//; s/mbit/e-3/')
out=$dir/results
: >"$out"
# every plan on one cluster; $1: netns options (none: loopback), $2: key
run_plans() {
  tools/local-cluster.sh start --nodes "$nodes" --ranks-per-node "$k" --dir "$dir" $1 \
    --shardd "$B/daemon/shardd" -- --log-level warn --op-timeout-ms 120000 >/dev/null
  local i=0 plan job
  for plan in $plans; do
    job=p$i; i=$((i + 1))
    run_ranks "$dir" "$k" "$world" "$job" --plan "$plan" --steps "$steps" --accum "$accum" \
      --hidden "$hidden" --batch 1 --max-live-bytes "$live"
    s=$(grep -oE "in [0-9.]+ s" "$dir/0.log" | grep -oE "[0-9.]+")
    jobs=$($B/tools/shardctl --socket "$dir/node0/shardd.sock" --job "$job" jobs --json)
    stats=$($B/tools/shardctl --socket "$dir/node0/shardd.sock" --job "$job" stats --json)
    python3 - "$2" "$plan" "$s" "$jobs" "$stats" >>"$out" <<'PY'
import json, sys
key, plan, s = sys.argv[1], sys.argv[2], float(sys.argv[3])
job = json.loads(sys.argv[4])["jobs"][0]
st = json.loads(sys.argv[5])["jobs"][0]
sent = {op: v["bytes"]["inter_node_sent"] for op, v in st["ops"].items()}
intra = [sum(v["bytes"][c] for op, v in st["ops"].items() if op in ("fetch", "push", "step"))
         for c in ("intra_package", "intra_node")]
print(json.dumps({"key": key, "plan": plan, "s": s, "params": job["parameters"],
                  "memory": st["memory_bytes_at_register"], "sent": sent, "intra": intra,
                  "sec_loads": st["secondary"]["loads"]}))
PY
  done
  tools/local-cluster.sh stop --dir "$dir" >/dev/null
}
run_plans "" loop
run_plans "--netns --inter-rate $rate" shaped
models=()
for plan in $plans; do
  params=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["params"])' "$out")
  regather=()
  [ "$live" != 0 ] && regather=(--regather)
  models+=("$($B/tools/shardctl plan --params "$params" --world "$world" --ranks-per-node "$k" \
    --plan "$plan" --accum "$accum" --dtype fp32 --gbit-per-node "$gbit" "${regather[@]}" --json)")
done
python3 - "$steps" "$rate" "$k" "$out" "${models[@]}" <<'PY'
import json, sys
steps, rate, k = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
rows = [json.loads(l) for l in open(sys.argv[4])]
models = [json.loads(m) for m in sys.argv[5:]]
loop = {r["plan"]: r for r in rows if r["key"] == "loop"}
shaped = {r["plan"]: r for r in rows if r["key"] == "shaped"}
params = rows[0]["params"]
print(f"{params} parameters ({params * 4 / 1e6:.1f} MB fp32), {steps} steps, links {rate}, "
      f"node 0's bytes")
print(f"| plan | rank memory MB (states, secondary) | fetch MB/step | push MB/step | step MB/step "
      f"| model MB/step | intra-node MB/step (model) | loopback s/step | model comm s "
      f"| predicted s/step | measured s/step |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for m in models:
    p = m["plan"]
    l, s = loop[p], shaped[p]
    per = lambda op: s["sent"].get(op, 0) / steps / 1e6
    b = m["inter_node_bytes_per_step"]
    pred = l["s"] / steps + m["comm_s"]
    rb = m["rank_bytes"]
    states = sum(rb[x]["bytes"] for x in ("w", "g", "os"))
    intra = sum(s["intra"]) / steps / 1e6
    mi = m["intra_node_bytes_per_step"]["total"]
    print(f"| {p} | {s['memory'] / k / 1e6:.0f} ({states / 1e6:.0f}, {rb['secondary']['bytes'] / 1e6:.0f}) "
          f"| {per('fetch'):.1f} | {per('push'):.1f} | {per('step'):.1f} | {b['total'] / 1e6:.1f} "
          f"| {intra:.1f} ({(mi['intra_package'] + mi['intra_node']) / 1e6:.1f}) "
          f"| {l['s'] / steps:.3f} | {m['comm_s']:.3f} | {pred:.3f} | {s['s'] / steps:.3f} |")
PY
