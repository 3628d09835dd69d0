#!/usr/bin/env bash
# What an idle daemon costs: CPU (share of a core), wake-ups (context switches a second) and
# resident memory of (1) one fresh daemon and (2) two independent daemons after a 20-step job
# across them ended and they closed their fabric (fabric_idle_close_ms after it), each over the
# same window, measured from /proc.
#   tools/bench/idle.sh [--seconds 60]
# The target (issue 61): under 0.1% of a core; resident memory of (2) within 16 MB of (1).
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=60
while [ $# -gt 0 ]; do
  case $1 in
    --seconds) secs=$2; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "idle.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
. tools/bench/lib.sh
bench_build
hz=$(getconf CLK_TCK)
dir=$(mktemp -d)
trap 'tools/local-cluster.sh stop --dir "$dir/one" >/dev/null 2>&1 || true
      tools/local-cluster.sh stop --dir "$dir/two" >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
switches() { cat /proc/"$1"/task/*/status | awk '/ctxt_switches/ {s += $2} END {print s}'; }
rss_kb() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
# measure LABEL PID...: CPU share and wake-ups of each over secs, and its resident memory
measure() {
  local label=$1 p
  shift
  local t0=() s0=()
  for p in "$@"; do t0+=("$(ticks "$p")"); s0+=("$(switches "$p")"); done
  sleep "$secs"
  local i=0
  for p in "$@"; do
    awk -v l="$label" -v i="$i" -v t="$(( $(ticks "$p") - t0[i] ))" -v hz="$hz" -v s="$secs" \
        -v w="$(( $(switches "$p") - s0[i] ))" -v r="$(rss_kb "$p")" 'BEGIN {
      printf "| %s, daemon %d | %.3f%% | %.1f | %.1f MB |\n", l, i, 100 * t / hz / s, w / s,
             r / 1024 }'
    i=$((i + 1))
  done
}

echo "| over $secs s | CPU (of a core) | wake-ups a second | resident |"
echo "|---|---|---|---|"
tools/local-cluster.sh start --nodes 1 --dir "$dir/one" --independent --shardd "$B/daemon/shardd" \
  -- --log-level warn >/dev/null
measure "fresh" "$(cat "$dir/one/node0/pid")"
tools/local-cluster.sh start --nodes 2 --dir "$dir/two" --independent --shardd "$B/daemon/shardd" \
  -- --log-level info >/dev/null
head -c 32 /dev/urandom >"$dir/two/job.secret"
SHARD_LEADER=$(cat "$dir/two/node0/leader") SHARD_JOB_SECRET_FILE=$dir/two/job.secret \
  run_ranks "$dir/two" 2 4 idle --ranks-per-node 2 --plan mics:2 --steps 20 --quiet
# the daemons close their fabric fabric_idle_close_ms (10 s) after their last job went: measured
# from then on (the fabric's buffers back, no peer links, no heartbeats)
for n in 0 1; do
  for _ in $(seq 1 300); do
    grep -q "the fabric and the peer links are closed" "$dir/two/node$n/shardd.log" && break
    sleep 0.1
  done
done
measure "after a job across 2, its fabric closed" "$(cat "$dir/two/node0/pid")" \
  "$(cat "$dir/two/node1/pid")"
echo
echo "command: tools/bench/idle.sh --seconds $secs"
