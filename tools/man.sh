#!/usr/bin/env bash
# Write the man page of a shardd binary from its own --help and --version, so that the page and
# the binary cannot disagree: tools/man.sh BINARY SECTION OUT (the build runs it for shardd(8)
# and shardctl(8) into BUILD/man and installs them; `man -l BUILD/man/shardd.8` reads one).
set -euo pipefail
bin=$1 section=$2 out=$3
name=$(basename "$bin")
version=$("$bin" --version | awk '{print $2}')
help=$("$bin" --help)
# roff: a backslash is \e; a line that starts with . or ' is text, not a request
esc() { sed -e 's/\\/\\e/g' -e "s/^\\([.']\\)/\\\\\\&\\1/"; }
summary="the per-node daemon of shardd, the sharded-training communication service"
[ "$name" = shardctl ] && summary="inspect and operate the shardd daemon of this node"
{
  echo ".TH ${name^^} $section \"\" \"shardd $version\" \"shardd\""
  echo ".SH NAME"
  echo "$name \\- $summary"
  echo ".SH SYNOPSIS"
  echo ".nf"
  printf '%s\n' "$help" | head -1 | sed 's/^usage: //' | esc
  echo ".fi"
  echo ".SH DESCRIPTION"
  echo "The text of \\fB$name \\-\\-help\\fR, which this page is made from:"
  echo ".PP"
  echo ".nf"
  printf '%s\n' "$help" | tail -n +2 | esc
  echo ".fi"
  if [ "$name" = shardd ]; then
    echo ".SH ENVIRONMENT"
    echo ".TP"
    echo ".B NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID"
    echo "systemd's: READY=1, STATUS=, STOPPING=1, and WATCHDOG=1 from the event loop (deploy/README.md)."
    echo ".SH FILES"
    echo ".TP"
    echo ".I /run/shardd/shardd.sock"
    echo "the clients' socket (runtime_dir)."
    echo ".TP"
    echo ".I /etc/shardd/shardd.json"
    echo "the configuration the systemd unit passes with \\-\\-config."
  fi
  echo ".SH SEE ALSO"
  if [ "$name" = shardd ]; then echo "shardctl(8)"; else echo "shardd(8)"; fi
  echo ".PP"
  echo "README.md and docs/ of the source tree: docs/configuration.md (every option),"
  echo "docs/running.md (several nodes), docs/shardctl.md, deploy/README.md."
} > "$out"
