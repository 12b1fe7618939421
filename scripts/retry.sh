#!/usr/bin/env bash
# Runs a training command and, when it fails, relaunches it from the run's newest complete checkpoint.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: scripts/retry.sh [-n RETRIES] -- COMMAND [ARGS...]

Runs COMMAND (a launch of entry_cn.sh, e.g. mpirun ... ./entry_cn.sh ...). If it exits non-zero, runs
it again, up to RETRIES more times (default $RETRIES or 3), adding --resume once the run has a
complete checkpoint (a <save-dir>/step*/manifest.json). COMMAND must name the run's folder with
--log-dir (or --save-dir) so that a relaunch finds its checkpoints. Exits with COMMAND's last status.

  scripts/retry.sh -n 3 -- mpirun -np 5 --hostfile setup/hosts.txt ./entry_cn.sh \
      --log-dir logs/vit-b --save-interval 200
USAGE
}

retries=${RETRIES:-3}
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    -n) retries=${2:?retry.sh: -n needs a number}; shift 2 ;;
    --) shift; break ;;
    *) echo "retry.sh: unknown option '$1' (the command goes after --)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "retry.sh: no command given (see --help)" >&2; exit 2; }
case "$retries" in ''|*[!0-9]*) echo "retry.sh: -n must be a whole number, got '$retries'" >&2; exit 2 ;; esac

save_dir=""
log_dir=""
has_resume=0
prev=""
for arg in "$@"; do
  case "$prev" in --save-dir) save_dir=$arg ;; --log-dir) log_dir=$arg ;; esac
  case "$arg" in --save-dir=*) save_dir=${arg#*=} ;; --log-dir=*) log_dir=${arg#*=} ;; --resume*) has_resume=1 ;; esac
  prev=$arg
done
[ -n "$save_dir" ] || { [ -n "$log_dir" ] && save_dir="$log_dir/checkpoints"; }
if [ -z "$save_dir" ]; then
  echo "retry.sh: the command needs --log-dir or --save-dir, so that a relaunch can find its checkpoints" >&2
  exit 2
fi

attempt=0
while true; do
  attempt=$((attempt + 1))
  cmd=("$@")
  if [ "$has_resume" = 0 ] && compgen -G "$save_dir/step*/manifest.json" >/dev/null; then
    cmd+=(--resume)
  fi
  echo "retry.sh: attempt $attempt of $((retries + 1)): ${cmd[*]}" >&2
  status=0
  "${cmd[@]}" || status=$?
  if [ "$status" = 0 ]; then
    exit 0
  fi
  if [ "$attempt" -gt "$retries" ]; then
    echo "retry.sh: giving up after $attempt attempts; the last exited with $status" >&2
    exit "$status"
  fi
  echo "retry.sh: attempt $attempt exited with $status; relaunching from the newest complete checkpoint in $save_dir" >&2
done
