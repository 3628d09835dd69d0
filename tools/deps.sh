#!/usr/bin/env bash
# Install the Debian packages shardd needs to build and test, if any are missing. Idempotent.
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
if [ "$optional" = 1 ]; then
  { $SUDO apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      "${missing[@]}"; } >/dev/null 2>&1 ||
    echo "note: could not install ${missing[*]}; the tests that need them will say they skip"
  exit 0
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
