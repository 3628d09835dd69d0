#!/usr/bin/env bash
# Single-node benchmarks of issue 2: starts a private shardd, runs `shard-bench all`, stops it.
# Usage: tools/bench/single_node.sh [--json] [shard-bench options...]
set -euo pipefail
cd "$(dirname "$0")/../.."
tools/deps.sh >/dev/null
cmake -S . -B build/bench -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/bench -j"$(nproc)" --target shardd shard-bench >/dev/null
dir=$(mktemp -d /tmp/shardd-bench-XXXXXX)
build/bench/daemon/shardd --runtime-dir "$dir/run" --log-level warn >"$dir/shardd.log" 2>&1 &
dpid=$!
trap 'kill $dpid 2>/dev/null; wait $dpid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do [ -S "$dir/run/shardd.sock" ] && break; sleep 0.05; done
build/bench/tools/shard-bench all --socket "$dir/run/shardd.sock" "$@"
