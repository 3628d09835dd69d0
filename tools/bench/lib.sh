# Shared by the benchmark scripts (sourced from the repository root).

# Install what is missing and build the Release tree the benchmarks use; sets B.
bench_build() {
  tools/deps.sh "$@" >/dev/null
  cmake -S . -B build/bench -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build/bench -j"$(nproc)" >/dev/null
  B=build/bench
}

# run_ranks DIR K WORLD JOB MLP_TRAIN_OPTIONS...: WORLD mlp_train ranks of JOB, rank r on the
# daemon of node r / K of the cluster in DIR, logs in DIR/<r>.log; waits for all and exits
# showing the log of a rank that failed.
run_ranks() {
  local dir=$1 k=$2 world=$3 job=$4 r
  shift 4
  local pids=()
  for r in $(seq 0 $((world - 1))); do
    "$B/client/examples/mlp_train" --socket "$dir/node$((r / k))/shardd.sock" --job "$job" \
      --rank "$r" --world "$world" "$@" >"$dir/$r.log" 2>&1 &
    pids[$r]=$!
  done
  for r in "${!pids[@]}"; do
    wait "${pids[$r]}" || { echo "rank $r failed:" >&2; cat "$dir/$r.log" >&2; exit 1; }
  done
}
