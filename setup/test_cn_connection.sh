#!/usr/bin/env bash
# One table of what every host has (GPUs, Python packages in the project's .venv, free disk), and a
# non-zero exit naming each host that cannot be reached or whose versions differ from the first's.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: setup/test_cn_connection.sh [--help] [HOSTFILE]

Logs in to every host of the hostfile at once (BatchMode, so it never waits for a password) and
prints hostname, GPUs (name, memory, driver from nvidia-smi), the python, torch, deepspeed and timm
versions of the project's .venv (at this checkout's path on every host) and the free disk there.
Exits 1 naming each host that did not answer within HOST_TIMEOUT or whose versions differ from
the first host's.

Environment: HOSTFILE (default setup/hosts.txt), SSH_TIMEOUT (connect timeout, default 5 s),
HOST_TIMEOUT (limit per host, default 10 s).
USAGE
}
# shellcheck source=setup/common.sh
. "$(dirname "$0")/common.sh"
hostfile_opening "$@"

# Prints "key value" lines. Versions come from package metadata: importing torch would take seconds.
# shellcheck disable=SC2016 # expanded on the host
facts='root=$1
echo "hostname $(hostname)"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed "s/^/gpu /"
fi
if [ -x "$root/.venv/bin/python" ]; then
  "$root/.venv/bin/python" -c "
import importlib.metadata as md, platform
print(\"python\", platform.python_version())
for p in (\"torch\", \"deepspeed\", \"timm\"):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, \"missing\")"
else
  echo "python no-venv"
fi
echo "disk $(df -Pk "$root" | awk "NR == 2 { printf \"%.0fG\", \$4 / 1048576 }")"'
on_all_hosts "$tmp" "$facts" "$ROOT"

fact() { awk -v k="$2" '$1 == k { sub(/^[^ ]+ /, ""); print; exit }' "$tmp/$1.out"; }
gpus() {
  local lines
  lines=$(awk '$1 == "gpu" { sub(/^gpu /, ""); print }' "$tmp/$1.out")
  [ -n "$lines" ] || { echo none; return; }
  # "NAME, MEM MiB, DRIVER" lines -> "2x NAME (MEM MiB), driver DRIVER"; mixed GPUs are listed each.
  sort <<<"$lines" | uniq -c | awk -F', ' '{ n = $1 + 0; sub(/^ *[0-9]+ /, "", $1);
    printf "%s%dx %s (%s), driver %s", sep, n, $1, $2, $3; sep = "; " }'
}

problems=()
ref=""
keys=(python torch deepspeed timm)
table="$tmp/table.tsv"
printf 'HOST\tHOSTNAME\tPYTHON\tTORCH\tDEEPSPEED\tTIMM\tDISK_FREE\tGPUS\n' >"$table"
for host in "${HOSTS[@]}"; do
  if [ "$(cat "$tmp/$host.rc")" != 0 ]; then
    problems+=("$host: unreachable: $(why_failed "$tmp" "$host")")
    printf '%s\t-\t-\t-\t-\t-\t-\tUNREACHABLE\n' "$host" >>"$table"
    continue
  fi
  row=("$host")
  for k in hostname "${keys[@]}" disk; do
    v=$(fact "$host" "$k")
    row+=("${v:--}")
  done
  row+=("$(gpus "$host")")
  (IFS=$'\t'; echo "${row[*]}") >>"$table"
  if [ "${row[2]}" = no-venv ]; then
    problems+=("$host: no project environment at $ROOT/.venv")
  elif [ -z "$ref" ]; then
    ref=$host
    ref_row=("${row[@]}")
  else
    for i in "${!keys[@]}"; do
      if [ "${row[i + 2]}" != "${ref_row[i + 2]}" ]; then
        problems+=("$host: ${keys[i]} ${row[i + 2]} differs from $ref's ${ref_row[i + 2]}")
      fi
    done
  fi
done
awk -F '\t' '{ for (i = 1; i <= NF; i++) { cell[NR, i] = $i; if (length($i) > w[i]) w[i] = length($i) } }
  END { for (r = 1; r <= NR; r++) { line = ""
          for (i = 1; i < 8; i++) line = line sprintf("%-" w[i] + 2 "s", cell[r, i])
          print line cell[r, 8] } }' "$table"
if [ "${#problems[@]}" -gt 0 ]; then
  printf '%s: %d problem(s):\n' "$PROG" "${#problems[@]}" >&2
  printf '  %s\n' "${problems[@]}" >&2
  exit 1
fi
echo "$PROG: ok: ${#HOSTS[@]} host(s) reachable, same versions as $ref"
