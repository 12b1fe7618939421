#!/usr/bin/env bash
# Writes the hostfile from what the hosts report: one "HOST slots=N" line each, N = its GPU count.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: setup/make_hostfile.sh [--help] [--out FILE] [HOST...]

Asks every host over ssh how many GPUs `nvidia-smi -L` lists and writes "HOST slots=N" lines to
FILE, N = the GPU count; a host without GPUs (or without nvidia-smi) keeps the slots the current
hostfile gives it (its CPU ranks: the shipped localhost slots=2 stays), 1 if it lists none. Hosts
come from the arguments (a new file), else from the current hostfile, whose comments and order are
kept. FILE is replaced at once (never half written); nothing is written when a host does not
answer. A host named by loopback (localhost) is asked here, without ssh; the others need BatchMode
ssh (setup/setup_ssh.sh).

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
from_hostfile=1
if [ $# -gt 0 ]; then HOSTS=("$@"); from_hostfile=0; else read_hosts; fi
make_tmp

# shellcheck disable=SC2016 # expanded on the host
count='if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L 2>/dev/null | grep -c "^GPU " || true; else echo 0; fi'
on_all_hosts "$tmp" "$count"
failed=0
: >"$tmp/slots"
for host in "${HOSTS[@]}"; do
  if [ "$(cat "$tmp/$host.rc")" != 0 ]; then
    echo "$PROG: $host: $(why_failed "$tmp" "$host")" >&2
    failed=1
    continue
  fi
  num_gpus=$(head -n 1 "$tmp/$host.out")
  [[ "$num_gpus" =~ ^[0-9]+$ ]] || num_gpus=0
  slots=$num_gpus
  if [ "$num_gpus" = 0 ]; then  # CPU ranks: as many as the hostfile gave it
    slots=$([ -f "$HOSTFILE" ] && awk -v h="$host" '{ sub(/#.*/, "") } $1 == h && match($0, /slots=[0-9]+/) { print substr($0, RSTART + 6, RLENGTH - 6); exit }' "$HOSTFILE")
    slots=${slots:-1}
  fi
  echo "$PROG: $host: $num_gpus GPU(s), slots=$slots" >&2
  echo "$host $slots" >>"$tmp/slots"
done
[ "$failed" = 0 ] || die "left $out as it was: some hosts did not answer"
if [ "$from_hostfile" = 1 ]; then
  # the hostfile's own lines, comments and order kept, each host's slots replaced
  awk 'NR == FNR { slots[$1] = $2; next }
       { line = $0; note = ""; if (match(line, /#.*/)) { note = substr(line, RSTART); line = substr(line, 1, RSTART - 1) } }
       split(line, word) && (word[1] in slots) { $0 = word[1] " slots=" slots[word[1]] (note == "" ? "" : " " note) }
       { print }' "$tmp/slots" "$HOSTFILE" >"$tmp/hostfile"
else
  {
    echo "# Written by setup/make_hostfile.sh on $(date -u +%Y-%m-%dT%H:%MZ): HOST slots=GPUs (CPU hosts: their slots before, else 1)."
    awk '{ print $1 " slots=" $2 }' "$tmp/slots"
  } >"$tmp/hostfile"
fi
# A temporary file beside the target, then a rename: readers see the old file or the new one.
cp "$tmp/hostfile" "$out.tmp.$$"
mv -f "$out.tmp.$$" "$out"
echo "$PROG: wrote $out (${#HOSTS[@]} hosts, $(sum_slots "$out") slots)"
