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
# test_deploy_k8s validates deploy/k8s offline against Kubernetes' schemas (PyPI's
# kubernetes-validate, which bundles them), in the same venv
"$py" -c 'import kubernetes_validate' 2>/dev/null || "$py" -m pip install -q kubernetes-validate ||
  echo "note: could not install kubernetes-validate; test_deploy_k8s will say it skips"
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

# what cmake --install of a plain build carries: no test hook, no test variable read
echo "== production build (SHARD_TEST_HOOKS off, its default), installed and checked"
cmake -S . -B build/prod -DCMAKE_BUILD_TYPE=Release -DSHARD_BUILD_TESTS=OFF -DSHARD_WERROR=ON \
      >/dev/null
cmake --build build/prod -j"$jobs" >/dev/null
rm -rf build/prod/install
cmake --install build/prod --prefix "$PWD/build/prod/install" >/dev/null
tools/check-production.sh build/prod/install

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
