#!/usr/bin/env bash
# Per-rank entry point. Run it directly (one process) or once per rank under mpirun, srun or torchrun:
#   mpirun -np 5 --hostfile setup/hosts.txt ./entry_cn.sh [options]
# It activates the project's .venv when there is one, reads setup/cluster.env (the network interface)
# when present, and runs `python -m vit.train` with its arguments: the vit installed from this checkout
# (pip install -e ., which scripts/bootstrap.sh does). Rank, world size and rank 0's address
# (MASTER_ADDR/MASTER_PORT, never 127.0.0.1 across hosts) are found by vit/runtime/dist_env.py.
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
# The vit that `python -m` will import (the current folder first, as -m has it) must be this checkout's: not
# another clone's, not none.
python -c 'import importlib.util as u, os, sys
spec, want = u.find_spec("vit"), os.path.realpath(os.path.join(sys.argv[1], "vit"))
found = spec and os.path.realpath(spec.submodule_search_locations[0])
if found != want:
    print(f"entry_cn.sh: error: {sys.executable} " + (f"imports vit from {found}, not from {want}" if found else
          "has no vit package") + f": run scripts/bootstrap.sh (or pip install -e {sys.argv[1]})", file=sys.stderr)
    sys.exit(2)' "$here"
# Once a rank has died, c10d logs each failing call to the job's store as a warning with its C++ stack frames; every
# rank says what happened in one line instead. --verbose (or TORCH_CPP_LOG_LEVEL set) shows them.
cpp_log_level=ERROR
for arg in "$@"; do [ "$arg" != --verbose ] || cpp_log_level=WARNING; done
export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-$cpp_log_level}"
exec python -m vit.train "$@"
