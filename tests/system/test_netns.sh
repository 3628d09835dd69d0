#!/usr/bin/env bash
# A cluster in network namespaces (tools/local-cluster.sh --netns): trains across shaped veth
# links, then one node's link goes down mid-training. The surviving ranks must fail within
# op_timeout + 1 s naming the operation and the node; the survivors answer shardctl and train a
# new job; the link comes back, the node rejoins, and a job across all three trains; stop
# removes the namespaces. Then a second partition heals into a dead data path between two
# members: node 1 reports node 2 "probing", not up, until the path carries its probe, and a job
# waits for it instead of failing. Skipped with a clear line where namespaces cannot be made.
set -u
ROOT=$1 MLP=$2 SHARDCTL=$3 SHARDD=$4
dir=$(mktemp -d /tmp/shardd-netns-XXXXXX)
pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }
check() { if eval "$1"; then ok; else bad "$2"; fi; }
cleanup() { "$ROOT/tools/local-cluster.sh" stop --dir "$dir" >/dev/null 2>&1; rm -rf "$dir"; }
trap cleanup EXIT

if ! ip netns add "sdprobe$$" 2>/dev/null; then
  echo "SKIP: cannot create network namespaces here (needs root and CAP_SYS_ADMIN)"
  echo "test_netns: 0 passed, 0 failed, 1 skipped"
  exit 77 # ctest reports it as skipped (SKIP_RETURN_CODE)
fi
ip netns del "sdprobe$$"

# --inter-delay shapes with netem: where the kernel has it the cluster starts; where it lacks it,
# start fails saying what to load, and leaves no namespace behind
out=$("$ROOT/tools/local-cluster.sh" start --nodes 2 --ranks-per-node 1 --dir "$dir/delay" --netns \
      --inter-rate 1gbit --inter-delay 100us --shardd "$SHARDD" 2>&1); rc=$?
if [ $rc -eq 0 ]; then
  check 'tc -n "$("$ROOT/tools/local-cluster.sh" netns --dir "$dir/delay" --node 1)" qdisc | grep -q netem' \
    "--inter-delay: no netem qdisc on node 1's link"
  "$ROOT/tools/local-cluster.sh" stop --dir "$dir/delay" >/dev/null 2>&1
else
  check 'grep -q "needs the kernel.s netem qdisc (modprobe sch_netem" <<<"$out" && [ ! -s "$dir/delay/netns" ]' \
    "--inter-delay without netem: rc $rc: $out"
fi

"$ROOT/tools/local-cluster.sh" start --nodes 3 --ranks-per-node 2 --dir "$dir" --netns \
  --inter-rate 1gbit --shardd "$SHARDD" -- --op-timeout-ms 3000 --heartbeat-interval-ms 200 \
  --heartbeat-timeout-ms 1500 >"$dir/start.log" 2>&1
check '[ $? -eq 0 ]' "cluster did not start: $(cat "$dir/start.log")"
ns2=$("$ROOT/tools/local-cluster.sh" netns --dir "$dir" --node 2)
check 'ip netns list | grep -q "$ns2"' "namespace $ns2 missing"

# a short job across the shaped links first: it must train to completion
for r in 0 1 2 3 4 5; do
  "$MLP" --socket "$dir/node$((r / 2))/shardd.sock" --job warm --rank $r --world 6 --plan mics:2 \
    --steps 5 --hidden 128 --quiet >"$dir/warm$r.log" 2>&1 &
  pids[$r]=$!
done
for r in 0 1 2 3 4 5; do wait "${pids[$r]}" || bad "warm-up rank $r failed: $(cat "$dir/warm$r.log")"; done
js=$("$SHARDCTL" --socket "$dir/node0/shardd.sock" --job warm stats --json)
check 'python3 -c "import json,sys; j=json.loads(sys.argv[1])[\"jobs\"][0]; assert j[\"bytes\"][\"inter_node_sent\"] > 0" "$js"' \
  "no inter-node bytes counted over the namespaces"

# each rank records the moment it exits, so that the deadline check below measures the rank and
# not the checks run between one wait and the next
for r in 0 1 2 3 4 5; do
  (
    "$MLP" --socket "$dir/node$((r / 2))/shardd.sock" --job long --rank $r --world 6 --plan zero3 \
      --steps 100000 --hidden 128 --quiet >"$dir/long$r.log" 2>&1
    rc=$?
    date +%s.%N >"$dir/long$r.end"
    exit $rc
  ) &
  pids[$r]=$!
done
sleep 2
t0=$(date +%s.%N)
"$ROOT/tools/local-cluster.sh" link --dir "$dir" --node 2 down
for r in 0 1 2 3; do
  wait "${pids[$r]}"; rc=$?
  took=$(python3 -c "print($(cat "$dir/long$r.end" 2>/dev/null || date +%s.%N) - $t0)")
  check '[ $rc -eq 1 ]' "rank $r exit code $rc after the link went down"
  check 'python3 -c "import sys; sys.exit(0 if $took <= 4.0 else 1)"' "rank $r failed after $took s (op_timeout 3 s)"
  check 'grep -q "node 2" "$dir/long$r.log" && grep -qE "fetch of unit|push of unit|step " "$dir/long$r.log"' \
    "rank $r error does not name the operation and node 2: $(cat "$dir/long$r.log")"
done
for r in 0 1 2 3; do echo "rank $r failed $(python3 -c "print(round($(cat "$dir/long$r.end" 2>/dev/null || echo 0) - $t0, 2))") s after the link went down"; done
echo "rank 0 after the link went down: $(cat "$dir/long0.log")"
for n in 0 1; do
  check '"$SHARDCTL" --socket "$dir/node$n/shardd.sock" status >/dev/null' "node $n does not answer"
done
for r in 0 1 2 3; do
  "$MLP" --socket "$dir/node$((r / 2))/shardd.sock" --job after --rank $r --world 4 --plan mics:4 \
    --steps 3 --hidden 128 --quiet >"$dir/after$r.log" 2>&1 &
  apids[$r]=$!
done
for r in 0 1 2 3; do wait "${apids[$r]}" || bad "new job on the survivors, rank $r: $(cat "$dir/after$r.log")"; done
for p in "${pids[4]}" "${pids[5]}"; do kill $(ps -o pid= --ppid "$p") "$p"; done 2>/dev/null
wait 2>/dev/null
# the link comes back: node 2 rejoins through the coordinator (heartbeat timeout 1.5 s, a
# reconnect every second), every node lists the three up, and a job across all of them trains
"$ROOT/tools/local-cluster.sh" link --dir "$dir" --node 2 up
up_at=$(date +%T.%N)
healed=0
for i in $(seq 1 100); do
  up=1
  for n in 0 1 2; do
    js=$("$SHARDCTL" --socket "$dir/node$n/shardd.sock" topology --json 2>/dev/null)
    python3 -c "import json,sys; t=json.loads(sys.argv[1])['topology']; sys.exit(0 if all(x['state'] in ('up','self') for x in t) and len(t)==3 else 1)" "$js" 2>/dev/null || up=0
  done
  [ $up -eq 1 ] && { healed=1; break; }
  sleep 0.1
done
check '[ $healed -eq 1 ]' "node 2 did not rejoin within 10 s of its link coming back"
# when node 2 installed the new address table, from its log, against the moment the link came up
rejoined_at=$(grep -h "address table installed again" "$dir/node2/shardd.log" | tail -1 | cut -d' ' -f1)
python3 - "$up_at" "$rejoined_at" <<'PY'
import sys
def s(t):
    h, m, x = t.split(":"); return int(h) * 3600 + int(m) * 60 + float(x)
print(f"node 2 rejoined {s(sys.argv[2]) - s(sys.argv[1]):.2f} s after its link came back")
PY
# a job across all three nodes trains at once: a cluster that says it is healthy is
for r in 0 1 2 3 4 5; do
  "$MLP" --socket "$dir/node$((r / 2))/shardd.sock" --job healed --rank $r --world 6 --plan zero3 \
    --steps 3 --hidden 128 --quiet >"$dir/healed$r.log" 2>&1 &
  hpids[$r]=$!
done
bad_ranks=0
for r in 0 1 2 3 4 5; do wait "${hpids[$r]}" || bad_ranks=$((bad_ranks + 1)); done
if [ $bad_ranks -ne 0 ]; then
  for n in 0 1 2; do echo "--- node $n, the last lines of its log:"; tail -n 30 "$dir/node$n/shardd.log"; done
  [ -n "${NETNS_KEEP:-}" ] && cp -r "$dir" "$NETNS_KEEP"
fi
check '[ $bad_ranks -eq 0 ]' "the first job on the healed cluster failed on $bad_ranks ranks; rank 0: $(cat "$dir/healed0.log")"

# A second partition, healed into a dead data path: while node 2 is cut off, node 1 starts
# dropping every packet from it (their control links both go to node 0 and stay up). Once node 2
# rejoins, node 0 sees every node up, but node 1 must not: its probe of node 2's data path gets
# no answer, so it reports node 2 "probing" and resets the connections every second; a job
# across the three waits in its registration instead of running into the dead path, and trains
# once the drop ends.
topo_state() { # node n's view of node m
  "$SHARDCTL" --socket "$dir/node$1/shardd.sock" topology --json 2>/dev/null |
    python3 -c "import json,sys; print([x['state'] for x in json.load(sys.stdin)['topology'] if x['node']==$2][0])" 2>/dev/null
}
"$ROOT/tools/local-cluster.sh" link --dir "$dir" --node 2 down
for i in $(seq 1 60); do [ "$(topo_state 0 2)" = down ] && break; sleep 0.1; done
check '[ "$(topo_state 0 2)" = down ]' "node 0 did not see node 2 go down again"
"$ROOT/tools/local-cluster.sh" drop --dir "$dir" --node 1 --from 2 on
"$ROOT/tools/local-cluster.sh" link --dir "$dir" --node 2 up
for i in $(seq 1 100); do [ "$(topo_state 0 2)" = up ] && break; sleep 0.1; done
check '[ "$(topo_state 0 2)" = up ]' "node 2 did not rejoin the second time"
sleep 1.5
check '[ "$(topo_state 1 2)" = probing ]' "node 1 reports node 2 '$(topo_state 1 2)' while every packet between them is dropped"
t0=$(date +%s.%N)
for r in 0 1 2 3 4 5; do
  "$MLP" --socket "$dir/node$((r / 2))/shardd.sock" --job deadpath --rank $r --world 6 \
    --plan zero3 --steps 3 --hidden 128 --quiet >"$dir/deadpath$r.log" 2>&1 &
  dpids[$r]=$!
done
sleep 3
running=0
for r in 0 1 2 3 4 5; do kill -0 "${dpids[$r]}" 2>/dev/null && running=$((running + 1)); done
check '[ $running -eq 6 ]' "only $running of 6 ranks still wait for the dead path to heal: $(cat "$dir/deadpath0.log")"
"$ROOT/tools/local-cluster.sh" drop --dir "$dir" --node 1 --from 2 off
bad_ranks=0
for r in 0 1 2 3 4 5; do wait "${dpids[$r]}" || bad_ranks=$((bad_ranks + 1)); done
took=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")
check '[ $bad_ranks -eq 0 ]' "the job across the healed dead path failed on $bad_ranks ranks: $(cat "$dir/deadpath0.log")"
check 'grep -q "resetting the fabric connections to it" "$dir/node1/shardd.log"' \
  "node 1 did not reset its connections to node 2"
check '[ "$(topo_state 1 2)" = up ]' "node 1 reports node 2 '$(topo_state 1 2)' once the path works"
echo "a dead data path after a rejoin: node 1 reported node 2 probing, the job waited and trained in $took s once the drop ended"
"$ROOT/tools/local-cluster.sh" stop --dir "$dir"
check '! ip netns list | grep -q "$ns2"' "stop left namespace $ns2 behind"
echo "test_netns: $pass passed, $fail failed"
[ $fail -eq 0 ]
