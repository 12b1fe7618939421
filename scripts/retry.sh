#!/usr/bin/env bash
# Runs a training command and, when it fails in a way a relaunch can fix, relaunches it from the run's
# newest complete checkpoint.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: scripts/retry.sh [-n RETRIES] -- COMMAND [ARGS...]

Runs COMMAND (a launch of entry_cn.sh, e.g. mpirun ... ./entry_cn.sh ...). If it fails, runs it again,
up to RETRIES more times (default $RETRIES or 3), adding --resume once the run has a complete
checkpoint: <save-dir>/step<N>/manifest.json, where <save-dir> is --save-dir, else <log-dir>/checkpoints
(<save-dir>/latest names the newest). Each relaunch names the checkpoint it resumes from, or says that
it starts over because there is none yet. COMMAND must name the run's folder with --log-dir (or
--save-dir) so that a relaunch finds its checkpoints. Exits with COMMAND's last status.

Exit status 2 is not retried: it is entry_cn.sh's configuration or usage error (an "entry_cn.sh: error:"
line, printed before anything is written), which a relaunch would only repeat; retry.sh then exits 2.

Under mpirun: Open MPI 5's mpirun ends the job at the first rank that exits non-zero and exits with
that rank's status (measured with Open MPI 5.0.11):
  - every rank exits 2: mpirun exits 2, not retried;
  - one rank of entry_cn.sh has a configuration error, the others none: 2 as well, not retried (that
    rank stops before the others can start without it, so its exit is the first mpirun sees); but in
    2 of 17 such runs on a busy machine mpirun hung instead ("PMIX ERROR: PMIX_ERR_UNREACH"), with
    the other rank waiting, and a hang is nothing retry.sh can see;
  - one rank exits 2 and another 1 at the same moment: mpirun exits with whichever status it saw
    first, 2 or 1 (both happen). A 1 is retried; the relaunch then stops at the configuration error
    with 2, as above;
  - a rank killed by a signal: 128 + the signal (137 for SIGKILL), retried.

  scripts/retry.sh -n 3 -- mpirun -np 5 --hostfile setup/hosts.txt ./entry_cn.sh \
      --log-dir logs/vit-b --save-interval 200
USAGE
}

# shellcheck source=setup/common.sh
. "$(dirname "$0")/../setup/common.sh"
retries=${RETRIES:-3}
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    -n) [ $# -ge 2 ] && [[ "$2" != -* ]] || usage_error "-n needs a number"; retries=$2; shift 2 ;;
    --) shift; break ;;
    *) unknown_option "$1" "the command goes after --" ;;
  esac
done
case "$retries" in ''|*[!0-9]*) usage_error "-n must be a whole number, got '$retries'" ;; esac
[ $# -gt 0 ] || usage_error "no command given"

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
[ -n "$save_dir" ] || usage_error "the command needs --log-dir or --save-dir, so that a relaunch can find its checkpoints"

# newest_checkpoint: the folder of the newest complete checkpoint, or nothing. Complete means it has
# its manifest; the highest step wins, as for entry_cn.sh --resume (which also verifies the files).
newest_checkpoint() {
  local manifest tag best="" best_step=-1
  for manifest in "$save_dir"/step*/manifest.json; do
    [ -f "$manifest" ] || continue
    tag=$(basename "$(dirname "$manifest")")
    [[ "${tag#step}" =~ ^[0-9]+$ ]] || continue
    if [ "${tag#step}" -gt "$best_step" ]; then
      best_step=${tag#step}
      best=$(dirname "$manifest")
    fi
  done
  echo "$best"
}

attempt=0
while true; do
  attempt=$((attempt + 1))
  cmd=("$@")
  checkpoint=$(newest_checkpoint)
  if [ "$has_resume" = 0 ] && [ -n "$checkpoint" ]; then
    cmd+=(--resume)
  fi
  echo "$PROG: attempt $attempt of $((retries + 1)): ${cmd[*]}" >&2
  status=0
  "${cmd[@]}" || status=$?
  [ "$status" != 0 ] || exit 0
  if [ "$status" = 2 ]; then
    echo "$PROG: attempt $attempt exited with 2, a configuration or usage error (see above): not retrying," \
      "a relaunch would fail the same way" >&2
    exit 2
  fi
  if [ "$attempt" -gt "$retries" ]; then
    echo "$PROG: giving up after $attempt attempts; the last exited with $status" >&2
    exit "$status"
  fi
  checkpoint=$(newest_checkpoint)
  if [ -n "$checkpoint" ]; then
    echo "$PROG: attempt $attempt exited with $status; relaunching from checkpoint $checkpoint" >&2
  else
    echo "$PROG: attempt $attempt exited with $status; starting over: no complete checkpoint in $save_dir yet" >&2
  fi
done
