#!/usr/bin/env bash
# Make (once) the Python environment the PyTorch tests, the demo and the peer benchmark run under:
# a venv of Debian's /usr/bin/python3 with PyTorch 2.x from PyPI, and print its interpreter.
#
# Why a venv: Debian 12's python3-torch is 1.13 (2022) and Debian's Python refuses a system-wide
# pip ("externally managed"); shardd's users run torch 2.x. The venv has no system site packages,
# so Debian's torch cannot shadow pip's. It lives outside the clone (shared by every clone of the
# user: torch with its CUDA libraries is about 5 GiB) unless SHARD_VENV names another place.
#
# Usage: tools/torch-venv.sh [--peers]     (--peers: also DeepSpeed, for tools/bench/peers.sh)
# Env:   SHARD_VENV    where the venv is (default ${XDG_CACHE_HOME:-~/.cache}/shardd/venv)
#        SHARD_TORCH   the pip requirement for torch (default "torch>=2.4")
# Prints the interpreter's path on stdout (everything else goes to stderr). Idempotent: a venv
# whose torch already meets the requirement is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
peers=0
case ${1:-} in
  --peers) peers=1 ;;
  -h | --help) sed -n '2,14p' "$0"; exit 0 ;;
  "") ;;
  *) echo "torch-venv.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
esac
venv=${SHARD_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/shardd/venv}
want=${SHARD_TORCH:-torch>=2.4}
py=$venv/bin/python

# meets REQUIREMENT...: the venv's packages satisfy every requirement (pip's own resolver says)
meets() {
  [ -x "$py" ] && "$py" - "$@" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
from pip._vendor.packaging.requirements import Requirement
for r in map(Requirement, sys.argv[1:]):
    if not r.specifier.contains(version(r.name), prereleases=True):
        sys.exit(1)
EOF
}
need=("$want" numpy matplotlib)
[ "$peers" = 1 ] && need+=(deepspeed)
if meets "${need[@]}"; then
  echo "$py"
  exit 0
fi
tools/deps.sh python3-venv >&2
if [ ! -x "$py" ]; then
  echo "== making a venv at $venv (Debian's /usr/bin/python3)" >&2
  mkdir -p "$(dirname "$venv")"
  /usr/bin/python3 -m venv "$venv" >&2
fi
echo "== pip install ${need[*]} into $venv (torch's wheel with its libraries: about 5 GiB)" >&2
# pip's own retries; a second whole attempt covers a dropped connection mid-wheel
for attempt in 1 2; do
  if "$py" -m pip install -q --retries 5 "${need[@]}" >&2; then break; fi
  [ $attempt = 2 ] && { echo "torch-venv.sh: pip install ${need[*]} failed twice" >&2; exit 1; }
done
meets "${need[@]}" || { echo "torch-venv.sh: $venv still lacks ${need[*]}" >&2; exit 1; }
"$py" -c 'import torch, sys; print(f"== torch {torch.__version__} under Python {sys.version.split()[0]} ({sys.executable})", file=sys.stderr)'
echo "$py"
