#!/usr/bin/env bash
# Creates the project's virtual environment (.venv) if missing and installs requirement.txt into it.
# torch goes in first so that deepspeed, built without build isolation, compiles against it
# instead of pulling a second torch into its build environment.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: scripts/bootstrap.sh [--help]

Creates .venv (python from $PYTHON, default python3) if it is missing and installs the pinned
packages of requirement.txt. Does nothing when .venv already matches requirement.txt.
Environment: PYTHON (interpreter for the new venv), VENV (folder, default .venv).
USAGE
}
case "${1:-}" in -h|--help) usage; exit 0 ;; "") ;; *) echo "bootstrap.sh: unknown argument '$1'" >&2; exit 2 ;; esac

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.requirement.sha256"
want=$(sha256sum requirement.txt | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check --quiet)
pin() { grep -E "^$1==" requirement.txt; }
"${pip[@]}" --upgrade pip "$(pin setuptools)" wheel
"${pip[@]}" "$(pin torch)" "$(pin torchvision)" "$(pin numpy)"
"${pip[@]}" --no-build-isolation -r requirement.txt
echo "$want" > "$stamp"
echo "bootstrap.sh: $VENV is ready ($("$VENV/bin/python" -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)' 2>/dev/null))"
