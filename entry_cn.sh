#!/usr/bin/env bash
# Per-rank entry point. Run it directly (one process) or once per rank under mpirun, srun or torchrun:
#   mpirun -np 5 --hostfile setup/hosts.txt ./entry_cn.sh [options]
# It activates the project's .venv when there is one, reads setup/cluster.env (the network interface)
# when present, and runs `python -m vit.train` with its arguments. Rank, world size and rank 0's address
# (MASTER_ADDR/MASTER_PORT, never 127.0.0.1 across hosts) are found by vit/dist_env.py.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [ -z "${VIRTUAL_ENV:-}" ] && [ -f "$here/.venv/bin/activate" ]; then
  set +u
  # shellcheck disable=SC1091
  source "$here/.venv/bin/activate"
  set -u
fi
if [ -f "$here/setup/cluster.env" ]; then
  # shellcheck disable=SC1091
  source "$here/setup/cluster.env"
fi
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec python -m vit.train "$@"
