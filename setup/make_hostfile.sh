#!/usr/bin/env bash
# Writes the hostfile from what the hosts report: one "HOST slots=N" line each, N = its GPU count.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: setup/make_hostfile.sh [--help] [--out FILE] [HOST...]

Asks every host over ssh how many GPUs `nvidia-smi -L` lists (a host without GPUs or without
nvidia-smi gets 1 slot) and writes "HOST slots=N" lines to FILE, replacing it at once (never half
written). Hosts come from the arguments, else from the current hostfile; nothing is written when a
host does not answer. Needs BatchMode ssh to every host (setup/setup_ssh.sh).

Environment: HOSTFILE (default setup/hosts.txt; read for the hosts and the default FILE),
SSH_TIMEOUT (connect timeout, default 5 s), HOST_TIMEOUT (limit per host, default 10 s).
USAGE
}
# shellcheck source=setup/common.sh
. "$(dirname "$0")/common.sh"
use_hostfile
out=$HOSTFILE
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --out) [ $# -ge 2 ] || usage_error "--out needs a file"; out=$2; shift 2 ;;
    -*) unknown_option "$1" ;;
    *) break ;;
  esac
done
if [ $# -gt 0 ]; then HOSTS=("$@"); else read_hosts; fi
make_tmp

# shellcheck disable=SC2016 # expanded on the host
count='if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L 2>/dev/null | grep -c "^GPU " || true; else echo 0; fi'
on_all_hosts "$tmp" "$count"
failed=0
{
  echo "# Written by setup/make_hostfile.sh on $(date -u +%Y-%m-%dT%H:%MZ): HOST slots=GPUs (1 without GPUs)."
  for host in "${HOSTS[@]}"; do
    if [ "$(cat "$tmp/$host.rc")" != 0 ]; then
      echo "$PROG: $host: $(why_failed "$tmp" "$host")" >&2
      failed=1
      continue
    fi
    num_gpus=$(head -n 1 "$tmp/$host.out")
    [[ "$num_gpus" =~ ^[0-9]+$ ]] || num_gpus=0
    echo "$PROG: $host: $num_gpus GPU(s)" >&2
    echo "$host slots=$((num_gpus > 0 ? num_gpus : 1))"
  done
} >"$tmp/hostfile"
[ "$failed" = 0 ] || die "left $out as it was: some hosts did not answer"
# A temporary file beside the target, then a rename: readers see the old file or the new one.
cp "$tmp/hostfile" "$out.tmp.$$"
mv -f "$out.tmp.$$" "$out"
echo "$PROG: wrote $out ($(grep -vc '^#' "$out") hosts)"
