#!/usr/bin/env bash
# Simulates a small cluster on this machine for the tests: each host is a network namespace with
# its own address, hostname, /etc/hosts, home directory and sshd. Needs root.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: scripts/sim_cluster.sh up N [--link RATE] | link RATE|off | down | status | exec I [--] CMD...
                             | stop-sshd I | start-sshd I | unplug I | plug I

  up N         (re)creates N hosts cn0..cn{N-1}; prints the hostfile and bootstrap key to use
  --link RATE  shapes every host's link to RATE in each direction, like a switch port (tc's rate
               syntax: 1gbit, 100mbit, 2.5gbit, 125mbps = bytes/s); default: unshaped (as fast as
               the CPU copies, many Gbit/s). Only the rate: this kernel has no netem for delay.
  link RATE    reshapes every host's link of the running cluster to RATE; link off unshapes them
  down         removes everything: processes in the namespaces, namespaces, links, state dir
  status       one line per host: its link rate, bytes sent and received; exits 1 when a host or
               its sshd is not running
  exec I CMD   runs CMD as host cnI (its network, hostname, /etc/hosts and home), from $PWD
  stop-sshd I  stops host cnI's sshd: logins to it are refused at once; start-sshd I undoes it
  unplug I     takes host cnI off the network: nothing reaches it, connections time out;
               plug I undoes it

Layout: a switch namespace holds a bridge; each host namespace has eth0 = SUBNET.(10+I)/24 wired
to it (port cnI in the switch). With --link, a token bucket (tc tbf) on eth0 shapes what the host
sends and one on its switch port what it receives. The root namespace gets no address and no host
gets a default route, so no traffic leaves the simulated network. Commands run as a host with
`exec`: the tests drive the cluster from cn0, as a person would from the first machine of a real
cluster.
Each host sees its own passwd entry for root whose home is STATE/cnI/home, so ssh, sshd and
ssh-copy-id use that home's .ssh and never the real one. The filesystem is otherwise shared, so
the project (and its .venv) is at the same path on every host, as the real setup requires.
Every host's authorized_keys starts with STATE/bootstrap_key.pub; load STATE/bootstrap_key into
an ssh-agent to stand in for the passwords that setup/setup_ssh.sh asks for.

Environment: SIM_DIR (state dir, default /tmp/vit-sim), SIM_PREFIX (namespace name prefix,
default vitsim), SIM_SUBNET (first three octets of the /24, default 10.250.77).
USAGE
}

SIM_DIR=${SIM_DIR:-/tmp/vit-sim}
SIM_PREFIX=${SIM_PREFIX:-vitsim}
SIM_SUBNET=${SIM_SUBNET:-10.250.77}
SWITCH_NS="$SIM_PREFIX-sw"

die() { echo "sim_cluster.sh: $*" >&2; exit 1; }
usage_error() { echo "sim_cluster.sh: $*" >&2; exit 2; }

host_ns() { echo "$SIM_PREFIX-cn$1"; }
host_addr() { echo "$SIM_SUBNET.$((10 + $1))"; }
num_hosts() { cat "$SIM_DIR/num_hosts" 2>/dev/null || echo 0; }
holder_pid() { cat "$SIM_DIR/cn$1/holder.pid" 2>/dev/null || true; }

check_host() {
  if ! [[ "$1" =~ ^[0-9]+$ ]] || [ "$1" -ge "$(num_hosts)" ]; then
    die "no host cn$1 (the cluster has $(num_hosts) hosts)"
  fi
  kill -0 "$(holder_pid "$1")" 2>/dev/null || die "host cn$1 is not running (run: up N)"
}

# Bits per second of a tc rate (1gbit, 100mbit, 2.5gbit, 1gibit, 125mbps = bytes/s); empty if not one.
rate_bits() {
  local re='^([0-9]+(\.[0-9]+)?)(k|m|g|t|ki|mi|gi|ti)?(bit|bps)$'
  [[ "${1,,}" =~ $re ]] || return 0
  awk -v n="${BASH_REMATCH[1]}" -v p="${BASH_REMATCH[3]}" -v u="${BASH_REMATCH[4]}" 'BEGIN {
    split("k m g t", si); for (i = 1; i <= 4; i++) { mult[si[i]] = 1000 ^ i; mult[si[i] "i"] = 1024 ^ i }
    bits = n * (p == "" ? 1 : mult[p]) * (u == "bps" ? 8 : 1)
    if (bits >= 1) printf "%.0f\n", bits }'
}

checked_rate() {
  local bits
  bits=$(rate_bits "$1")
  [ -n "$bits" ] || usage_error "--link: '$1' is not a rate (e.g. 1gbit, 100mbit, 2.5gbit; tc's syntax)"
  echo "$bits"
}

# One direction of a host's link: a token bucket on DEV, the egress of NS. tbf sends RATE on average,
# lets BURST bytes through at once after an idle moment, and drops what would wait longer than
# LATENCY, as a switch drops what its port buffer cannot hold. Measured with one TCP stream at 1gbit
# (goodput tops out at 957 Mbit/s: 1448 payload bytes in each 1514-byte frame that tbf counts):
# - burst: 2 ms at the rate, at least 64 KiB. tbf waits for tokens on a timer; a bucket that holds
#   less than a timer's slack lets the link idle (1600 bytes: 314 Mbit/s; 10 kB: 601; 64 KiB: 942;
#   125 kB or more: 955-958). A veth also hands tbf GSO packets of up to 64 KiB, which a smaller
#   bucket must cut into MTU frames, and this 2-core machine has no CPU to spare for that.
# - latency: 10 ms of queue (1.25 MB at 1 Gbit/s, a switch port's buffer). The wire has no delay, so
#   a stream's window sits in this queue; it must not run dry when TCP halves its window after a
#   drop (200 us of queue with a 64 KiB bucket: 608 Mbit/s; 1 ms: 828; 20 ms: 942).
shape() {
  local ns=$1 dev=$2 bits=$3 burst
  burst=$((bits / 8 / 500))
  [ "$burst" -ge 65536 ] || burst=65536
  tc -n "$ns" qdisc replace dev "$dev" root tbf rate "${bits}bit" burst "$burst" latency 10ms
}

# "SENT RECEIVED": bytes through eth0 of host NS since it came up, Ethernet headers included.
link_bytes() {
  ip -n "$1" -s link show dev eth0 | awk '$1 == "RX:" { getline; rx = $1 } $1 == "TX:" { getline; tx = $1 }
    END { print tx, rx }'
}

# The rate in force on DEV of NS, as tc prints it (1Gbit), or "unshaped".
link_rate() {
  tc -n "$1" qdisc show dev "$2" 2>/dev/null | awk '$2 == "tbf" { for (i = 1; i < NF; i++) if ($i == "rate") r = $(i + 1) }
    END { print (r == "" ? "unshaped" : r) }'
}

preflight() {
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
  local tool
  for tool in ip tc unshare nsenter ssh-keygen /usr/sbin/sshd; do
    command -v "$tool" >/dev/null || die "missing $tool (apt-get install iproute2 util-linux openssh-server)"
  done
}

# Runs as the first process of a host: sets its hostname, its own passwd (home), hosts file and
# resolv.conf, a private /run for sshd, then waits forever so that `exec` and sshd can join its namespaces.
# shellcheck disable=SC2016 # expanded by the holder's shell
HOLDER='set -e
hostname "$1"
mount --bind "$2/passwd" /etc/passwd
mount --bind "$3/hosts" /etc/hosts
mount -t tmpfs tmpfs /run
mkdir -m 755 /run/sshd
mount --bind "$3/resolv.conf" /etc/resolv.conf
echo "$$" > "$2/holder.pid"
exec sleep infinity'

start_sshd() {
  local i=$1 dir="$SIM_DIR/cn$1"
  rm -f "$dir/sshd.pid"
  nsenter -t "$(holder_pid "$i")" -n -u -m /usr/sbin/sshd -f "$dir/sshd_config" -E "$dir/sshd.log" \
    || die "cn$i: sshd did not start (see $dir/sshd.log)"
  local tries=50
  until [ -s "$dir/sshd.pid" ]; do
    tries=$((tries - 1))
    [ "$tries" -gt 0 ] || die "cn$i: sshd wrote no pid file within 5 s (see $dir/sshd.log)"
    sleep 0.1
  done
}

up() {
  local n=$1 link=$2 bits="" i
  [[ "$n" =~ ^[1-9][0-9]?$ ]] || usage_error "up needs a host count 1..99, got '$n'"
  [ -z "$link" ] || bits=$(checked_rate "$link")
  preflight
  down >/dev/null
  mkdir -p "$SIM_DIR"
  chmod 700 "$SIM_DIR"
  echo "$n" > "$SIM_DIR/num_hosts"
  ssh-keygen -q -t ed25519 -N '' -C vit-sim-bootstrap -f "$SIM_DIR/bootstrap_key"
  {
    printf '127.0.0.1\tlocalhost\n'
    for ((i = 0; i < n; i++)); do printf '%s\tcn%s\n' "$(host_addr "$i")" "$i"; done
  } > "$SIM_DIR/hosts"
  # No DNS inside: a lookup that /etc/hosts cannot answer stops at the host's own loopback.
  echo "nameserver 127.0.0.1" > "$SIM_DIR/resolv.conf"
  : > "$SIM_DIR/hostfile"
  for ((i = 0; i < n; i++)); do echo "cn$i slots=1" >> "$SIM_DIR/hostfile"; done

  ip netns add "$SWITCH_NS"
  ip -n "$SWITCH_NS" link add br0 type bridge
  ip -n "$SWITCH_NS" link set br0 up
  for ((i = 0; i < n; i++)); do
    local ns dir
    ns=$(host_ns "$i")
    dir="$SIM_DIR/cn$i"
    mkdir -p "$dir/home/.ssh" "$dir/bin"
    chmod 700 "$dir/home" "$dir/home/.ssh"
    cp "$SIM_DIR/bootstrap_key.pub" "$dir/home/.ssh/authorized_keys"
    chmod 600 "$dir/home/.ssh/authorized_keys"
    # sshd replaces PATH with this one, so that a test can put a fake tool in STATE/cnI/bin.
    echo "PATH=$dir/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" > "$dir/home/.ssh/environment"
    awk -F: -v OFS=: -v home="$dir/home" '$1 == "root" { $6 = home } 1' /etc/passwd > "$dir/passwd"
    ssh-keygen -q -t ed25519 -N '' -C "cn$i" -f "$dir/ssh_host_ed25519_key"
    cat > "$dir/sshd_config" <<EOF
# Test-only sshd of simulated host cn$i.
ListenAddress $(host_addr "$i"):22
HostKey $dir/ssh_host_ed25519_key
PidFile $dir/sshd.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitUserEnvironment PATH
MaxStartups 100
Subsystem sftp internal-sftp
EOF
    ip netns add "$ns"
    ip link add eth0 netns "$ns" type veth peer name "cn$i" netns "$SWITCH_NS"
    ip -n "$SWITCH_NS" link set "cn$i" master br0 up
    ip -n "$ns" addr add "$(host_addr "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    if [ -n "$bits" ]; then
      shape "$ns" eth0 "$bits"             # what cnI sends
      shape "$SWITCH_NS" "cn$i" "$bits"    # what cnI receives
    fi
    setsid ip netns exec "$ns" unshare --uts --mount --propagation private \
      bash -c "$HOLDER" holder "cn$i" "$dir" "$SIM_DIR" </dev/null >"$dir/holder.log" 2>&1 &
  done
  for ((i = 0; i < n; i++)); do
    local tries=50
    until [ -s "$SIM_DIR/cn$i/holder.pid" ]; do
      tries=$((tries - 1))
      [ "$tries" -gt 0 ] || die "cn$i: namespace did not start (see $SIM_DIR/cn$i/holder.log)"
      sleep 0.1
    done
    start_sshd "$i"
  done
  echo "sim_cluster.sh: $n hosts up: $(awk 'NR > 1 { printf "%s%s %s", sep, $2, $1; sep = ", " }' "$SIM_DIR/hosts")"
  echo "hostfile:      $SIM_DIR/hostfile"
  echo "bootstrap key: $SIM_DIR/bootstrap_key (in every host's authorized_keys)"
  echo "run as cn0:    $0 exec 0 -- CMD"
}

down() {
  local ns pids
  for ns in $(ip netns list 2>/dev/null | awk -v p="$SIM_PREFIX-" 'index($1, p) == 1 { print $1 }'); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    if [ -n "$pids" ]; then
      # shellcheck disable=SC2086 # one pid per word
      kill -TERM $pids 2>/dev/null || true
      sleep 0.2
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      # shellcheck disable=SC2086
      [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
    fi
    ip netns del "$ns"
  done
  # Only a folder that `up` made (it holds num_hosts), never whatever SIM_DIR happens to name.
  if [ -f "$SIM_DIR/num_hosts" ]; then rm -rf "$SIM_DIR"; fi
  echo "sim_cluster.sh: down"
}

status() {
  local n i pid bad=0 sshd out in link sent received
  n=$(num_hosts)
  [ "$n" -gt 0 ] || { echo "sim_cluster.sh: no simulated cluster in $SIM_DIR"; return 1; }
  for ((i = 0; i < n; i++)); do
    pid=$(holder_pid "$i")
    if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
      echo "cn$i $(host_addr "$i") host DOWN"; bad=1; continue
    fi
    sshd=down
    pid=$(cat "$SIM_DIR/cn$i/sshd.pid" 2>/dev/null || true)
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && sshd=up
    [ "$sshd" = up ] || bad=1
    out=$(link_rate "$(host_ns "$i")" eth0)
    in=$(link_rate "$SWITCH_NS" "cn$i")
    [ "$out $in" = "unshaped unshaped" ] && link=unshaped || link="$out out, $in in"
    read -r sent received < <(link_bytes "$(host_ns "$i")")
    echo "cn$i $(host_addr "$i") host up, sshd $sshd, link $link, bytes sent $sent received $received"
  done
  return "$bad"
}

case "${1:-}" in
  -h|--help) usage ;;
  up)
    shift
    n="" link=""
    while [ $# -gt 0 ]; do
      case "$1" in
        --link) [ $# -ge 2 ] || usage_error "--link needs a rate (e.g. 1gbit)"; link=$2; shift 2 ;;
        --link=*) link=${1#--link=}; shift ;;
        -*) usage_error "up: unknown option '$1' (see --help)" ;;
        *) [ -z "$n" ] || usage_error "usage: up N [--link RATE]"; n=$1; shift ;;
      esac
    done
    [ -n "$n" ] || usage_error "usage: up N [--link RATE]"
    up "$n" "$link"
    ;;
  down) preflight; down ;;
  status) status ;;
  exec)
    [ $# -ge 3 ] || die "usage: exec I [--] CMD..."
    i=$2; shift 2
    [ "$1" != -- ] || shift
    check_host "$i"
    exec nsenter -t "$(holder_pid "$i")" -n -u -m --wd="$PWD" env HOME="$SIM_DIR/cn$i/home" "$@"
    ;;
  link)
    [ $# -eq 2 ] || usage_error "usage: link RATE|off"
    [ "$2" = off ] || bits=$(checked_rate "$2")
    preflight
    for ((i = 0; i < $(num_hosts); i++)); do
      check_host "$i"
      if [ "$2" = off ]; then
        tc -n "$(host_ns "$i")" qdisc del dev eth0 root 2>/dev/null || true
        tc -n "$SWITCH_NS" qdisc del dev "cn$i" root 2>/dev/null || true
      else
        shape "$(host_ns "$i")" eth0 "$bits"
        shape "$SWITCH_NS" "cn$i" "$bits"
      fi
    done
    status
    ;;
  stop-sshd|start-sshd|unplug|plug)
    [ $# -eq 2 ] || die "usage: $1 I"
    check_host "$2"
    case "$1" in
      stop-sshd)
        pid=$(cat "$SIM_DIR/cn$2/sshd.pid" 2>/dev/null || true)
        [ -z "$pid" ] || kill "$pid"
        rm -f "$SIM_DIR/cn$2/sshd.pid"
        ;;
      start-sshd) [ -s "$SIM_DIR/cn$2/sshd.pid" ] || start_sshd "$2" ;;
      unplug) ip -n "$SWITCH_NS" link set "cn$2" down ;;
      plug) ip -n "$SWITCH_NS" link set "cn$2" up ;;
    esac
    echo "sim_cluster.sh: $1 cn$2: done"
    ;;
  "") usage >&2; exit 2 ;;
  *) echo "sim_cluster.sh: unknown command '$1' (see --help)" >&2; exit 2 ;;
esac
