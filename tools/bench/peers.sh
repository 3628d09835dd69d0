#!/usr/bin/env bash
# shardd beside the systems its users would pick instead, on one emulated cluster: the GPT of
# client/examples/train_gpt.py trained by FSDP2 (full shard; HSDP on a 2-D mesh, sharded within
# a node), DDP (the unsharded baseline), DeepSpeed (ZeRO-3; MiCS with mics_shard_size 2 and the
# hierarchical gather; ZeRO++ with hpZ, qwZ and qgZ, and hpZ alone) and shardd (zero3, mics:2, zeropp, topo and
# the per-state plan topo:W/G/n that shardctl plan --pick predicts fastest), the same global batch, accumulation, AdamW groups,
# schedule and steps, one thread per rank (tools/bench/peers_train.py: how each is set up).
# A system with "+bf16" after it reduces its gradients in bf16 (FSDP2's reduce_dtype, DeepSpeed's
# communication_data_type, shardd's ,gwire=bf16): fsdp2+bf16 hsdp+bf16 ds-zero3+bf16
# shardd:zero3+bf16 shardd:mics:2+bf16, compared with each other.
# Every rank runs in the network namespace of its node; the links between nodes are shaped to
# --rate (tools/local-cluster.sh --netns). Prints a table per model size (tokens/s, the ratio
# to the fastest peer with the same sharding, peak memory per rank, the last loss) and writes
# the losses of every step and a plot (matplotlib) into --out.
#   tools/bench/peers.sh [--nodes 4] [--ranks-per-node 2] [--rate 1gbit] [--steps 8]
#                        [--sizes "comm compute"] [--systems "ddp fsdp2 ..."] [--out DIR]
#                        [--report-only]  (the table and plot of the runs already in --out DIR:
#                                          several invocations' systems in one table)
# Sizes: comm = 8 layers of width 512 (25 M parameters: the gathers at 1 Gbit/s dominate),
# compute = 2 layers of width 128 with 4x the batch (the forward and backward dominate),
# wire = comm's model with 1/8 of its tokens (on a 2-core machine comm's 8 ranks are still
# bound by their forward and backward: ~620 GFLOP a step; wire's ~80).
# Needs root (namespaces) and tools/torch-venv.sh --peers (torch 2.x and DeepSpeed).
set -euo pipefail
cd "$(dirname "$0")/../.."
nodes=4 k=2 rate=1gbit steps=8 sizes="comm compute" out= report=0
systems="ddp fsdp2 hsdp ds-zero3 ds-mics2 ds-zeropp ds-hpz shardd:zero3 shardd:mics:2 shardd:zeropp shardd:topo shardd:best"
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) nodes=$2; shift 2 ;;
    --ranks-per-node) k=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --systems) systems=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --report-only) report=1; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "peers.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
py=$(tools/torch-venv.sh --peers)
if [ "$report" = 1 ]; then
  [ -n "$out" ] && [ -d "$out" ] || { echo "peers.sh: --report-only needs --out DIR" >&2; exit 2; }
else
. tools/bench/lib.sh
bench_build
# shard.torch loads the library of the build just made (else the first build it finds), unless
# SHARD_LIBRARY names another
export SHARD_LIBRARY=${SHARD_LIBRARY:-$PWD/$B/client/libshard.so.0}
dir=$(mktemp -d /tmp/shardd-peers-XXXXXX)
out=${out:-$dir/out}
mkdir -p "$out"
trap 'tools/local-cluster.sh stop --dir "$dir" >/dev/null 2>&1; rm -rf "$dir/node"*' EXIT
world=$((nodes * k))
tools/local-cluster.sh start --nodes "$nodes" --ranks-per-node "$k" --dir "$dir" --netns \
  --inter-rate "$rate" --shardd "$B/daemon/shardd" -- --log-level warn \
  --op-timeout-ms 300000 >/dev/null
# node 0's address in its namespace: the rendezvous of the peers' process groups
master=$(ip -n "$(tools/local-cluster.sh netns --dir "$dir" --node 0)" -4 -o addr show |
  grep -oE "10\.[0-9]+\.[0-9]+\.[0-9]+" | head -1)
port=29700

size_args() {
  case $1 in
    comm) echo "--layers 8 --width 512 --heads 8 --seq 64 --batch 4 --accum 2" ;;
    compute) echo "--layers 2 --width 128 --heads 4 --seq 64 --batch 16 --accum 2" ;;
    wire) echo "--layers 8 --width 512 --heads 8 --seq 32 --batch 1 --accum 2" ;;
    *) echo "peers.sh: unknown size $1" >&2; exit 2 ;;
  esac
}

# run SIZE SYSTEM: every rank of SYSTEM in its node's namespace; rank 0's JSON in $out
run() {
  local size=$1 sys=$2 r n opts=() job base=${2%+bf16}
  read -r -a model <<<"$(size_args "$size")"
  case $base in
    ddp | fsdp2 | hsdp) opts=(--system "$base") ;;
    ds-zero3) opts=(--system deepspeed) ;;
    ds-mics2) opts=(--system deepspeed --ds-mics 2) ;;
    ds-zeropp) opts=(--system deepspeed --ds-zeropp "$k") ;;
    ds-hpz) opts=(--system deepspeed --ds-hpz "$k") ;;
    shardd:best)
      local params
      params=$("$py" -c "import sys; sys.argv=['x']+sys.argv[1:]; sys.path.insert(0,'tools/bench');
import peers_train as p; a=p.args(); print(sum(x.numel() for x in p.model_of(a).parameters()))" \
        --system ddp --rank 0 --world 1 --ranks-per-node 1 --out /dev/null "${model[@]}")
      # the per-state plan of least predicted step time among topo:W/G/n (the optimizer
      # states over all ranks, as ZeRO-topo keeps them) by shardctl plan --pick: what moves
      # beside the forward and backward and what the step waits for (the script marks the
      # last backward); equal predictions go to the plan of least memory
      local pick best bt
      pick=$("$B/tools/shardctl" plan --pick --params "$params" --world "$world" \
        --ranks-per-node "$k" --f-os "$world" --accum 2 --dtype fp32 --last-marked \
        --gbit-per-node "$(echo "$rate" | sed 's/gbit//; s/mbit/e-3/')" --json)
      best=$("$py" -c 'import json,sys; print(json.load(sys.stdin)["pick"])' <<<"$pick")
      bt=$("$py" -c 'import json,sys; c=json.load(sys.stdin)["candidates"][0]
print("%.3f s of communication a step, %.3f s of it after the last backward"
      % (c["comm_s"], c["exposed_s"]))' <<<"$pick")
      echo "   the cost model's plan: $best ($bt)" >&2
      opts=(--system shardd --plan "$best") ;;
    shardd:*) opts=(--system shardd --plan "${base#shardd:}") ;;
    *) echo "peers.sh: unknown system $sys" >&2; exit 2 ;;
  esac
  [ "$base" = "$sys" ] || opts+=(--reduce-dtype bf16)
  port=$((port + 1))
  job="peers-$size-${sys//[:+]/-}"
  local pids=()
  for r in $(seq 0 $((world - 1))); do
    n=$((r / k))
    local ns
    ns=$(tools/local-cluster.sh netns --dir "$dir" --node "$n")
    # gloo binds the address of the interface it is told (else the hostname's, which the
    # other namespaces cannot reach)
    local ifname
    ifname=$(ip -n "$ns" -o link show | awk -F': ' '$2 !~ /^lo/ {print $2}' | cut -d@ -f1 |
      head -1)
    ip netns exec "$ns" env OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu GLOO_SOCKET_IFNAME="$ifname" \
      "$py" tools/bench/peers_train.py "${opts[@]}" \
      --rank "$r" --world "$world" --ranks-per-node "$k" --master "$master:$port" \
      --socket "$dir/node$n/shardd.sock" --job "$job" --steps "$steps" "${model[@]}" \
      --out "$out/$size-${sys//:/-}.json" >"$out/$size-${sys//:/-}-$r.log" 2>&1 &
    pids+=($!)
  done
  local failed=0
  for r in "${!pids[@]}"; do wait "${pids[$r]}" || failed=1; done
  if [ "$failed" = 1 ]; then
    echo "peers.sh: $sys ($size) failed; its last lines:" >&2
    grep -v "^W1\|^\s*$" "$out/$size-${sys//:/-}-0.log" | tail -4 >&2
    echo "{\"system\": \"$sys\", \"failed\": true}" >"$out/$size-${sys//:/-}.json"
  fi
}

for size in $sizes; do
  for sys in $systems; do
    echo "== $size: $sys" >&2
    run "$size" "$sys"
  done
done
fi
"$py" - "$out" "$sizes" "$systems" "$rate" "$nodes" "$k" <<'PY'
import json, os, sys
out, sizes, systems, rate, nodes, k = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), \
    sys.argv[4], sys.argv[5], sys.argv[6]
# the sharding semantics each row is compared under, and the peers that have them
SAME = {"zero3": ["fsdp2", "ds-zero3"], "mics:2": ["hsdp", "ds-mics2"],
        "zeropp": ["ds-zeropp", "ds-hpz"], "zero3+bf16": ["fsdp2+bf16", "ds-zero3+bf16"],
        "mics:2+bf16": ["hsdp+bf16"]}
def sem(s):
    return s.split(":", 1)[1] if s.startswith("shardd:") else None
for size in sizes:
    res = {}
    for s in systems:
        p = os.path.join(out, f"{size}-{s.replace(':', '-')}.json")
        if os.path.exists(p):
            res[s] = json.load(open(p))
    print(f"\n{size}: {nodes} nodes x {k} ranks, links {rate}")
    print("| system | tokens/s | vs fastest peer of the same sharding | peak RSS per rank (MiB) | "
          "+ daemon per rank (MiB) | loss at the last step |")
    print("|---|---|---|---|---|---|")
    for s, r in res.items():
        if r.get("failed"):
            print(f"| {s} | failed | | | | |")
            continue
        ratio = ""
        peers = [res[p]["tokens_per_s"] for p in SAME.get(sem(s) or "", [])
                 if p in res and not res[p].get("failed")]
        if peers:
            ratio = f"{r['tokens_per_s'] / max(peers):.2f}"
        print(f"| {s} | {r['tokens_per_s']:.0f} | {ratio} | {r['peak_rss'] / 2**20:.0f} | "
              f"{r['daemon_bytes_per_rank'] / 2**20:.0f} | {r['loss'][-1]:.4f} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        continue
    ok = {s: r for s, r in res.items() if not r.get("failed")}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
    a1.barh(list(ok), [r["tokens_per_s"] for r in ok.values()],
            color=["tab:blue" if s.startswith("shardd") else "tab:gray" for s in ok])
    a1.set_xlabel("tokens/s")
    a1.set_title(f"{size}: {nodes}x{k} ranks, {rate} between nodes")
    for s, r in ok.items():
        a2.plot(range(1, len(r["loss"]) + 1), r["loss"], label=s,
                linestyle="-" if s.startswith("shardd") else "--")
    a2.set_xlabel("step")
    a2.set_ylabel("loss (rank 0)")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"peers-{size}.png"), dpi=110)
    print(f"plot: {os.path.join(out, f'peers-{size}.png')}")
PY
echo "logs and losses: $out" >&2
