#!/usr/bin/env bash
# Passwordless ssh between all hosts of the hostfile, as mpirun needs: from here to every host and
# from every host to every other (Open MPI starts its daemons through a tree of ssh logins).
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: setup/setup_ssh.sh [--help] [HOSTFILE]

1. Makes an ssh key at SSH_KEY if there is none (ed25519, no passphrase: mpirun cannot type one).
2. Installs it on every host with ssh-copy-id: asks each host's password once, or logs in with a
   key of a running ssh-agent; a host that already has the key is skipped.
3. Makes a key on every host that has none and adds every host's public key to every host's
   authorized_keys.
4. Proves BatchMode login (no password, no prompt) from here to every host and from every host to
   every other, all at once, and records each host key on first contact. Lists every failing pair.
Safe to run again: nothing is added twice. A hostfile of one host named by loopback (the shipped
localhost slots=2) needs no ssh, as mpirun starts its ranks without it: nothing to do.

Environment: HOSTFILE (default setup/hosts.txt), SSH_KEY (default ~/.ssh/id_ed25519: keep a name
ssh tries by itself, since mpirun runs plain ssh), SSH_TIMEOUT (connect timeout, default 5 s),
HOST_TIMEOUT (limit per host and step, default 10 s).
USAGE
}
# shellcheck source=setup/common.sh
. "$(dirname "$0")/common.sh"
hostfile_opening "$@"
if [ "${#HOSTS[@]}" -eq 1 ] && is_local "${HOSTS[0]}"; then
  echo "$PROG: ok: $HOSTFILE names only this machine (${HOSTS[0]}), where mpirun starts its ranks" \
    "without ssh: nothing to set up (list your hosts there first for a cluster: docs/cluster-setup.md)"
  exit 0
fi
SSH_KEY=${SSH_KEY:-$HOME/.ssh/id_ed25519}

if [ ! -f "$SSH_KEY" ]; then
  mkdir -p "$(dirname "$SSH_KEY")"
  chmod 700 "$(dirname "$SSH_KEY")"
  ssh-keygen -q -t ed25519 -N '' -C "vit-cluster $(hostname)" -f "$SSH_KEY"
  echo "$PROG: made key $SSH_KEY"
fi

for host in "${HOSTS[@]}"; do
  echo "$PROG: installing $SSH_KEY.pub on $host"
  ssh-copy-id -i "$SSH_KEY.pub" -o ConnectTimeout="$SSH_TIMEOUT" -o StrictHostKeyChecking=accept-new \
    "$host" >"$tmp/copy.log" 2>&1 || { cat "$tmp/copy.log" >&2; die "$host: ssh-copy-id failed"; }
done

# Every host gets its own key (none is copied around) and trusts every other host's key.
: >"$tmp/keys"
for host in "${HOSTS[@]}"; do
  timeout "$HOST_TIMEOUT" ssh "${SSH_OPTS[@]}" "$host" \
    'test -f ~/.ssh/id_ed25519 || ssh-keygen -q -t ed25519 -N "" -f ~/.ssh/id_ed25519 </dev/null; cat ~/.ssh/id_ed25519.pub' \
    </dev/null >>"$tmp/keys" 2>"$tmp/err" || die "$host: cannot read or make its key: $(tail -n 1 "$tmp/err")"
done
sort -u "$tmp/keys" -o "$tmp/keys"
for host in "${HOSTS[@]}"; do
  # shellcheck disable=SC2016 # expanded on the host
  timeout "$HOST_TIMEOUT" ssh "${SSH_OPTS[@]}" "$host" \
    'umask 077; mkdir -p ~/.ssh; touch ~/.ssh/authorized_keys
     while read -r key; do grep -qxF "$key" ~/.ssh/authorized_keys || echo "$key" >>~/.ssh/authorized_keys; done' \
    <"$tmp/keys" 2>"$tmp/err" || die "$host: cannot update authorized_keys: $(tail -n 1 "$tmp/err")"
done

# Each host tries all others at once and prints one "FAIL host: why" line per failing target.
# shellcheck disable=SC2016 # expanded on the host
check='for target in "$@"; do
  ( err=$(ssh -o BatchMode=yes -o ConnectTimeout='"$SSH_TIMEOUT"' -o StrictHostKeyChecking=accept-new \
      "$target" true 2>&1 >/dev/null </dev/null) \
    || echo "FAIL $target: $(echo "$err" | grep -v "^Warning: Permanently" | tail -n 1)" ) &
done
wait'
HOST_TIMEOUT=$((2 * SSH_TIMEOUT + HOST_TIMEOUT)) on_all_hosts "$tmp" "$check" "${HOSTS[@]}"
problems=()
for host in "${HOSTS[@]}"; do
  if [ "$(cat "$tmp/$host.rc")" != 0 ]; then
    problems+=("here -> $host: $(why_failed "$tmp" "$host")")
  fi
  while read -r _ target why; do
    problems+=("$host -> ${target%:}: $why")
  done < <(grep '^FAIL ' "$tmp/$host.out" || true)
done
if [ "${#problems[@]}" -gt 0 ]; then
  printf '%s: no BatchMode login for %d pair(s):\n' "$PROG" "${#problems[@]}" >&2
  printf '  %s\n' "${problems[@]}" >&2
  exit 1
fi
n=${#HOSTS[@]}
echo "$PROG: ok: BatchMode ssh works from here to $n host(s) and between all $((n * n)) host pairs"
