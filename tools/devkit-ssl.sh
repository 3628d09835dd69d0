#!/usr/bin/env bash
# Run HERE (the Debian machine, root), in the project's root, after ../shared/device/debs.sh:
# adds Debian's libssl-dev and libssl3 to .devkit/debs, which the GPU machine's build needs for
# libcrypto (an independent daemon's Ed25519 key, daemon/cluster/meet_key.c) and which the
# kit's list predates. Idempotent. Then carry .devkit with the tree, as the kit's README says.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .devkit/debs ] || { echo "devkit-ssl: no .devkit/debs: run ../shared/device/debs.sh first" >&2; exit 2; }
cd .devkit/debs
if ls libssl-dev_*.deb libssl3_*.deb >/dev/null 2>&1; then
  echo "devkit-ssl: libssl-dev and libssl3 are in .devkit/debs already"
  exit 0
fi
apt-get download -qq libssl-dev libssl3 2>&1 | grep -v '^W:' || true
ls libssl-dev_*.deb libssl3_*.deb
