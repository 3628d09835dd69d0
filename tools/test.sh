#!/usr/bin/env bash
# Install what is missing, build with warnings as errors, run the whole suite through ctest,
# then build with AddressSanitizer + UndefinedBehaviorSanitizer and run the suite again.
# Exits non-zero on any failure. SHARD_SKIP_ASAN=1 skips the sanitizer pass.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/deps.sh
# the Python tests run under PyTorch 2.x from PyPI, in a venv of Debian's Python (Debian 12's own
# torch is 1.13 and its Python refuses a system pip): tools/torch-venv.sh says why and where
py=$(tools/torch-venv.sh)
# test_readme makes the README's venv with Debian's python3 -m venv (python3-venv)
tools/deps.sh --optional python3-venv python3-matplotlib
echo "== Python tests under $("$py" -c 'import torch, sys; print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")') ($py)"
tools/deps.sh --optional clang libclang-rt-14-dev   # test_fuzz (libFuzzer harnesses)
tools/deps.sh --optional groff-base                 # test_man (the man pages read by groff)
tools/prometheus.sh >/dev/null || true             # test_metrics_prometheus (unpacked, not installed)
jobs=$(nproc)
t0=$(date +%s)
# the CUDA backend is built (warnings as errors) wherever nvcc is; the HIP one where hipcc is
gpu=()
if [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null; then
  gpu+=(-DSHARD_CUDA=ON)
fi

echo "== build (-Werror)"
cmake -S . -B build/ci -DSHARD_WERROR=ON -DSHARD_TEST_HOOKS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DSHARD_PYTHON="$py" "${gpu[@]}" >/dev/null
cmake --build build/ci -j"$jobs"
echo "== test"
(cd build/ci && ctest --output-on-failure -j"$jobs")

if [ "${SHARD_SKIP_ASAN:-0}" != 1 ]; then
  echo "== build (ASan + UBSan)"
  cmake -S . -B build/asan -DSHARD_WERROR=ON -DSHARD_SANITIZE=ON -DSHARD_TEST_HOOKS=ON \
        -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHARD_PYTHON="$py" "${gpu[@]}" >/dev/null
  cmake --build build/asan -j"$jobs"
  echo "== test (ASan + UBSan)"
  (cd build/asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
     UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest --output-on-failure -j"$jobs")
fi

if command -v clang-format >/dev/null; then
  unformatted=$(git ls-files '*.c' '*.h' | xargs clang-format --dry-run 2>&1 | grep -c warning || true)
  [ "$unformatted" -eq 0 ] || echo "note: $unformatted clang-format findings (run clang-format -i)"
fi
echo "== all tests passed in $(( $(date +%s) - t0 )) s"
