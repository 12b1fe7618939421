#!/usr/bin/env bash
# Trains the same model on the same data with every engine, for the same number of steps, then charts and
# tabulates them all with plot_logs.py.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: scripts/compare.sh [--help] [--hostfile FILE] [-- EXTRA_TRAIN_OPTIONS...]

Runs `mpirun -np NP ./entry_cn.sh` once per engine in RUNS, each into OUT/<name> (its output in
OUT/<name>/output.log), then `python plot_logs.py OUT/<name>... --out OUT/plots` (charts,
comparison.md/.csv, report.html). Every run gets the same model, data set, steps and seed, and the
JSONs of deepspeed_configs/ give them the same global batch, 32 x NP: ddp and zero* 32 images x 1
micro-batch per rank, the pipeline 16 x 4 micro-batches per 2-stage copy. A run that fails is reported
and left out; the script then exits 1 at the end. Ctrl-C stops the run in progress and starts no
other (exit 130). With a hostfile, each run's JSON lines are fetched
from every host with scp (same checkout path on every host) unless OUT is a folder they all share.

Run names: ddp, zero0, zero1, zero2, zero3 (--engine zero --ds-config deepspeed_configs/zeroN.json),
pipeline (--engine pipeline --pipeline-stages PIPELINE_STAGES).

EXTRA_TRAIN_OPTIONS go to every run, so an engine's own option needs RUNS of that engine alone, e.g.
RUNS=async-pipeline OUT=logs/wire-bf16 scripts/compare.sh -- --pipe-wire-dtype bf16 (one OUT per wire dtype;
python -m bench async-pipeline --wire-dtypes fp32,bf16 runs both and tabulates them).

Environment (defaults in brackets):
  NP               ranks [2]
  HOSTFILE         mpirun hostfile for a cluster (or --hostfile) [none: all ranks on this machine]
  STEPS            optimizer steps per run [20]
  MODEL            model preset [vit_digits]
  DATASET          data set [digits]
  PIPELINE_STAGES  stages of the pipeline run [2]
  PIPELINE_CONFIG  DeepSpeed JSON of the pipeline run [deepspeed_configs/pipeline.json]
  LOG_INTERVAL     steps between metric records [2]
  EVAL_INTERVAL    steps between evaluations [0: only at the end]
  MONITOR_INTERVAL seconds between monitor samples [0.5]
  RUNS             runs to make, space-separated, from ddp zero0..zero3 pipeline async-pipeline diloco
                   [every one: the engine registry's runs, as bench.runs lists them]
  OUT              output folder, relative to the repository root [logs/compare-<date-time>]
  MPIRUN_ARGS      extra mpirun arguments, split on spaces (runs go through scripts/mpirun, which uses
                   MPIRUN [.venv/bin/mpirun] and adds --allow-run-as-root for root)
setup/cluster.env (IFACE) is sourced first, as entry_cn.sh does.
USAGE
}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --hostfile) HOSTFILE=${2:?--hostfile needs a file}; shift 2 ;;
    --) shift; break ;;
    *) echo "compare.sh: unknown option '$1' (train options go after --)" >&2; exit 2 ;;
  esac
done

NP=${NP:-2}
HOSTFILE=${HOSTFILE:-}
STEPS=${STEPS:-20}
MODEL=${MODEL:-vit_digits}
DATASET=${DATASET:-digits}
PIPELINE_STAGES=${PIPELINE_STAGES:-2}
PIPELINE_CONFIG=${PIPELINE_CONFIG:-deepspeed_configs/pipeline.json}
LOG_INTERVAL=${LOG_INTERVAL:-2}
EVAL_INTERVAL=${EVAL_INTERVAL:-0}
MONITOR_INTERVAL=${MONITOR_INTERVAL:-0.5}
PYTHON=${PYTHON:-$root/.venv/bin/python}
RUNS=${RUNS:-$("$PYTHON" -c 'from bench.runs import RUNS; print(*RUNS)')}
OUT=${OUT:-logs/compare-$(date +%Y%m%d-%H%M%S)}

# Paths given relative to where the script was started; the defaults are relative to the repository.
[ -z "$HOSTFILE" ] || HOSTFILE=$(realpath "$HOSTFILE")
[ ! -f "$PIPELINE_CONFIG" ] || PIPELINE_CONFIG=$(realpath "$PIPELINE_CONFIG")
cd "$root"
if [ -f setup/cluster.env ]; then
  # shellcheck disable=SC1091
  . setup/cluster.env
fi
read -r -a mpi_args <<<"${MPIRUN_ARGS:-}"
# More ranks than cores on one machine needs --oversubscribe; with a hostfile the slots decide, and Open MPI 5's
# --oversubscribe would put every rank on the first host.
if [ -n "$HOSTFILE" ]; then mpi_args+=(--hostfile "$HOSTFILE"); else mpi_args+=(--oversubscribe); fi
for var in GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME; do
  [ -z "${!var:-}" ] || mpi_args+=(-x "$var")
done

# engine_of NAME: the engine options of run NAME (bench/runs.py, the map the training benchmark uses too), into
# the array `engine`; fails for an unknown name.
engine_of() {
  local options
  options=$("$PYTHON" -m bench.runs "$1" --pipeline-stages "$PIPELINE_STAGES" --pipeline-config "$PIPELINE_CONFIG" \
    2>/dev/null) || return 1
  mapfile -t engine <<<"$options"
}

# gather DIR: without a folder shared by the hosts, each host keeps its own ranks' JSON lines; fetch them
# from every host of the hostfile (same checkout path everywhere), never overwriting a file already here.
gather() {
  local dir host tmp
  dir=$(cd "$1" && pwd)
  tmp=$(mktemp -d)
  while read -r host; do
    scp -q -o BatchMode=yes -o ConnectTimeout=10 "$host:$dir/*_rank*.jsonl" "$tmp/" </dev/null 2>/dev/null || true
  done < <(awk '{ sub(/#.*/, "") } NF { print $1 }' "$HOSTFILE" | sort -u)
  cp -n "$tmp"/* "$dir/" 2>/dev/null || true
  rm -rf "$tmp"
}

for name in $RUNS; do
  engine_of "$name" || { echo "compare.sh: unknown run '$name' in RUNS ($("$PYTHON" -c 'from bench.runs import RUNS; print(*RUNS, sep=", ")'))" >&2; exit 2; }
done
done_runs=() failed=()
stopped=""  # Ctrl-C or SIGTERM: the run in progress stops, the others are not started
trap 'stopped=130' INT
trap 'stopped=143' TERM
for name in $RUNS; do
  engine_of "$name"
  mkdir -p "$OUT/$name"
  echo "compare.sh: $name: scripts/mpirun -np $NP ${mpi_args[*]} ./entry_cn.sh ${engine[*]} ..."
  train=(--model "$MODEL" --dataset "$DATASET" --steps "$STEPS" --log-interval "$LOG_INTERVAL"
         --eval-interval "$EVAL_INTERVAL" --monitor-interval "$MONITOR_INTERVAL" --no-save --log-dir "$OUT/$name")
  status=0
  scripts/mpirun -np "$NP" "${mpi_args[@]}" ./entry_cn.sh "${engine[@]}" "${train[@]}" "$@" \
    </dev/null >"$OUT/$name/output.log" 2>&1 || status=$?
  if [ -n "$stopped" ] || [ "$status" = 130 ]; then
    echo "compare.sh: interrupted during $name: the runs after it not started" >&2
    exit "${stopped:-130}"
  fi
  if [ "$status" = 0 ]; then
    tail -n 1 "$OUT/$name/output.log"
    [ -z "$HOSTFILE" ] || gather "$OUT/$name"
    done_runs+=("$OUT/$name")
  else
    echo "compare.sh: $name failed; last lines of $OUT/$name/output.log:" >&2
    tail -n 20 "$OUT/$name/output.log" >&2
    failed+=("$name")
  fi
done

[ "${#done_runs[@]}" -gt 0 ] || { echo "compare.sh: every run failed" >&2; exit 1; }
"$PYTHON" plot_logs.py "${done_runs[@]}" --out "$OUT/plots"
[ "${#failed[@]}" -eq 0 ] || { echo "compare.sh: failed runs: ${failed[*]}" >&2; exit 1; }
