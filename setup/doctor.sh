#!/usr/bin/env bash
# Preflight before a multi-host run, by hand: looks at everything that commonly breaks one and
# reports all problems found in one message.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: setup/doctor.sh [--help] [--link | --recommend MBIT] [NP]

Checks, for a run of NP ranks (default: all slots) over the hostfile:
  - the hostfile: "HOST slots=N" lines (as Open MPI and the DeepSpeed launcher read them), each host
    on one line (Open MPI refuses a host listed twice), NP within the slots, no host with more
    slots than GPUs;
  - every host answers over BatchMode ssh and has the same python/torch/deepspeed/timm
    (setup/test_cn_connection.sh);
  - the network setting of setup/cluster.env: with IFACE set, every host has an IPv4 address on
    it; without, no host has more than one network to guess from;
  - MASTER_ADDR (default: the first host) resolves to a non-loopback address on every host and
    its ssh port answers from every host within 3 s.
Exits 1 after listing every problem. A hostfile of one host named by loopback (the shipped
localhost slots=2) is checked here without ssh, as mpirun starts its ranks without ssh.

--link also measures each host's link: one TCP stream of LINK_MB MB (default 100) from this machine
to every other host (setup/link_speed.py, the transfer the simulated-cluster tests measure with),
then prints the Mbit/s per host and, for the slowest link, the row of the table of docs/ethernet.md
("Which engine on which network") as commands to run, each speed-up with where it was measured.
One host has no link between hosts: --link prints the one-host row.

--recommend MBIT prints only that row for a slowest link of MBIT Mbit/s (measured some other way,
e.g. iperf3) and NP ranks over the hostfile's hosts: no check, no ssh.

Environment: HOSTFILE (default setup/hosts.txt), NP, MASTER_ADDR, IFACE (see setup/cluster.env),
SSH_TIMEOUT, HOST_TIMEOUT, LINK_MB.
USAGE
}
# shellcheck source=setup/common.sh
. "$(dirname "$0")/common.sh"
measure_link=0 recommend_mbit=""
case "${1:-}" in
  --link) measure_link=1; shift ;;
  --recommend)
    [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || usage_error "--recommend needs the link's Mbit/s, a positive number"
    recommend_mbit=$2; shift 2 ;;
esac
opening "$@"
[ $# -le 1 ] || usage_error "one NP at most, got $# arguments"
[ $# -eq 0 ] || NP=$1
use_hostfile
source_cluster_env
read_hosts
make_tmp
IFACE=${IFACE:-}
master=${MASTER_ADDR:-${HOSTS[0]}}
problems=()
total_slots=$(sum_slots "$HOSTFILE")
NP=${NP:-$total_slots}

# recommend MBIT: the row of docs/ethernet.md's table for a slowest link of MBIT Mbit/s, as commands
# for NP ranks over HOSTFILE: the pipelines with one stage per host (every rank a stage when the
# hosts' slots are unequal) and twice as many micro-batches as stages, as the table's runs used.
recommend() {
  local mbit=$1 num_hosts=${#HOSTS[@]} stages run pipe
  run="scripts/mpirun -np $NP --hostfile ${HOSTFILE#"$ROOT"/} ./entry_cn.sh"  # from the checkout's root
  if [ "$num_hosts" -eq 1 ]; then
    echo "$PROG: one host (${HOSTS[0]}): no link between hosts; the row \"10 GbE or faster, or one host\" of" \
      "docs/ethernet.md: $run --engine ddp"
    return
  fi
  stages=$num_hosts
  [ $((NP % num_hosts)) -eq 0 ] || stages=$NP
  pipe="--pipeline-stages $stages --grad-accum $((2 * stages))"
  if [ "$mbit" -lt 2000 ]; then
    echo "$PROG: slowest link $mbit Mbit/s (1 GbE or slower): the row of docs/ethernet.md, fastest first." \
      "Speed: images/s against plain DDP's on five simulated hosts (CPU ranks in network namespaces of one" \
      "2-core VM, links shaped so that they match ViT-B/16 on RTX 3070s over 1 GbE; no GPU cluster has run" \
      "them: docs/benchmarks.md, \"Which engine wins on Ethernet?\"); accuracy: held-out top-1 on the glyphs" \
      "task against DDP's (2 CPU ranks of a VM, seeds 0-2: docs/benchmarks.md, \"What each engine costs in" \
      "accuracy on glyphs\"):"
    echo "  local steps (its defaults: H = 10, 5 int8 fragments), 0.93-1.14 of unshaped DDP's images/s, 1.84" \
      "+- 0.48 points below: $run --engine diloco"
    echo "  DDP's step, asynchronous: 6.2x, 0.96 +- 0.18 points below: $run --engine async-pipeline $pipe" \
      "--pipe-wire-dtype bf16"
    echo "  compressed gradients: 4.4x, 1.42 +- 0.61 points below (check the held-out accuracy): $run" \
      "--engine ddp --comm-hook powersgd"
    echo "  DDP's step exactly: 3.3x: $run --engine pipeline $pipe"
    echo "  plain DDP and ZeRO send every gradient through each link; a model that does not fit one GPU:" \
      "the two pipelines (each stage holds 1/$stages of it)"
  elif [ "$mbit" -lt 8000 ]; then
    echo "$PROG: slowest link $mbit Mbit/s (2.5 to 5 GbE): the row of docs/ethernet.md, measured only at a 3" \
      "Gbit/s ratio on the five simulated hosts (CPU ranks of one 2-core VM: docs/benchmarks.md, \"How close" \
      "are the planner's predictions\"), where the asynchronous pipeline was again the fastest (129.3 ms a" \
      "step against plain DDP's 529.8); time both on your hosts: $run --engine async-pipeline $pipe" \
      "--pipe-wire-dtype bf16, and $run --engine ddp"
  else
    echo "$PROG: slowest link $mbit Mbit/s (10 GbE or faster): the row of docs/ethernet.md (not measured at" \
      "this ratio): $run --engine ddp, or $run --engine zero --ds-config deepspeed_configs/zero0.json;" \
      "a model that does not fit one GPU: zero2.json, then zero3.json, or $run --engine pipeline $pipe"
  fi
}
if [ -n "$recommend_mbit" ]; then
  [[ "$NP" =~ ^[1-9][0-9]*$ ]] || usage_error "world size NP='$NP' is not a positive number"
  recommend "$recommend_mbit"
  exit 0
fi

bad_lines=$(awk '{ sub(/#.*/, "") } NF && !/^[^ \t]+[ \t]+slots=[0-9]+[ \t]*$/ { printf "%s\"%s\"", sep, $0; sep = ", " }' "$HOSTFILE")
[ -z "$bad_lines" ] || problems+=("$HOSTFILE: not \"HOST slots=N\": $bad_lines")
twice=$(awk '{ sub(/#.*/, "") } NF && seen[$1]++ == 1 { printf "%s%s", sep, $1; sep = ", " }' "$HOSTFILE")
[ -z "$twice" ] || problems+=("$HOSTFILE: $twice listed more than once, which Open MPI refuses: one line per host, its slots summed")
if ! [[ "$NP" =~ ^[1-9][0-9]*$ ]]; then
  problems+=("world size NP='$NP' is not a positive number")
elif [ "$NP" -gt "$total_slots" ]; then
  problems+=("world size $NP is more than the $total_slots slots of $HOSTFILE (mpirun would refuse or oversubscribe)")
fi

if ! "$ROOT/setup/test_cn_connection.sh" "$HOSTFILE" >"$tmp/connection.out" 2>"$tmp/connection.err"; then
  while IFS= read -r line; do problems+=("${line#  }"); done < <(grep '^  ' "$tmp/connection.err")
fi

# shellcheck disable=SC2016 # expanded on the host
facts='master=$1
if command -v nvidia-smi >/dev/null 2>&1; then echo "gpus $(nvidia-smi -L 2>/dev/null | grep -c "^GPU ")"; else echo "gpus 0"; fi
ip -4 -o addr show 2>/dev/null | awk "\$2 != \"lo\" { print \"addr\", \$2, \$4 }"
echo "master_addr $(getent ahostsv4 "$master" | awk "NR == 1 { print \$1 }")"
if timeout 3 bash -c "exec 3<>/dev/tcp/$master/22" 2>/dev/null; then echo "master_port ok"; else echo "master_port fail"; fi'
on_all_hosts "$tmp" "$facts" "$master"
for host in "${HOSTS[@]}"; do
  [ "$(cat "$tmp/$host.rc")" = 0 ] || continue  # already reported as unreachable
  out="$tmp/$host.out"
  slots=$(awk -v h="$host" '{ sub(/#.*/, "") } $1 == h && match($0, /slots=[0-9]+/) { print substr($0, RSTART + 6, RLENGTH - 6) }' "$HOSTFILE")
  num_gpus=$(awk '$1 == "gpus" { print $2 }' "$out")
  if [ "${num_gpus:-0}" -gt 0 ] && [ "${slots:-1}" -gt "$num_gpus" ]; then
    problems+=("$host: slots=$slots but only $num_gpus GPU(s) (run setup/make_hostfile.sh)")
  fi
  # One host named by loopback: every rank is here, talks over loopback, and needs no ssh or network.
  [ "${#HOSTS[@]}" -eq 1 ] && is_local "$host" && continue
  nets=$(awk '$1 == "addr" { printf "%s%s %s", sep, $2, $3; sep = ", " }' "$out")
  if [ -n "$IFACE" ]; then
    awk -v i="$IFACE" '$1 == "addr" && $2 == i { found = 1 } END { exit !found }' "$out" \
      || problems+=("$host: no IPv4 address on IFACE=$IFACE (it has: ${nets:-none})")
  elif [ "$(grep -c '^addr ' "$out")" -gt 1 ]; then
    problems+=("$host: several networks ($nets) and IFACE is not set: set IFACE in setup/cluster.env")
  fi
  addr=$(awk '$1 == "master_addr" { print $2 }' "$out")
  if [ -z "$addr" ]; then
    problems+=("$host: MASTER_ADDR $master does not resolve")
  elif [[ "$addr" == 127.* ]]; then
    problems+=("$host: MASTER_ADDR $master resolves to loopback $addr (fix /etc/hosts)")
  elif grep -q '^master_port fail' "$out"; then
    problems+=("$host: cannot reach MASTER_ADDR $master ($addr) on its ssh port within 3 s")
  fi
done

if [ "${#problems[@]}" -gt 0 ]; then
  printf '%s: %d problem(s) for %s rank(s) over %s:\n' "$PROG" "${#problems[@]}" "$NP" "$HOSTFILE" >&2
  printf '  - %s\n' "${problems[@]}" >&2
  exit 1
fi
echo "$PROG: ok: $NP rank(s) over ${#HOSTS[@]} host(s) ($total_slots slots), same versions everywhere," \
  "network ${IFACE:-auto}, MASTER_ADDR $master reachable from every host"
[ "$measure_link" = 1 ] || exit 0

# link_mbit HOST PORT: Mbit/s of one stream of LINK_MB MB from here to HOST (empty when it failed).
link_mbit() {
  local host=$1 port=$2 out="$tmp/link.$1" waited=0
  timeout 120 ssh "${SSH_OPTS[@]}" "$host" python3 "$ROOT/setup/link_speed.py" recv 0.0.0.0 "$port" >"$out" 2>&1 &
  until grep -q '^listening' "$out" 2>/dev/null; do
    sleep 0.2; waited=$((waited + 1))
    [ "$waited" -lt 50 ] || return 0
  done
  python3 "$ROOT/setup/link_speed.py" send "$host" "$port" $((${LINK_MB:-100} * 1000000)) || return 0
  wait
  awk '$1 ~ /^[0-9]+$/ && $3 > $2 { printf "%.0f", $1 * 8 / ($3 - $2) / 1e6 }' "$out"
}

slowest=0  # one host: no link between hosts, nothing to measure
if [ "${#HOSTS[@]}" -gt 1 ]; then
  slowest=""
  for host in "${HOSTS[@]}"; do
    if [ "$host" = "$(hostname)" ] || is_local "$host"; then continue; fi
    mbit=$(link_mbit "$host" 5201)
    [ -n "$mbit" ] || die "link to $host: the transfer failed ($(tail -n 1 "$tmp/link.$host"))"
    echo "$PROG: link from $(hostname) to $host: $mbit Mbit/s"
    [ -n "$slowest" ] && [ "$slowest" -le "$mbit" ] || slowest=$mbit
  done
  [ -n "$slowest" ] || die "--link: no host other than this one ($(hostname)) to measure"
fi
recommend "$slowest"
