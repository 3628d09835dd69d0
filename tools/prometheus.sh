#!/usr/bin/env bash
# Make (once) Debian's prometheus and promtool available to the suite without installing the
# package, and print the directory that holds them: test_metrics_prometheus scrapes a cluster
# with a real Prometheus and checks the exposition with promtool.
#
# Why not apt-get install: Debian's package enables and starts a Prometheus service on port 9090
# wherever systemd runs, and makes a system user; the suite needs two binaries, so the package
# is downloaded and unpacked (dpkg -x) into a cache outside the clone. A prometheus already on
# PATH is used as it is.
#
# Usage: tools/prometheus.sh            (prints the directory; nothing on stdout if unavailable)
# Env:   SHARD_PROMETHEUS   where it is unpacked (default ${XDG_CACHE_HOME:-~/.cache}/shardd/prometheus)
set -euo pipefail
case ${1:-} in
  -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
esac
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  dirname "$(command -v promtool)"
  exit 0
fi
dir=${SHARD_PROMETHEUS:-${XDG_CACHE_HOME:-$HOME/.cache}/shardd/prometheus}
bin=$dir/usr/bin
if [ -x "$bin/prometheus" ] && [ -x "$bin/promtool" ]; then
  echo "$bin"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1) ||
  { apt-get update -qq >/dev/null 2>&1 && (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1); }; then
  mkdir -p "$dir"
  dpkg -x "$tmp"/prometheus_*.deb "$dir"
  [ -x "$bin/prometheus" ] && echo "$bin"
else
  echo "note: could not download Debian's prometheus; test_metrics_prometheus will say it skips" >&2
fi
