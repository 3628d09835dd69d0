#!/usr/bin/env bash
# Install the Debian packages shardd needs to build and test, if any are missing. Idempotent.
# Waits (bounded: LOCK_WAIT seconds, 600) while another apt-get holds the lock.
# Usage: tools/deps.sh [extra-package ...]
#        tools/deps.sh --optional package ...   (try; a failure only prints a line)
set -euo pipefail
optional=0
if [ "${1:-}" = --optional ]; then optional=1; shift; need=("$@"); else
need=(build-essential cmake pkg-config libuv1-dev libfabric-dev libprotobuf-c-dev libssl-dev
      protobuf-c-compiler libjansson-dev python3 iproute2 "$@"); fi
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing: ${missing[*]}"
SUDO=
[ "$(id -u)" -ne 0 ] && SUDO=sudo
# apt_get ARGS...: apt-get, waiting (at most LOCK_WAIT s, 600 by default) while another apt-get
# or unattended-upgrades holds dpkg's or the package lists' lock, instead of failing at once
apt_get() {
  local deadline=$((SECONDS + ${LOCK_WAIT:-600})) out said=0
  while :; do
    if out=$(DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=30 "$@" 2>&1)
    then
      [ -z "$out" ] || printf '%s\n' "$out"
      return 0
    fi
    if ! grep -q "Could not get lock\|Unable to lock\|Unable to acquire" <<<"$out" ||
      [ $SECONDS -ge $deadline ]; then
      printf '%s\n' "$out" >&2
      return 1
    fi
    [ $said = 1 ] || echo "deps.sh: another apt-get holds the lock; waiting for it" \
      "(at most ${LOCK_WAIT:-600} s)" >&2
    said=1
    sleep 5
  done
}
if [ "$optional" = 1 ]; then
  { apt_get update -qq &&
    apt_get install -y -qq --no-install-recommends "${missing[@]}"; } >/dev/null 2>&1 ||
    echo "note: could not install ${missing[*]}; the tests that need them will say they skip"
  exit 0
fi
apt_get update -qq
apt_get install -y -qq --no-install-recommends "${missing[@]}"
