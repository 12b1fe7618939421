# shellcheck shell=bash
# Sourced by the scripts of setup/ and scripts/. The shared opening: --help, one line naming an
# unknown option, the hostfile, setup/cluster.env, a temp dir removed on exit; then for the cluster
# steps: the hostfile's hosts, one set of ssh options, and running one small shell script on every
# host at once with a hard time limit per host.
# The sourcing script defines usage() first; PROG (its name, for messages) defaults to its file name.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROG=${PROG:-$(basename "$0")}
SSH_TIMEOUT=${SSH_TIMEOUT:-5}   # seconds to wait for a host's ssh port
HOST_TIMEOUT=${HOST_TIMEOUT:-10} # seconds one host may take in all, login included
# BatchMode: fail instead of asking; accept-new: record a host key on first contact, refuse a
# changed one.
SSH_OPTS=(-o BatchMode=yes -o ConnectTimeout="$SSH_TIMEOUT" -o StrictHostKeyChecking=accept-new)

die() { echo "$PROG: $*" >&2; exit 1; }

# usage_error MESSAGE: bad command line, one line, exit 2.
usage_error() { echo "$PROG: $* (see --help)" >&2; exit 2; }

# unknown_option OPTION [HINT]
unknown_option() { usage_error "unknown option '$1'${2:+; $2}"; }

# opening ARGS...: the scripts whose arguments are all positional: -h/--help prints the usage and
# exits 0; a leading option (anything else starting with -) is refused, naming it.
opening() {
  case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    -?*) unknown_option "$1" ;;
  esac
}

# use_hostfile [FILE]: HOSTFILE is FILE, else $HOSTFILE, else setup/hosts.txt.
use_hostfile() { HOSTFILE=${1:-${HOSTFILE:-$ROOT/setup/hosts.txt}}; }

# hostfile_opening ARGS...: the whole opening of a cluster step called as `SCRIPT [--help] [HOSTFILE]`:
# the hostfile's hosts in HOSTS and a temp dir in $tmp.
hostfile_opening() {
  opening "$@"
  [ $# -le 1 ] || usage_error "one HOSTFILE at most, got $# arguments"
  use_hostfile "${1:-}"
  read_hosts
  make_tmp
}

# make_tmp: a temp dir in $tmp, removed when the script exits.
make_tmp() {
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
}

# source_cluster_env: the network settings (IFACE) that entry_cn.sh also reads on every rank.
source_cluster_env() {
  if [ -f "$ROOT/setup/cluster.env" ]; then
    # shellcheck source=setup/cluster.env
    . "$ROOT/setup/cluster.env"
  fi
}

# Fills HOSTS with the first word of every line of the hostfile, comments and blank lines skipped.
read_hosts() {
  [ -f "$HOSTFILE" ] || die "no hostfile $HOSTFILE (set HOSTFILE or pass one)"
  mapfile -t HOSTS < <(awk '{ sub(/#.*/, "") } NF && !seen[$1]++ { print $1 }' "$HOSTFILE")
  [ "${#HOSTS[@]}" -gt 0 ] || die "$HOSTFILE lists no host (every line is commented out)"
}

# sum_slots FILE: the slots of all hosts of a hostfile (a host without slots= counts 1).
sum_slots() {
  awk '{ sub(/#.*/, "") } NF { n += match($0, /slots=[0-9]+/) ? substr($0, RSTART + 6, RLENGTH - 6) : 1 }
       END { print n + 0 }' "$1"
}

# is_local HOST: HOST names this machine by loopback (the shipped hostfile's localhost), where mpirun
# starts ranks without ssh, so the checks run here without ssh too.
is_local() { case "$1" in localhost|127.*|::1) return 0 ;; *) return 1 ;; esac; }

# on_all_hosts DIR SCRIPT [ARGS...]: runs `sh -s -- ARGS` fed SCRIPT on every host of HOSTS in
# parallel (through ssh, or here for a loopback name), each cut off after HOST_TIMEOUT s; leaves
# DIR/HOST.out, DIR/HOST.err and DIR/HOST.rc (124: timed out, 255: ssh could not log in).
on_all_hosts() {
  local dir=$1 script=$2 host args=""
  shift 2
  [ $# -eq 0 ] || args=$(printf ' %q' "$@")  # quoted for the remote shell
  for host in "${HOSTS[@]}"; do
    (
      rc=0
      if is_local "$host"; then
        timeout "$HOST_TIMEOUT" sh -s -- "$@" <<<"$script" >"$dir/$host.out" 2>"$dir/$host.err" || rc=$?
      else
        timeout "$HOST_TIMEOUT" ssh "${SSH_OPTS[@]}" "$host" "sh -s --$args" <<<"$script" \
          >"$dir/$host.out" 2>"$dir/$host.err" || rc=$?
      fi
      echo "$rc" >"$dir/$host.rc"
    ) &
  done
  wait
}

# why_failed DIR HOST: one line on why HOST's run failed.
why_failed() {
  local rc
  rc=$(cat "$1/$2.rc")
  case "$rc" in
    124) echo "no answer within ${HOST_TIMEOUT}s" ;;
    255) echo "ssh failed: $(grep -v '^Warning: Permanently added' "$1/$2.err" | tail -n 1)" ;;
    *) echo "exit $rc: $(tail -n 1 "$1/$2.err")" ;;
  esac
}
