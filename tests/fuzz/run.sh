#!/usr/bin/env bash
# Build the libFuzzer harnesses with clang (AddressSanitizer + UndefinedBehaviorSanitizer) and run
# each for SECONDS on its corpus (tests/fuzz/corpus/<harness>, new inputs in a scratch copy).
#   tests/fuzz/run.sh BUILD_DIR SECONDS [frame model plan]
# BUILD_DIR is a configured build tree (its proto/ holds the generated shard.pb-c.c). A unit may
# take 120 s of wall time (libFuzzer's clock is wall time: on a loaded 2-core machine a 10 s limit
# fired on inputs that take 0.1 s of CPU). Exits 77
# with a line saying so when clang's libFuzzer runtime (Debian: clang, libclang-rt-14-dev) is
# missing; non-zero when a harness finds a crash, a leak or a broken invariant (the input is
# left in the scratch directory, named in the output).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:?usage: run.sh BUILD_DIR SECONDS [harness...]}
secs=${2:?usage: run.sh BUILD_DIR SECONDS [harness...]}
shift 2
harnesses=("$@")
[ ${#harnesses[@]} -eq 0 ] && harnesses=(frame model plan)
build=$(cd "$build" && pwd)
cc=$(command -v clang || command -v clang-14 || true)
if [ -z "$cc" ] || ! echo 'int LLVMFuzzerTestOneInput(const char *d, long n){(void)d;(void)n;return 0;}' |
     "$cc" -x c -fsanitize=fuzzer - -o /dev/null 2>/dev/null; then
  echo "SKIP: no clang with libFuzzer here (install clang and libclang-rt-14-dev); fuzzers not run"
  exit 77
fi
out=$(mktemp -d /tmp/shardd-fuzz-XXXXXX)
src=("$root/common/model.c" "$root/common/util.c" "$root/common/status.c"
     "$root/proto/model_msg.c" "$build/proto/shard.pb-c.c")
flags=(-g -O1 -D_GNU_SOURCE -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -I"$root/common/include" -I"$root/proto/include" -I"$build/proto")
status=0
for h in "${harnesses[@]}"; do
  "$cc" "${flags[@]}" "$here/fuzz_$h.c" "${src[@]}" -lprotobuf-c -lm -o "$out/fuzz_$h"
  mkdir -p "$out/corpus_$h"
  cp -r "$here/corpus/$h/." "$out/corpus_$h/" 2>/dev/null || true
  echo "== fuzz_$h for ${secs}s"
  if ! (cd "$out" && ASAN_OPTIONS=detect_leaks=1 "./fuzz_$h" -max_total_time="$secs" \
          -max_len=65536 -timeout=120 -rss_limit_mb=2048 -print_final_stats=1 "corpus_$h" \
          2>"$out/fuzz_$h.log"); then
    echo "fuzz_$h FAILED: see $out/fuzz_$h.log"
    tail -40 "$out/fuzz_$h.log"
    status=1
    continue
  fi
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb|cov: " "$out/fuzz_$h.log" | tail -3
done
[ $status -eq 0 ] && rm -rf "$out"
exit $status
