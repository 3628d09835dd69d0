#!/usr/bin/env bash
# shardd's collectives next to gloo (Debian's python3-torch) and Open MPI (Debian's openmpi),
# the same number of processes, the same sizes, in one run; prints busbw and the ratios.
#   tools/bench/compare.sh [--nodes N] [--ranks-per-node K] [--min BYTES] [--max BYTES]
#                          [--ops "allgather reducescatter allreduce"] [--repeat R]
#                          [--out FILE.jsonl]
# shardd runs N daemons on loopback (tools/local-cluster.sh) with K ranks each; gloo and Open MPI
# run N*K processes. Installs python3-torch and openmpi-bin if missing. Open MPI runs twice: with
# its defaults (shared memory, single copy by process_vm_readv) and with
# btl_vader_single_copy_mechanism none (two copies through shared buffers, faster on VMs where
# process_vm_readv is slow): ratios to both are printed. Arguments after -- go to every shardd:
# -- --provider shm --fabric-addr "" --shm-cma 0 is the loopback configuration of docs/benchmarks.md.
# --repeat R runs the four sweeps R times, one after the other in each round (a noisy host
# slows whichever runs at the time), and prints the median busbw of each, the ratios of the
# medians, and the lowest and highest of the R per-round ratios to Open MPI.
set -euo pipefail
cd "$(dirname "$0")/../.."
nodes=4 k=1 min=4096 max=$((64 << 20)) ops="allgather reducescatter allreduce" out= extra=()
repeat=1
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) nodes=$2; shift 2 ;;
    --ranks-per-node) k=$2; shift 2 ;;
    --min) min=$2; shift 2 ;;
    --max) max=$2; shift 2 ;;
    --ops) ops=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "compare.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ $repeat =~ ^[1-9][0-9]*$ ]] || { echo "compare.sh: --repeat needs a positive count" >&2; exit 2; }
. tools/bench/lib.sh
bench_build python3-torch openmpi-bin libopenmpi-dev
work=$(mktemp -d /tmp/shardd-compare-XXXXXX)
trap 'tools/local-cluster.sh stop --dir "$work/cluster" >/dev/null 2>&1; rm -rf "$work"' EXIT
mpicc -O2 -o "$work/mpi_bench" tools/bench/mpi_bench.c
np=$((nodes * k))
results=$work/results.jsonl
: >"$results"
tools/local-cluster.sh start --nodes "$nodes" --ranks-per-node "$k" --dir "$work/cluster" \
  --shardd build/bench/daemon/shardd -- --log-level warn "${extra[@]}" >/dev/null
socks=$(for i in $(seq 0 $((nodes - 1))); do printf '%s,' "$work/cluster/node$i/shardd.sock"; done)
tag() { sed "s/^{/{\"round\": $1, /"; }
for op in $ops; do
  for round in $(seq "$repeat"); do
    echo "== $op, round $round of $repeat: shardd ($nodes daemons x $k), gloo and Open MPI" \
      "($np processes)" >&2
    build/bench/tools/shard-bench "$op" --sockets "${socks%,}" --ranks-per-node "$k" \
      --min "$min" --max "$max" --json | sed 's/{"name"/{"impl": "shardd", "name"/' |
      tag "$round" >>"$results"
    /usr/bin/python3 tools/bench/gloo_bench.py "$op" --nprocs "$np" --min "$min" --max "$max" \
      2>/dev/null | tag "$round" >>"$results"
    mpirun --allow-run-as-root --oversubscribe -np "$np" "$work/mpi_bench" "$op" "$min" "$max" \
      2>/dev/null | tag "$round" >>"$results"
    mpirun --allow-run-as-root --oversubscribe -np "$np" \
      --mca btl_vader_single_copy_mechanism none "$work/mpi_bench" "$op" "$min" "$max" \
      2>/dev/null | sed 's/"impl": "openmpi"/"impl": "openmpi-2copy"/' | tag "$round" >>"$results"
  done
done
[ -n "$out" ] && cp "$results" "$out"
/usr/bin/python3 - "$results" <<'PY'
import json, sys
import statistics
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}  # (op, size) -> impl -> round -> row
for r in rows:
    by.setdefault((r["name"], r["size_bytes"]), {}).setdefault(r["impl"], {})[r["round"]] = r
impls = ("shardd", "gloo", "openmpi", "openmpi-2copy")
rounds = max(r["round"] for r in rows) if rows else 1
print(f"busbw GB/s{', medians of %d rounds' % rounds if rounds > 1 else ''}")
print(f'{"op":<14}{"size":>12}{"shardd":>10}{"gloo":>10}{"openmpi":>10}{"ompi-2cp":>10}'
      f'{"x gloo":>9}{"x ompi":>9}{"x 2cp":>9}' + (f'{"x ompi, each round":>22}' if rounds > 1 else ''))
for (name, size), d in sorted(by.items()):
    med = {k: statistics.median(v["busbw_GBps"] for v in d[k].values()) if d.get(k) else None
           for k in impls}
    s, g, m, m2 = (med[k] for k in impls)
    f = lambda v: f"{v:10.3f}" if v is not None else f'{"-":>10}'
    r = lambda b: f"{s / b:9.2f}" if s and b else f'{"-":>9}'
    each = [d["shardd"][i]["busbw_GBps"] / d["openmpi"][i]["busbw_GBps"]
            for i in d.get("shardd", {}) if i in d.get("openmpi", {})]
    span = f"{min(each):.2f}-{max(each):.2f}" if each else "-"
    wrong = sum(v.get("wrong", 0) for v in d.get("shardd", {}).values())
    print(f"{name:<14}{size:>12}{f(s)}{f(g)}{f(m)}{f(m2)}{r(g)}{r(m)}{r(m2)}" +
          (f"{span:>22}" if rounds > 1 else '') + (f"  #wrong {wrong}" if wrong else ""))
PY
