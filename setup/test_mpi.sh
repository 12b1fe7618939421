#!/usr/bin/env bash
# Proves that MPI works across the hostfile's hosts, in three launches of growing weight: a C hello
# world, then mpi4py and a torch.distributed all_reduce (setup/check_dist.py).
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: setup/test_mpi.sh [--help] [HOSTFILE]

1. Builds setup/hello_mpi from setup/hello_mpi.c with the .venv's mpicc on every host (each host
   runs its own copy at this checkout's path).
2. mpirun -np NP --hostfile HOSTFILE setup/hello_mpi: every rank prints rank, size and host.
3. mpirun ... python setup/check_dist.py: an mpi4py allreduce, then a torch.distributed all_reduce
   started as training starts it (vit/runtime/dist_env.py): rank 0's address, nccl on GPUs (a tensor on
   the rank's GPU) or gloo on CPUs.
Each launch must show all NP ranks; a launch that takes longer than MPI_TIMEOUT is killed.
setup/cluster.env (IFACE) is sourced first, as entry_cn.sh does.

Environment: HOSTFILE (default setup/hosts.txt), NP (default: all slots of the hostfile),
MPIRUN (the mpirun that scripts/mpirun runs, default .venv/bin/mpirun), MPIRUN_ARGS (extra mpirun
arguments, split on spaces, e.g. "--oversubscribe"), MPI_TIMEOUT (seconds per launch, default 120), SSH_TIMEOUT, HOST_TIMEOUT.
USAGE
}
# shellcheck source=setup/common.sh
. "$(dirname "$0")/common.sh"
hostfile_opening "$@"
HOSTFILE=$(realpath "$HOSTFILE")
cd "$ROOT"
source_cluster_env
MPI_TIMEOUT=${MPI_TIMEOUT:-120}
NP=${NP:-$(sum_slots "$HOSTFILE")}
read -r -a extra <<<"${MPIRUN_ARGS:-}"
for var in GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME; do
  [ -z "${!var:-}" ] || extra+=(-x "$var")
done

# Built under a per-host name, then renamed: hosts sharing one filesystem do not collide.
# shellcheck disable=SC2016 # expanded on the host
build='cd "$1" && out="setup/.hello_mpi.$(hostname).$$" && .venv/bin/mpicc -O2 -o "$out" setup/hello_mpi.c && mv -f "$out" setup/hello_mpi'
HOST_TIMEOUT=$((HOST_TIMEOUT + 60)) on_all_hosts "$tmp" "$build" "$ROOT"
for host in "${HOSTS[@]}"; do
  [ "$(cat "$tmp/$host.rc")" = 0 ] || die "$host: building setup/hello_mpi failed: $(why_failed "$tmp" "$host")"
done

# launch NAME PATTERN CMD...: runs CMD on NP ranks; every rank must print a line matching PATTERN.
launch() {
  local name=$1 pattern=$2 rc=0 missing
  shift 2
  echo "$PROG: $name: mpirun -np $NP --hostfile $HOSTFILE ${extra[*]} $*"
  timeout -k 10 "$MPI_TIMEOUT" "$ROOT/scripts/mpirun" -np "$NP" --hostfile "$HOSTFILE" "${extra[@]}" "$@" \
    </dev/null 2>&1 | tee "$tmp/$name.log" || rc=$?
  [ "$rc" != 124 ] || die "$name: mpirun did not finish within ${MPI_TIMEOUT}s"
  missing=$(for ((r = 0; r < NP; r++)); do
    grep -qE "^(hello from )?rank $r of $NP on .*$pattern" "$tmp/$name.log" || echo "$r"
  done | tr '\n' ' ')
  [ -z "$missing" ] || die "$name: no report from rank(s) ${missing% } (mpirun exit $rc); see the output above"
  [ "$rc" = 0 ] || die "$name: mpirun exited $rc"
}
launch hello_mpi '' setup/hello_mpi
launch check_dist '(gloo|nccl) all_reduce on [a-z0-9:]+ ok' "$ROOT/.venv/bin/python" setup/check_dist.py
hosts_seen=$(grep -oE '^hello from rank [0-9]+ of [0-9]+ on [^ ]+' "$tmp/hello_mpi.log" | awk '{ print $NF }' | sort -u | tr '\n' ' ')
echo "$PROG: ok: $NP ranks on ${hosts_seen% }: C hello, mpi4py allreduce, torch.distributed all_reduce"
