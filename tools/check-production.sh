#!/usr/bin/env bash
# What a production install carries (issue 61): no test hook (no SHARDD_TEST_ string in any
# installed binary or library), shardd --help says nothing of test hooks, and SHARDD_EMU_* is
# ignored (the emulation is one GPU, whatever SHARDD_EMU_GPUS says). tools/test.sh runs it on a
# plain build (the option SHARD_TEST_HOOKS off, its default) installed with cmake --install.
#   tools/check-production.sh PREFIX
set -uo pipefail
prefix=${1:?usage: tools/check-production.sh PREFIX (where cmake --install put the build)}
fail=0
files=$(find "$prefix" -type f \( -perm -u+x -o -name '*.so*' -o -name '*.a' \) | sort)
[ -n "$files" ] || { echo "check-production: nothing installed under $prefix" >&2; exit 1; }
for f in $files; do
  if grep -q -a "SHARDD_TEST_" "$f"; then
    echo "FAIL: $f carries a test hook: $(grep -a -o 'SHARDD_TEST_[A-Z_]*' "$f" | sort -u | tr '\n' ' ')"
    fail=1
  fi
done
shardd=$prefix/sbin/shardd
[ -x "$shardd" ] || { echo "FAIL: no $shardd"; exit 1; }
if "$shardd" --help | grep -q "test hooks"; then
  echo "FAIL: $shardd --help says it has test hooks"
  fail=1
fi
run=$(mktemp -d)
out=$(SHARDD_EMU_GPUS=4 timeout 30 "$shardd" --backend emu-gpu --devices 1 --runtime-dir "$run" 2>&1)
rc=$?
rm -rf "$run"
if [ $rc -ne 2 ] || ! grep -q "the emulation sees 1" <<<"$out"; then
  echo "FAIL: SHARDD_EMU_GPUS=4 was not ignored (exit $rc): $out"
  fail=1
fi
n=$(wc -w <<<"$files")
[ $fail = 0 ] && echo "check-production: $n installed files carry no test hook; SHARDD_EMU_* ignored"
exit $fail
