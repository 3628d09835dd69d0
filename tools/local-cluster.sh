#!/usr/bin/env bash
# An emulated cluster of shardd daemons on this machine.
#
#   tools/local-cluster.sh start --nodes N --ranks-per-node K --dir DIR [--open | --independent]
#                                [--netns --inter-rate RATE --inter-delay DELAY --mtu BYTES]
#                                [--port PORT] [--shardd PATH] [--gpu-per-node]
#                                [-- shardd options...]
#   tools/local-cluster.sh stop --dir DIR
#   tools/local-cluster.sh link --dir DIR --node I up|down     (netns clusters: cut a node off)
#   tools/local-cluster.sh drop --dir DIR --node I --from J on|off
#                          (netns clusters: node I can no longer send to node J, a blackhole
#                           route, so every connection between them dies: a dead data path
#                           between two members, whose control links go to node 0 and stay up)
#
# start runs N daemons; node i's client socket is DIR/node<i>/shardd.sock and its log
# DIR/node<i>/shardd.log. Without --netns they talk over loopback. With --netns each node gets
# a network namespace (sdN-<i>) with a veth pair into a bridge in the root namespace; the
# node's side of each veth is shaped with tc (RATE like 1gbit, DELAY like 100us), so every
# inter-node byte crosses a shaped link. The links' MTU is 1500 unless --mtu (9000 for the jumbo
# frames of cluster fabrics: the shaped rate counts headers, so the MTU sets the payload's share).
# Trainers of node i must run in its namespace:
#   ip netns exec $(tools/local-cluster.sh netns --dir DIR --node i) ...
# (the socket is a file, so they can also connect from the root namespace). stop kills the
# daemons and removes the namespaces, links and DIR's contents it made. --gpu-per-node: node i
# drives GPU i (--devices i), as one shardd per GPU of a machine with several runs (with
# -- --backend cuda; its trainers then run on GPU i). --open starts an open cluster: every
# daemon gets --nodes 0 and no index or ranks per node (node 0 adds --node 0: the coordinator,
# which numbers the others as they join, in order here); jobs give their own ranks per node.
# --independent starts N independent daemons with no cluster arguments at all (no node count,
# index, ranks per node, coordinator or cluster secret): each knows only itself, and the daemons
# of a job meet through its leader, the daemon of rank 0's node, whose "ip:port" is in
# DIR/node<i>/leader (ranks: SHARD_LEADER=$(cat DIR/node0/leader), or torchrun's MASTER_ADDR in
# namespaces, where every daemon listens on the default port 7701; on loopback node i listens on
# PORT + i). Their jobs need a secret (SHARD_JOB_SECRET_FILE).
# Without --port the coordinator's port is picked below the kernel's ephemeral ports, and picked
# again (the daemons restarted) if something else listens on it.
set -euo pipefail

usage() { sed -n '2,37p' "$0" | sed 's/^# \{0,1\}//'; }

cmd=${1:-}
[ -n "$cmd" ] || { usage; exit 2; }
case $cmd in -h|--help|help) usage; exit 0 ;; esac
shift
state= nodes=2 k=2 dir= netns=0 rate=1gbit delay=0 mtu=1500 port= shardd= shardctl= extra=() node=
gpus=0 open=0 indep=0
from=
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) nodes=$2; shift 2 ;;
    --ranks-per-node) k=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --netns) netns=1; shift ;;
    --inter-rate) rate=$2; shift 2 ;;
    --inter-delay) delay=$2; shift 2 ;;
    --mtu) mtu=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --shardd) shardd=$2; shift 2 ;;
    --shardctl) shardctl=$2; shift 2 ;;
    --node) node=$2; shift 2 ;;
    --from) from=$2; shift 2 ;;
    --gpu-per-node) gpus=1; shift ;;
    --open) open=1; shift ;;
    --independent) indep=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    up|down|on|off) state=$1; shift ;;
    *) echo "local-cluster.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$dir" ] || { echo "local-cluster.sh: --dir is required" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
# a prefix unique to this directory, so several clusters can coexist
tagid=$(printf '%s' "$(realpath -m "$dir")" | cksum | cut -c1-5)
ns() { echo "sd${tagid}-$1"; }
br="sdbr${tagid}"

kill_daemons() {
  if [ -d "$dir" ]; then
    for pidf in "$dir"/node*/pid; do
      [ -f "$pidf" ] || continue
      pid=$(cat "$pidf")
      kill -CONT "$pid" 2>/dev/null || true
      kill -TERM "$pid" 2>/dev/null || true
    done
    for pidf in "$dir"/node*/pid; do
      [ -f "$pidf" ] || continue
      pid=$(cat "$pidf")
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
      rm -f "$pidf"
    done
  fi
}

stop() {
  kill_daemons
  if [ -f "$dir/netns" ]; then
    while read -r n; do ip netns del "$n" 2>/dev/null || true; done <"$dir/netns"
    ip link del "$br" 2>/dev/null || true
    rm -f "$dir/netns"
  fi
}

case $cmd in
  stop) stop; rm -rf "$dir"/node* "$dir/cluster.env"; exit 0 ;;
  netns) [ -n "$node" ] || { echo "--node is required" >&2; exit 2; }; ns "$node"; exit 0 ;;
  link)
    [ -n "$node" ] && [ -n "$state" ] || { echo "link needs --node I and up or down" >&2; exit 2; }
    [ -f "$dir/netns" ] || { echo "link: $dir is not a --netns cluster" >&2; exit 2; }
    ip netns exec "$(ns "$node")" ip link set "sv${tagid}n$node" "$state"
    exit 0 ;;
  drop)
    [ -n "$node" ] && [ -n "$from" ] && [ -n "$state" ] ||
      { echo "drop needs --node I --from J and on or off" >&2; exit 2; }
    [ -f "$dir/netns" ] || { echo "drop: $dir is not a --netns cluster" >&2; exit 2; }
    a=$((200 + tagid % 50)); b=$((tagid % 250))
    verb=add; [ "$state" = on ] || verb=del
    ip netns exec "$(ns "$node")" ip route "$verb" blackhole "10.$a.$b.$((from + 1))/32"
    exit 0 ;;
  start) ;;
  *) usage; exit 2 ;;
esac

[ -n "$shardd" ] || shardd=$here/build/daemon/shardd
[ -n "$shardctl" ] || shardctl=$(dirname "$shardd")/../tools/shardctl
[ -x "$shardd" ] || { echo "local-cluster.sh: $shardd not built (cmake --build build)" >&2; exit 1; }
# the coordinator's port: the one given, or one picked below the kernel's ephemeral range (where
# every daemon's fabric endpoints and outgoing connections take theirs), again if it is taken
port_given=$port
pick_port() {
  local low=32768
  read -r low _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
  [ "$low" -gt 21000 ] || low=40000
  port=$((20000 + RANDOM % (low - 20000)))
}
[ -n "$port" ] || pick_port
mkdir -p "$dir"
stop
coord_ip=127.0.0.1
if [ "$netns" = 1 ]; then
  command -v ip >/dev/null && command -v tc >/dev/null ||
    { echo "local-cluster.sh: --netns needs iproute2 (ip, tc)" >&2; exit 1; }
  # addresses of this cluster's own namespaces: 10.<a>.<b>.<node+1>/24 behind a private bridge
  a=$((200 + tagid % 50)); b=$((tagid % 250))
  ip link add "$br" type bridge
  ip link set "$br" mtu "$mtu" up
  : >"$dir/netns"
  for i in $(seq 0 $((nodes - 1))); do
    n=$(ns "$i")
    ip netns add "$n"
    echo "$n" >>"$dir/netns"
    ip link add "sv${tagid}h$i" type veth peer name "sv${tagid}n$i"
    ip link set "sv${tagid}n$i" netns "$n"
    ip link set "sv${tagid}h$i" mtu "$mtu" master "$br" up
    ip netns exec "$n" ip link set lo up
    # as on training clusters: no slow start after the idle gaps between collectives
    ip netns exec "$n" sysctl -qw net.ipv4.tcp_slow_start_after_idle=0 || true
    ip netns exec "$n" ip addr add "10.$a.$b.$((i + 1))/24" dev "sv${tagid}n$i"
    ip netns exec "$n" ip link set "sv${tagid}n$i" mtu "$mtu" up
    # shape what leaves the node; the delay, if any, on the same qdisc. tbf queues up to 50 ms
    # (6 MB at 1 Gbit/s): with 10 ms, flows to three peers starting at once overflowed it and
    # TCP lost segments at the shaper (20-47 per node in a prefetch.sh run; none with 50 ms)
    if [ "$delay" != 0 ]; then
      modprobe -q sch_netem 2>/dev/null || true
      if ! ip netns exec "$n" tc qdisc add dev "sv${tagid}n$i" root handle 1: netem delay "$delay" \
           rate "$rate" 2>"$dir/tc.err"; then
        echo "local-cluster.sh: --inter-delay needs the kernel's netem qdisc (modprobe sch_netem;" \
             "Ubuntu ships it in linux-modules-extra-$(uname -r))," \
             "and tc said: $(cat "$dir/tc.err"). Without --inter-delay the links are shaped by" \
             "tbf, which every kernel has." >&2
        stop
        exit 1
      fi
    else
      ip netns exec "$n" tc qdisc add dev "sv${tagid}n$i" root tbf rate "$rate" burst 256kb latency 50ms
    fi
  done
  coord_ip="10.$a.$b.1"
fi

# the cluster's secret: every daemon proves it holds it before the others hear it
if [ ! -s "$dir/cluster.key" ]; then
  (umask 077; head -c 32 /dev/urandom >"$dir/cluster.key")
fi
# node $1's daemon exited (a start that cannot succeed need not be waited out)
gone() { ! kill -0 "$(cat "$dir/node$1/pid" 2>/dev/null)" 2>/dev/null; }

start_daemons() {
  for i in $(seq 0 $((nodes - 1))); do
    d="$dir/node$i"
    mkdir -p "$d"
    addr=127.0.0.1
    runner=() gpu=()
    [ "$gpus" = 1 ] && gpu=(--devices "$i")
    if [ "$netns" = 1 ]; then
      addr="10.$a.$b.$((i + 1))"
      runner=(ip netns exec "$(ns "$i")")
    fi
    place=(--nodes "$nodes" --node "$i" --ranks-per-node "$k")
    if [ "$open" = 1 ]; then
      place=(--nodes 0)
      [ "$i" = 0 ] && place+=(--node 0)
    fi
    if [ "$indep" = 1 ]; then # nothing of a cluster: on loopback a peer port of its own
      peer=()
      [ "$netns" = 1 ] || peer=(--peer-port $((port + i)))
      "${runner[@]}" "$shardd" --runtime-dir "$d" --fabric-addr "$addr" "${peer[@]}" "${gpu[@]}" \
        "${extra[@]}" >"$d/shardd.log" 2>&1 &
      echo $! >"$d/pid"
      if [ "$netns" = 1 ]; then echo "$addr:7701"; else echo "$addr:$((port + i))"; fi >"$d/leader"
      continue
    fi
    "${runner[@]}" "$shardd" "${place[@]}" \
      --runtime-dir "$d" --coordinator "$coord_ip:$port" --fabric-addr "$addr" \
      --cluster-secret-file "$dir/cluster.key" "${gpu[@]}" \
      "${extra[@]}" >"$d/shardd.log" 2>&1 &
    echo $! >"$d/pid"
    if [ "$open" = 1 ]; then # numbered in the order they join: node i is the i-th
      for _ in $(seq 300); do
        "$shardctl" --socket "$d/shardd.sock" topology 2>/dev/null | grep -q "^node $i of " && break
        gone 0 && { why="node 0 exited:"; return 1; }
        sleep 0.05
      done
    fi
  done
  for i in $(seq 0 $((nodes - 1))); do
    for _ in $(seq 200); do [ -S "$dir/node$i/shardd.sock" ] || gone "$i" && break; sleep 0.05; done
    [ -S "$dir/node$i/shardd.sock" ] || { why="node $i did not start:"; return 1; }
  done
  # the cluster forms once every node said hello (a single node has nobody to wait for)
  formed() {
    [ "$nodes" -eq 1 ] || [ "$indep" = 1 ] && return 0
    for i in $(seq 0 $((nodes - 1))); do
      "$shardctl" --socket "$dir/node$i/shardd.sock" topology 2>/dev/null | grep -q "cluster formed" ||
        return 1
    done
  }
  for _ in $(seq 300); do formed || gone 0 && break; sleep 0.05; done
  formed || { why="the cluster did not form:"; return 1; }
}

why=
for attempt in 1 2 3 4 5; do
  start_daemons && break
  # a port picked here that something else holds: the daemons go and the cluster starts on
  # another (a port given with --port is the caller's to choose)
  if [ -z "$port_given" ] && [ "$attempt" -lt 5 ] &&
     grep -qs "cannot listen on .*address already in use" "$dir"/node*/shardd.log; then
    kill_daemons
    pick_port
    continue
  fi
  echo "$why"
  tail -n 5 "$dir"/node*/shardd.log
  stop
  exit 1
done
cat >"$dir/cluster.env" <<EOF
NODES=$nodes
RANKS_PER_NODE=$k
OPEN=$open
INDEPENDENT=$indep
PORT=$port
NETNS=$netns
EOF
if [ "$indep" = 1 ]; then
  echo "$nodes independent daemons up in $dir (a job's ranks name its leader:" \
    "SHARD_LEADER=\$(cat $dir/node0/leader))"
elif [ "$open" = 1 ]; then
  echo "open cluster of $nodes nodes up in $dir (coordinator $coord_ip:$port)"
else
  echo "cluster of $nodes nodes x $k ranks up in $dir (coordinator $coord_ip:$port)"
fi
