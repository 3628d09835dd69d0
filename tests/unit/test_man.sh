#!/usr/bin/env bash
# The man pages the build makes (tools/man.sh, from --help; tools/man-libshard.sh, from shard.h
# and docs/c-api.md): groff reads them without a warning, shardd(8) names every option of
# common/config.c's table, shardctl(8) every command, libshard(3) every SHARD_API function in
# its synopsis and its description.
# usage: test_man.sh SOURCE_DIR BUILD_DIR
set -uo pipefail
src=$1 build=$2 failed=0 passed=0
check() { if eval "$1"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: $2"; fi; }
if ! command -v groff >/dev/null; then
  echo "SKIP: groff is not installed (tools/test.sh installs groff-base)"; exit 77
fi
for page in shardd shardctl; do
  f=$build/man/$page.8
  check "[ -s '$f' ]" "$f was not made"
  warn=$(groff -man -ww -z "$f" 2>&1)
  check "[ -z \"\$warn\" ]" "groff warns on $page.8: $warn"
  text=$(groff -man -Tutf8 "$f" 2>/dev/null | sed 's/.\x08//g')
  check "grep -q '^NAME' <<<\"\$text\"" "$page.8 renders without a NAME section"
done
text=$(groff -man -Tutf8 "$build/man/shardd.8" 2>/dev/null | sed 's/.\x08//g')
n=0
while read -r opt; do
  n=$((n + 1))
  check "grep -q -- ' $opt ' <<<\"\$text\"" "shardd.8 does not name the option $opt"
done < <(sed -n 's/^    {"\([a-z_0-9]*\)", SD_CFG_.*/\1/p' "$src/common/config.c")
check "[ $n -gt 40 ]" "the options of common/config.c were not read ($n)"
text=$(groff -man -Tutf8 "$build/man/shardctl.8" 2>/dev/null | sed 's/.\x08//g')
for cmd in status jobs groups topology stats schedule plan checkpoint drop; do
  check "grep -q -- '  $cmd ' <<<\"\$text\"" "shardctl.8 does not name the command $cmd"
done
# libshard(3), from shard.h and docs/c-api.md: groff reads it, and every SHARD_API function of
# the header is in its synopsis and described (a row of docs/c-api.md names it)
f=$build/man/libshard.3
check "[ -s '$f' ]" "$f was not made"
warn=$(groff -man -ww -z "$f" 2>&1)
check "[ -z \"\$warn\" ]" "groff warns on libshard.3: $warn"
# (the page's source: the rendered text hyphenates long names)
synopsis=$(sed -n '/^\.SH SYNOPSIS/,/^\.SH DESCRIPTION/p' "$f")
described=$(sed -n '/^\.SH DESCRIPTION/,$p' "$f")
n=0
while read -r fn; do
  n=$((n + 1))
  check "grep -q -- '[ *]$fn(' <<<\"\$synopsis\"" "libshard.3's synopsis lacks $fn"
  check "grep -q -- '$fn' <<<\"\$described\"" "libshard.3 (docs/c-api.md) does not describe $fn"
done < <(sed -n 's/^SHARD_API [^(]*[ *]\(shard_[a-z_0-9]*\)(.*/\1/p' "$src/client/include/shard.h")
check "[ $n -gt 40 ]" "the functions of shard.h were not read ($n)"
echo "test_man: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
