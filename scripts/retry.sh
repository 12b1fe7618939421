#!/usr/bin/env bash
# Runs a training command and, when it fails in a way a relaunch can fix, relaunches it from the run's
# newest complete checkpoint.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: scripts/retry.sh [-n RETRIES] [--hostfile FILE [--min-hosts N] [--wait S]] -- COMMAND [ARGS...]

Runs COMMAND (a launch of entry_cn.sh, e.g. mpirun ... ./entry_cn.sh ...). If it fails, runs it again,
up to RETRIES more times (default $RETRIES or 3), adding --resume once the run has a complete
checkpoint: <save-dir>/step<N>/manifest.json, where <save-dir> is --save-dir, else <log-dir>/checkpoints
(<save-dir>/latest names the newest). Each relaunch names the checkpoint it resumes from, or says that
it starts over because there is none yet. COMMAND must name the run's folder with --log-dir (or
--save-dir) so that a relaunch finds its checkpoints. Exits with COMMAND's last status.

--hostfile FILE: before each attempt, every host of FILE is asked over ssh (the options setup/ uses,
5 s to answer); a host that does not answer is left out of this attempt, named in one line, and taken
back at a later attempt once it answers again. In COMMAND's launcher part (the arguments before
entry_cn.sh), FILE (--hostfile FILE, --hostfile=FILE, -machinefile FILE: any path to the same file)
is replaced by a hostfile of the hosts that answer and, when a host is missing, the value of -np (or
-n, --np) cut to their slots (kept when every host answers); entry_cn.sh, resumed on fewer ranks, keeps the global batch (the gradient
accumulation follows; unequal shares where the ranks do not divide it) and says so. With a host
missing, entry_cn.sh's --pipeline-stages N (or =N), where N does not divide those ranks, becomes the
largest stage count that does (the resume restages the checkpoint), in one line. With fewer than
--min-hosts answering (default 1), retry.sh stops, exit 1, naming them.

Exit status 3 is entry_cn.sh's "this checkpoint cannot go on on these ranks" (a pipeline checkpoint
whose stages do not divide them and cannot be restaged). With a host missing, retry.sh waits --wait
seconds (default $RETRY_WAIT_S or 60) for it to come back and tries again, up to RETRIES; without
--hostfile, or with every host answering, a relaunch would fail the same way: it exits 3.

Exit status 0 ends it once the run has finished: with --log-dir, once this attempt wrote its
summary.json (newer than the attempt's start: an older one is a run this one extends), or wrote
nothing at all beside an existing one (entry_cn.sh found the run complete: "nothing to do"). Open
MPI's mpirun exits 0 when it loses a host's daemon and ends the job; --export runs write no summary
and are not checked.

Ctrl-C (SIGINT) or SIGTERM while COMMAND runs ends retry.sh once COMMAND has stopped: one line, no
relaunch, exit 130 (143 for SIGTERM). A COMMAND that exits 130 (mpirun after Ctrl-C) is not relaunched
either.

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

  scripts/retry.sh -n 3 --hostfile setup/hosts.txt --min-hosts 3 -- \
      scripts/mpirun -np 5 --hostfile setup/hosts.txt ./entry_cn.sh --log-dir logs/vit-b --save-interval 200
USAGE
}

# shellcheck source=setup/common.sh
. "$(dirname "$0")/../setup/common.sh"
retries=${RETRIES:-3}
wait_s=${RETRY_WAIT_S:-60}
hostfile=""
min_hosts=1
missing=0  # hosts of --hostfile that did not answer before this attempt
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    -n) [ $# -ge 2 ] && [[ "$2" != -* ]] || usage_error "-n needs a number"; retries=$2; shift 2 ;;
    --hostfile) [ $# -ge 2 ] && [[ "$2" != -* ]] || usage_error "--hostfile needs a file"; hostfile=$2; shift 2 ;;
    --min-hosts) [ $# -ge 2 ] && [[ "$2" != -* ]] || usage_error "--min-hosts needs a number"; min_hosts=$2; shift 2 ;;
    --wait) [ $# -ge 2 ] && [[ "$2" != -* ]] || usage_error "--wait needs a number of seconds"; wait_s=$2; shift 2 ;;
    --) shift; break ;;
    *) unknown_option "$1" "the command goes after --" ;;
  esac
done
case "$retries" in ''|*[!0-9]*) usage_error "-n must be a whole number, got '$retries'" ;; esac
case "$min_hosts" in ''|*[!0-9]*|0) usage_error "--min-hosts must be a whole number from 1, got '$min_hosts'" ;; esac
case "$wait_s" in ''|*[!0-9]*) usage_error "--wait must be a whole number of seconds, got '$wait_s'" ;; esac
[ $# -gt 0 ] || usage_error "no command given"
if [ -n "$hostfile" ]; then
  [ -f "$hostfile" ] || usage_error "--hostfile $hostfile: no such file"
  use_hostfile "$hostfile"
  read_hosts
fi
make_tmp

save_dir=""
log_dir=""
has_resume=0
exports=0
prev=""
for arg in "$@"; do
  case "$prev" in --save-dir) save_dir=$arg ;; --log-dir) log_dir=$arg ;; esac
  case "$arg" in --save-dir=*) save_dir=${arg#*=} ;; --log-dir=*) log_dir=${arg#*=} ;; --resume*) has_resume=1 ;; --export*) exports=1 ;; esac
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

# answering_hosts: $tmp/hosts.live, the lines of the hostfile's hosts that answer over ssh, and one
# line on the hosts left out; exit 1 with fewer than --min-hosts.
answering_hosts() {
  local host up=0 out=()
  on_all_hosts "$tmp" "true"
  : >"$tmp/hosts.live"
  for host in "${HOSTS[@]}"; do
    if [ "$(cat "$tmp/$host.rc")" = 0 ]; then
      awk -v h="$host" '{ sub(/#.*/, "") } NF && $1 == h' "$HOSTFILE" >>"$tmp/hosts.live"
      up=$((up + 1))
    else
      out+=("$host ($(why_failed "$tmp" "$host"))")
    fi
  done
  if [ "${#out[@]}" -gt 0 ]; then
    echo "$PROG: left out of attempt $attempt, not answering: $(IFS=,; echo "${out[*]}" | sed 's/,/, /g')" >&2
  fi
  [ "$up" -ge "$min_hosts" ] || die "$up of ${#HOSTS[@]} hosts answer, fewer than --min-hosts $min_hosts: not relaunching"
  missing=$((${#HOSTS[@]} - up))
}

# on_answering_hosts ARGS...: ARGS with, before entry_cn.sh, the launcher's hostfile (--hostfile F,
# --hostfile=F, -machinefile F ...: any spelling of the same file) replaced by the answering hosts'
# and, when a host is missing, the rank count cut to their slots, and after it --pipeline-stages
# cut to a count that divides the ranks (in cmd).
on_answering_hosts() {
  local arg prev="" launcher=1 slots ranks
  slots=$(sum_slots "$tmp/hosts.live")
  ranks=$slots
  cmd=()
  for arg in "$@"; do
    case "$arg" in *entry_cn.sh) launcher=0 ;; esac
    if [ "$launcher" = 1 ]; then
      if [[ "$prev" =~ ^--?(hostfile|machinefile)$ ]] && [ "$arg" -ef "$hostfile" ]; then
        arg=$tmp/hosts.live
      elif [[ "$arg" =~ ^(--?(hostfile|machinefile))=(.*)$ ]] && [ "${BASH_REMATCH[3]}" -ef "$hostfile" ]; then
        arg="${BASH_REMATCH[1]}=$tmp/hosts.live"
      elif [[ "$prev" =~ ^(-np|--np|-n)$ ]] && [[ "$arg" =~ ^[0-9]+$ ]]; then
        [ "$missing" = 0 ] || [ "$arg" -le "$slots" ] || arg=$slots
        ranks=$arg
      fi
    elif [ "$missing" -gt 0 ] && [ "$prev" = --pipeline-stages ] && [[ "$arg" =~ ^[0-9]+$ ]]; then
      arg=$(stages_for "$arg" "$ranks")
    elif [ "$missing" -gt 0 ] && [[ "$arg" =~ ^--pipeline-stages=([0-9]+)$ ]]; then
      arg=--pipeline-stages=$(stages_for "${BASH_REMATCH[1]}" "$ranks")
    fi
    cmd+=("$arg")
    prev=$arg
  done
}

# stages_for STAGES RANKS: the largest stage count up to STAGES that divides RANKS, and a line when
# it is not STAGES.
stages_for() {
  local stages=$1 ranks=$2
  while [ "$stages" -gt 1 ] && [ $((ranks % stages)) != 0 ]; do stages=$((stages - 1)); done
  if [ "$stages" != "$1" ]; then
    echo "$PROG: --pipeline-stages $1 does not divide the $ranks ranks of attempt $attempt:" \
      "--pipeline-stages $stages (the resume restages the checkpoint)" >&2
  fi
  echo "$stages"
}

# finished: whether the attempt that exited 0 finished the run (see --help)
finished() {
  [ -z "$log_dir" ] || [ "$exports" = 1 ] || [ "$log_dir/summary.json" -nt "$tmp/attempt" ] ||
    { [ -f "$log_dir/summary.json" ] && [ -z "$(find "$log_dir" -newer "$tmp/attempt" -print -quit)" ]; }
}

# a signal to stop is the user's: bash runs these once the command in the foreground has stopped
stopped=""
trap 'stopped=130' INT
trap 'stopped=143' TERM
attempt=0
while true; do
  attempt=$((attempt + 1))
  cmd=("$@")
  if [ -n "$hostfile" ]; then
    answering_hosts
    on_answering_hosts "$@"
  fi
  checkpoint=$(newest_checkpoint)
  if [ "$has_resume" = 0 ] && [ -n "$checkpoint" ]; then
    cmd+=(--resume)
  fi
  echo "$PROG: attempt $attempt of $((retries + 1)): ${cmd[*]}" >&2
  touch "$tmp/attempt"
  status=0
  "${cmd[@]}" || status=$?
  shown=$status
  if [ -n "$stopped" ] || [ "$status" = 130 ]; then
    echo "$PROG: attempt $attempt was interrupted (exit $status): not relaunching" >&2
    exit "${stopped:-130}"
  fi
  if [ "$status" = 0 ]; then
    # Open MPI's mpirun exits 0 when it loses a host's daemon and ends the job (5.0.x, measured on
    # the simulated hosts): a training run has finished only once it wrote summary.json
    finished && exit 0
    echo "$PROG: attempt $attempt exited with 0, but the run did not finish (no new $log_dir/summary.json;" \
      "mpirun exits 0 when it loses a host): taken as a failure" >&2
    status=1 shown="0 (unfinished)"
  fi
  if [ "$status" = 2 ]; then
    echo "$PROG: attempt $attempt exited with 2, a configuration or usage error (see above): not retrying," \
      "a relaunch would fail the same way" >&2
    exit 2
  fi
  if [ "$status" = 3 ] && [ "$missing" = 0 ]; then
    echo "$PROG: attempt $attempt exited with 3, its checkpoint cannot go on on these ranks (see above)," \
      "and no host of a --hostfile is missing to wait for: not retrying" >&2
    exit 3
  fi
  if [ "$attempt" -gt "$retries" ]; then
    echo "$PROG: giving up after $attempt attempts; the last exited with $shown" >&2
    exit "$status"
  fi
  if [ "$status" = 3 ]; then
    echo "$PROG: attempt $attempt exited with 3, its checkpoint cannot go on on the hosts that answer" \
      "(see above): waiting $wait_s s for a host to come back" >&2
    sleep "$wait_s" || true
    if [ -n "$stopped" ]; then
      echo "$PROG: interrupted while waiting: not relaunching" >&2
      exit "$stopped"
    fi
    continue
  fi
  checkpoint=$(newest_checkpoint)
  if [ -n "$checkpoint" ]; then
    echo "$PROG: attempt $attempt exited with $shown; relaunching from checkpoint $checkpoint" >&2
  else
    echo "$PROG: attempt $attempt exited with $shown; starting over: no complete checkpoint in $save_dir yet" >&2
  fi
done
