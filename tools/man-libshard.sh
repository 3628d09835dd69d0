#!/usr/bin/env bash
# Write libshard(3) from the two places the C API is described, so that the page cannot
# disagree with them: the prototypes of client/include/shard.h (SYNOPSIS) and the table of
# docs/c-api.md (DESCRIPTION, a tagged paragraph per row). The build runs it into BUILD/man and
# installs the page; test_man checks that every SHARD_API function is in it.
#   tools/man-libshard.sh SOURCE_DIR VERSION OUT
set -euo pipefail
src=$1 version=$2 out=$3
header=$src/client/include/shard.h
table=$src/docs/c-api.md
# roff: a backslash is \e; a line that starts with . or ' is text, not a request
esc() { sed -e 's/\\/\\e/g' -e "s/^\\([.']\\)/\\\\\\&\\1/"; }
# markdown's `code` as bold, **strong** as bold
md() { esc | sed -e 's/`\([^`]*\)`/\\fB\1\\fR/g' -e 's/\*\*\([^*]*\)\*\*/\\fB\1\\fR/g'; }
{
  echo ".TH LIBSHARD 3 \"\" \"shardd $version\" \"shardd\""
  echo ".SH NAME"
  echo "libshard \\- the client library of shardd: attach a training rank to its node's daemon"
  echo ".SH SYNOPSIS"
  echo ".nf"
  echo ".B #include <shard.h>"
  echo ".PP"
  # every SHARD_API declaration, joined onto one line each
  awk '/^SHARD_API /{d=$0; while (d !~ /;/ && (getline l) > 0) { sub(/^ +/, " ", l); d = d l }
        sub(/^SHARD_API /, "", d); print d}' "$header" | esc
  echo ".fi"
  echo ".PP"
  echo "Link with \\fB\\-lshard\\fR (pkg-config \\fBshard\\fR)."
  echo ".SH DESCRIPTION"
  echo "Every call returns 0 or a negative status (\\fBshard_strerror\\fR names it;"
  echo "\\fBshard_last_error\\fR says what was wrong); none aborts the process on bad input."
  echo "The calls, as docs/c-api.md describes them:"
  # the table's rows: | call | what it does |
  awk -F' \\| ' '/^\| `/ { call = $1; sub(/^\| /, "", call); what = $0;
                           sub(/^\| [^|]*\| /, "", what); sub(/ \|$/, "", what);
                           print "@TP@"; print call; print what }' "$table" | md |
    sed 's/^@TP@$/.TP/'
  echo ".SH SEE ALSO"
  echo "shardd(8), shardctl(8)"
  echo ".PP"
  echo "docs/c-api.md, docs/pytorch.md and client/examples/mlp_train.c of the source tree."
} > "$out"
