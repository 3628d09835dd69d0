#!/usr/bin/env bash
# Install the Debian packages shardd needs to build and test, if any are missing. Idempotent.
# Usage: tools/deps.sh [extra-package ...]
set -euo pipefail
need=(build-essential cmake pkg-config libuv1-dev libfabric-dev libprotobuf-c-dev
      protobuf-c-compiler libjansson-dev python3 iproute2 "$@")
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing: ${missing[*]}"
SUDO=
[ "$(id -u)" -ne 0 ] && SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
