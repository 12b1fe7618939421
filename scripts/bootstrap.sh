#!/usr/bin/env bash
# Creates the project's virtual environment (.venv) if missing and installs requirement.txt into it,
# with the torch build that this host's NVIDIA driver and GPUs can run, and then this checkout (pip install -e .).
# torch goes in first so that deepspeed, built without build isolation, compiles against it
# instead of pulling a second torch into its build environment.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: scripts/bootstrap.sh [--help] [--print-torch] [--fonts]

Creates .venv (python from $PYTHON, default python3) if it is missing and installs the pinned
packages of requirement.txt, with torch and torchvision in the build this host can run, and then
this checkout as the package vit (pip install -e . --no-deps: entry_cn.sh runs the installed vit):
  - nvidia-smi reports a driver >= 580.65.06 and only Turing or newer GPUs: the PyPI wheel (cu130);
  - a driver from 525.60.13 on, or a GPU older than Turing: cu126 from download.pytorch.org;
  - no nvidia-smi: the PyPI wheel, which runs on the CPU too;
  - a driver or GPU that no build runs: one line saying why, exit 2, nothing installed.
On a GPU host whose CUDA toolkit (CUDA_HOME, else nvcc on PATH, else /usr/local/cuda) matches the
chosen build's CUDA version, DeepSpeed is installed with its CPU Adam op prebuilt
(DS_BUILD_CPU_ADAM=1) for ZeRO-Offload; without one, it says which toolkit to install for that.
The builds, their minimum drivers and GPUs are the table BUILDS in this script (see docs/gpu.md).
Does nothing when .venv already matches requirement.txt and the chosen build and has this checkout
installed; a different choice replaces torch and torchvision.

Then the fonts of the glyphs task (--dataset glyphs: the Debian packages in vit/data/glyph_fonts.txt,
about 150 MB) with apt-get, when any is missing and this runs as root (or with sudo without a password);
otherwise one line says how, and everything else works without them.

  --print-torch  print the choice and why (torch build, CPU Adam), and install nothing (no .venv is made)
  --fonts        install only the glyphs task's fonts (as root or through sudo), nothing else

Environment: TORCH_CUDA (cu126, cu130, cu132, cpu, ...: this build instead of the choice; cpu is
the smaller CPU-only build), PYTHON (interpreter for a new venv), VENV (folder, default .venv).
USAGE
}

# DeepSpeed's CPU accelerator builds its shared-memory communication op on first use (about 30 s, once
# per venv); build it here, where vit.train's runs find it (TORCH_EXTENSIONS_DIR=<venv>/torch_extensions
# with the venv's ninja first on PATH, as vit.train.prepare_environment sets them), so that a fresh
# clone's first run takes as long as the next. A host with a GPU trains over NCCL and needs none.
build_cpu_comm_op() {
  command -v nvidia-smi >/dev/null 2>&1 && return 0
  local venv
  venv=$(cd "$VENV" && pwd)
  echo "$PROG: building DeepSpeed's CPU communication op (about 30 s, once)"
  TORCH_EXTENSIONS_DIR="$venv/torch_extensions" PATH="$venv/bin:$PATH" "$venv/bin/python" -c \
    'from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()' \
    >/dev/null 2>&1 || echo "$PROG: the op did not build now; the first run builds it"
}

# install_fonts [required]: the glyphs task's font packages (vit/data/glyph_fonts.txt), when some are
# missing: with apt-get as root, or through sudo without a password; otherwise one line (an error when
# required, with --fonts).
install_fonts() {
  local pkgs missing sudo=()
  command -v dpkg-query >/dev/null 2>&1 || {
    echo "$PROG: no dpkg here: the glyphs task needs the fonts of vit/data/glyph_fonts.txt (or VIT_GLYPH_FONTS)"
    return 0
  }
  mapfile -t pkgs < <(sed 's/#.*//' vit/data/glyph_fonts.txt | awk 'NF { print $1 }')
  mapfile -t missing < <(for p in "${pkgs[@]}"; do
    dpkg-query -W -f '${db:Status-Abbrev}' "$p" 2>/dev/null | grep -q '^ii' || echo "$p"; done)
  [ "${#missing[@]}" -gt 0 ] || return 0
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      sudo=(sudo -n)
    else
      local msg="${#missing[@]} font packages of the glyphs task are missing: run sudo scripts/bootstrap.sh --fonts"
      [ -n "${1:-}" ] && fail "$msg"
      echo "$PROG: $msg (only --dataset glyphs needs them)"
      return 0
    fi
  fi
  echo "$PROG: installing the glyphs task's fonts (${#missing[@]} Debian packages, apt-get)"
  if ! { "${sudo[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install \
      -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }; then
    local msg="apt-get could not install the glyphs task's fonts (${missing[*]:0:3} ...)"
    [ -n "${1:-}" ] && fail "$msg"
    echo "$PROG: $msg; only --dataset glyphs needs them: scripts/bootstrap.sh --fonts tries again"
  fi
}

# shellcheck source=setup/common.sh
. "$(dirname "$0")/../setup/common.sh"
print_only=0
fonts_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --print-torch) print_only=1; shift ;;
    --fonts) fonts_only=1; shift ;;
    *) unknown_option "$1" ;;
  esac
done
cd "$ROOT"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_CUDA=${TORCH_CUDA:-}

# The torch builds to choose from, for torch $TABLE_TORCH. Sources:
# - builds and their GPUs: PyTorch's CUDA support matrix for 2.14 (RELEASE.md; pytorch/pytorch#190355,
#   #194367): CUDA 12.6 (legacy: Maxwell 5.0, Pascal 6.0, Volta 7.0, Turing 7.5, Ampere 8.0/8.6,
#   Hopper 9.0), 13.0 and 13.2 (Turing 7.5 to Blackwell 12.0, +PTX for newer); CUDA 12.8 builds
#   ended with 2.12 (#182849).
# - the PyPI wheel of torch 2.14.1 is the cu130 build: its metadata requires cuda-toolkit 13.0.3, and
#   torch.cuda.get_arch_list() lists sm_75 to sm_120 (checked with pip and the installed wheel).
# - minimum Linux drivers: NVIDIA's CUDA minor-version compatibility guide and toolkit release notes:
#   CUDA 12.x runs on >= 525.60.13, CUDA 13.x needs >= 580.65.06.
# Columns: build, minimum driver, lowest compute capability it has kernels for, the first it has
# none for (-: PTX covers newer GPUs), where pip gets it (pypi: the default index).
TABLE_TORCH=2.14.1
BUILDS="\
cu130 580.65.06 7.5 -    pypi
cu126 525.60.13 5.0 10.0 https://download.pytorch.org/whl/cu126
cu132 580.65.06 7.5 -    https://download.pytorch.org/whl/cu132
cpu   -         -   -    https://download.pytorch.org/whl/cpu"
AUTO="cu130 cu126"  # tried in this order: the PyPI wheel, then the newest cu12x build

fail() { echo "$PROG: $*" >&2; exit 2; }
pin() { grep -E "^$1==" requirement.txt; }
row() { awk -v b="$1" '$1 == b' <<<"$BUILDS"; }
version_ge() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1)" = "$2" ]; }

if [ "$fonts_only" = 1 ]; then
  install_fonts required
  echo "$PROG: the glyphs task's fonts are installed"
  exit 0
fi

# choose_torch: sets build, where (pypi or an index URL) and reason.
choose_torch() {
  local torch_version driver caps seen cc b min_driver min_cc no_cc fix refused=""
  torch_version=$(pin torch | cut -d= -f3)
  [ "$torch_version" = "$TABLE_TORCH" ] || fail "requirement.txt pins torch==$torch_version but BUILDS in" \
    "scripts/bootstrap.sh describes torch $TABLE_TORCH: update the table from PyTorch's CUDA support matrix"
  if [ -n "$TORCH_CUDA" ]; then
    build=$TORCH_CUDA
    where=$(row "$build" | awk '{ print $5 }')
    reason="set by TORCH_CUDA"
    if [ -z "$where" ]; then
      [[ "$build" =~ ^(cpu|cu[0-9]+|rocm[0-9.]+)$ ]] || fail "TORCH_CUDA=$build is not a build name (cu126, cu130, cpu, ...)"
      where=https://download.pytorch.org/whl/$build
      reason+="; not one of the builds this script knows for torch $TABLE_TORCH: $(awk '{ print $1 }' <<<"$BUILDS" | paste -sd ' ')"
    fi
    return
  fi
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    read -r build _ _ _ where <<<"$(awk '$5 == "pypi"' <<<"$BUILDS")"
    reason="no nvidia-smi here, so no NVIDIA driver to match: the PyPI wheel, which also runs on the CPU (TORCH_CUDA=cpu: the smaller CPU-only build)"
    return
  fi
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -n 1) || true
  [[ "$driver" =~ ^[0-9]+(\.[0-9]+)+$ ]] \
    || fail "nvidia-smi did not report a driver version ('$driver'): fix the driver, or choose a build with TORCH_CUDA"
  # One driver per host, a compute capability per GPU; an nvidia-smi too old to report that leaves
  # the choice to the driver.
  caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | grep -E '^[0-9]+\.[0-9]+$' | sort -uV || true)
  seen="driver $driver, compute capability $(paste -sd ' ' <<<"${caps:-not reported}")"
  for b in $AUTO; do
    read -r _ min_driver min_cc no_cc where <<<"$(row "$b")"
    if ! version_ge "$driver" "$min_driver"; then
      refused+="; $b needs driver >= $min_driver"
      continue
    fi
    for cc in $caps; do
      if ! version_ge "$cc" "$min_cc" || { [ "$no_cc" != - ] && version_ge "$cc" "$no_cc"; }; then
        refused+="; $b has no kernels for compute capability $cc"
        continue 2
      fi
    done
    build=$b
    reason="$seen$refused${refused:+; $b runs on drivers >= $min_driver}"
    return
  done
  fix="TORCH_CUDA=cpu for the CPU-only build"
  [[ "$refused" != *"needs driver"* ]] || fix="update the NVIDIA driver, or $fix"
  fail "no torch $TABLE_TORCH build runs on this host ($seen)$refused: $fix"
}

# The CUDA toolkit torch's extension builder would use: CUDA_HOME, CUDA_PATH, the nvcc on PATH, /usr/local/cuda.
cuda_home() {
  local nvcc
  if [ -n "${CUDA_HOME:-${CUDA_PATH:-}}" ]; then echo "${CUDA_HOME:-$CUDA_PATH}"
  elif nvcc=$(command -v nvcc); then dirname "$(dirname "$nvcc")"
  elif [ -d /usr/local/cuda ]; then echo /usr/local/cuda
  fi
}

# choose_cpu_adam: sets adam_home (a toolkit to prebuild DeepSpeed's CPU Adam with, or empty) and
# adam_reason. On GPUs DeepSpeed builds that op (ZeRO-Offload's optimizer) against CUDA, and only with a
# toolkit of torch's CUDA version: the same major.minor, or two 12.x (DeepSpeed's cuda_minor_mismatch_ok).
choose_cpu_adam() {
  local want home release
  adam_home=""
  if [[ "$build" != cu* ]] || ! command -v nvidia-smi >/dev/null 2>&1; then
    adam_reason="not prebuilt: no GPU build of torch on a GPU host (on the CPU DeepSpeed builds it on first use)"
    return
  fi
  want=${build#cu}
  want=${want%?}.${want: -1}  # cu130 -> 13.0, cu126 -> 12.6
  home=$(cuda_home)
  release=""
  if [ -n "$home" ]; then
    release=$("$home/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p') || true
  fi
  if [ -n "$release" ] && { [ "$release" = "$want" ] || [[ "$release" == 12.* && "$want" == 12.* ]]; }; then
    adam_home=$home
    adam_reason="prebuilt (DS_BUILD_CPU_ADAM=1) with the CUDA $release toolkit at $home"
    return
  fi
  if [ -z "$home" ]; then adam_reason="not prebuilt: no CUDA toolkit found"
  elif [ -z "$release" ]; then adam_reason="not prebuilt: $home has no working bin/nvcc"
  elif [ "${release%%.*}" = "${want%%.*}" ]; then
    # torch's JIT build takes any minor version of the same major: ZeRO-Offload works, after a first build.
    adam_reason="not prebuilt: $home has CUDA $release, and DeepSpeed's installer wants $want (the op builds on first use)"
    return
  else adam_reason="not prebuilt: $home has CUDA $release"
  fi
  adam_reason+="; for ZeRO-Offload install NVIDIA's cuda-toolkit-${want/./-} and set CUDA_HOME to it, then rerun this script"
}

# install_project: this checkout into the venv, editable (pyproject.toml), unless python -I (no current
# folder, no PYTHONPATH) already finds vit here; entry_cn.sh runs that package.
install_project() {
  local found
  found=$("$VENV/bin/python" -I -c 'import importlib.util as u, os; s = u.find_spec("vit")
print(os.path.realpath(s.submodule_search_locations[0]) if s else "")' 2>/dev/null) || true
  [ "$found" != "$(pwd -P)/vit" ] || return 0
  echo "$PROG: installing this checkout into $VENV (pip install -e .)"
  "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet --no-deps --no-build-isolation -e .
}

choose_torch
choose_cpu_adam
torch_pins=("$(pin torch)" "$(pin torchvision)")
if [ "$where" = pypi ]; then
  from=() source_name="PyPI"
else
  from=(--index-url "$where") source_name=$where
fi
if [ "$print_only" = 1 ]; then
  echo "$build: $reason"
  echo "pip install ${torch_pins[*]} from $source_name"
  echo "DeepSpeed's CPU Adam: $adam_reason"
  exit 0
fi

# The stamp: "<sha256 of requirement.txt> torch=<build> cpu_adam=<toolkit or ->". One without a build
# predates the choice: that venv has the PyPI wheel.
stamp="$VENV/.requirement.sha256"
want_hash=$(sha256sum requirement.txt | cut -d' ' -f1)
read -r have_hash installed have_adam 2>/dev/null <"$stamp" || true
installed=${installed:-${have_hash:+torch=cu130}}
installed=${installed#torch=}
want_adam=cpu_adam=${adam_home:--}
if [ "${have_hash:-}" = "$want_hash" ] && [ "$installed" = "$build" ] && [ "${have_adam:-cpu_adam=-}" = "$want_adam" ]; then
  install_project  # a .venv made before pyproject.toml has the packages but not the project
  install_fonts
  exit 0
fi
# torch's cpp_extension does not quote its paths: DeepSpeed's ops (built in the venv, from its
# headers there) fail to link from a path with a space, and the first run ends in a traceback.
case "$(realpath -m "$VENV")" in
  *[[:space:]]*) fail "the venv's path '$(realpath -m "$VENV")' has a space, which DeepSpeed's op build cannot take (torch's cpp_extension does not quote paths): clone the checkout where the path has none, or give VENV=/a/path/without/spaces" ;;
esac
echo "$PROG: torch $build: $reason"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# pip would keep a torch of another build (its version satisfies the pin): that one goes first.
if [ "$installed" != "$build" ] && "$VENV/bin/python" -m pip show torch >/dev/null 2>&1; then
  echo "$PROG: replacing torch and torchvision (${installed:-build unknown}) with the $build build"
  "$VENV/bin/python" -m pip uninstall --yes --quiet torch torchvision
fi
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check --quiet)
"${pip[@]}" --upgrade pip "$(pin setuptools)" wheel
"${pip[@]}" "${from[@]}" "${torch_pins[@]}"
"${pip[@]}" "$(pin numpy)"
"${pip[@]}" --no-build-isolation -r requirement.txt
if [ -n "$adam_home" ]; then
  echo "$PROG: DeepSpeed's CPU Adam: $adam_reason (a few minutes)"
  DS_BUILD_CPU_ADAM=1 CUDA_HOME=$adam_home "${pip[@]}" --no-build-isolation --no-deps --force-reinstall \
    --no-cache-dir "$(pin deepspeed)"
fi
install_project
build_cpu_comm_op
install_fonts
echo "$want_hash torch=$build $want_adam" > "$stamp"
echo "$PROG: $VENV is ready ($("$VENV/bin/python" -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)' 2>/dev/null))"
