#!/usr/bin/env bash
# Checkpoint throughput (issue 22): save and load of a job whose checkpoint is about 1 GiB (fp32
# masters and AdamW's two moments of 88M parameters: mlp_train --hidden 2960 --layers 12) vs
# writing and reading the same bytes sequentially with fsync on the same disk (dd), in the same
# run; and the step time without saves vs the time a save adds to a step.
#   tools/bench/checkpoint.sh [--dir DIR] [--hidden 2960] [--layers 12] [--world 2] [--plan zero3]
#                             [--repeat 5] [-- SHARDD_OPTIONS...]
# DIR (default build/bench/ckpt) must be on the disk to measure (an absolute or relative path).
# Save: mlp_train's "saved step N in X s" (shard_save, collective, returns once durable: data
# fsynced, MANIFEST, renames, LATEST) of REPEAT new jobs, each right after dd's write. Load: the
# daemon's load time of a new job (shardctl jobs: checkpoint.load_ms, reading and checking every
# extent its ranks need, then setting masters, moments and weights), REPEAT jobs, each right
# after dd's read. Medians are compared, every value is printed. Reads start from a cold page cache when the kernel lets
# this process drop it (root), else every read (dd's and the load's alike) comes from the cache
# and the script says so. SHARDD_OPTIONS go to the daemons (--checkpoint-threads 1, ...).
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=build/bench/ckpt hidden=2960 layers=12 world=2 plan=zero3 repeat=5 daemon_opts=()
while [ $# -gt 0 ]; do
  case $1 in
    --dir) dir=$2; shift 2 ;;
    --hidden) hidden=$2; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    --world) world=$2; shift 2 ;;
    --plan) plan=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --) shift; daemon_opts=("$@"); break ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "checkpoint.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
. tools/bench/lib.sh
bench_build
cl=$dir/cluster
# a previous run's daemons, by the pid files of its cluster (never by name: another shardd on
# this machine, a production one, stays)
tools/local-cluster.sh stop --dir "$cl" >/dev/null 2>&1 || true
rm -rf "$dir" && mkdir -p "$dir"
tools/local-cluster.sh start --nodes 1 --ranks-per-node "$world" --dir "$cl" \
  --shardd "$B/daemon/shardd" -- "${daemon_opts[@]}" >/dev/null
trap 'tools/local-cluster.sh stop --dir "$cl" >/dev/null 2>&1 || true' EXIT
sock=$cl/node0/shardd.sock
common=(--plan "$plan" --hidden "$hidden" --layers "$layers" --batch 4)

drop_caches() { sync; if echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then cold=yes; else cold=no; fi; }
steps_of() { sed -n 's/^step [0-9]* loss .* \([0-9.]*\) s$/\1/p' "$1"; }
mean() { awk '{ s += $1; n++ } END { if (n) printf "%.4f", s / n; else print "nan" }'; }

# steps without saves, then with a save after every step (the step's cost of a save)
run_ranks "$cl" "$world" "$world" plain "${common[@]}" --steps 4
step_plain=$(steps_of "$cl/0.log" | tail -n +2 | mean)
run_ranks "$cl" "$world" "$world" saving "${common[@]}" --steps 3 --save-every 1 \
  --save-dir "$dir/ck0"
step_saving=$(steps_of "$cl/0.log" | tail -n +2 | mean)
bytes=$("$B/tools/shardctl" checkpoint-info "$dir/ck0" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes"])')
rm -rf "$dir/ck0"

# The same bytes written and read sequentially with fsync on the same disk, each right before
# the save or the load it is compared with: this VM's disk drifts by 2x over minutes, and a dd
# measured minutes apart from the saves compared the drift, not the writers. Each save is a new
# job's first (a checkpoint of its own, nothing replaced); each load a new job's, from a cold
# page cache.
mib=$(( (bytes + 1048575) / 1048576 ))
timed() { local t0 t1; t0=$(date +%s.%N); "$@"; t1=$(date +%s.%N); echo "$t1 - $t0" | bc -l; }
writes="" saves="" reads="" loads=""
for i in $(seq "$repeat"); do
  rm -f "$dir/seq.bin"; sync
  writes+="$(timed dd if=/dev/zero of="$dir/seq.bin" bs=1M count="$mib" conv=fsync status=none) "
  run_ranks "$cl" "$world" "$world" "saving$i" "${common[@]}" --steps 1 --save-every 1 \
    --save-dir "$dir/ck$i"
  saves+="$(sed -n 's/^rank 0: saved step [0-9]* to .* in \([0-9.]*\) s$/\1/p' "$cl/0.log" | tail -1) "
  [ "$i" -lt "$repeat" ] && rm -rf "$dir/ck$i"
done
for i in $(seq "$repeat"); do
  drop_caches
  reads+="$(timed dd if="$dir/seq.bin" of=/dev/null bs=1M status=none) "
  drop_caches
  run_ranks "$cl" "$world" "$world" "loading$i" "${common[@]}" --steps 2 --load "$dir/ck$repeat"
  loads+="$("$B/tools/shardctl" --socket "$sock" --job "loading$i" --json jobs |
    python3 -c 'import json,sys; d=json.load(sys.stdin); j=[j for j in d["jobs"] if j["name"]=="loading'"$i"'"][-1]; print(j["checkpoint"]["load_ms"] / 1000)') "
done
rm -f "$dir/seq.bin"

python3 - "$bytes" "$saves" "$writes" "$loads" "$reads" "$step_plain" "$step_saving" "$cold" <<'EOF'
import statistics, sys
b, saves, writes, loads, reads, plain, saving, cold = sys.argv[1:]
b = int(b); plain, saving = float(plain), float(saving)
vals = lambda s: [float(x) for x in s.split()]
med = lambda s: statistics.median(vals(s))
each = lambda s: " ".join(f"{x:.3f}" for x in vals(s))
save, write, load, read = med(saves), med(writes), med(loads), med(reads)
gib = b / 2**30
mbs = lambda s: b / s / 2**20
print(f"checkpoint {b} bytes ({gib:.2f} GiB); reads from a cold page cache: {cold}; medians of {len(vals(saves))}")
print(f"save  {save:7.3f} s  {mbs(save):8.1f} MiB/s   sequential write + fsync {write:7.3f} s  {mbs(write):8.1f} MiB/s   ratio {write / save:.2f} (target >= 0.8)")
print(f"load  {load:7.3f} s  {mbs(load):8.1f} MiB/s   sequential read          {read:7.3f} s  {mbs(read):8.1f} MiB/s   ratio {read / load:.2f} (target >= 0.8)")
print(f"step  {plain:7.3f} s without saves, {saving:7.3f} s with a save after each (the save itself excluded); a save adds {save:.3f} s = {save / plain:.2f} steps")
pairs = lambda a, b: " ".join(f"{x / y:.2f}" for x, y in zip(vals(a), vals(b)))
print(f"each pair's ratio: saves {pairs(writes, saves)}; loads {pairs(reads, loads)}")
print(f"each: saves {each(saves)}; writes {each(writes)}; loads {each(loads)}; reads {each(reads)}")
EOF
