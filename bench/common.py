"""What the benchmarks share: the device and its peak FLOP/s, FLOPs per image, launching vit.train
under mpirun and reading its step time, and publishing a table (printed, and with --out written as
NAME.md and NAME.json)."""

import argparse
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from vit.core.paths import ROOT
from vit.telemetry.jsonl import read_jsonl
from vit.telemetry.metrics import write_json

# Peak dense TFLOP/s of one device, by its exact name (torch.cuda.get_device_name(), or this
# module's device_name() for a CPU): a name that is not here has no MFU, never a near match's (an
# RTX 3090 Ti is not an RTX 3090). GPUs: vendor specs without sparsity; bf16/fp16 are tensor-core
# rates with FP32 accumulate (what autocast and DeepSpeed use; GeForce cards run FP16-accumulate at
# twice that), fp32 the non-tensor rate. CPUs: measured with `python -m bench peak` (a GEMM on all
# cores), not specs.
PEAK_TFLOPS = {
    "NVIDIA H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "fp32": 51.2},
    "NVIDIA H100 NVL": {"bf16": 835.5, "fp16": 835.5, "fp32": 60.0},
    "NVIDIA H100 80GB HBM3": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # SXM5
    "NVIDIA H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "NVIDIA A100-SXM4-40GB": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "NVIDIA A100-SXM4-80GB": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "NVIDIA A100-PCIE-40GB": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "NVIDIA A100 80GB PCIe": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "NVIDIA GeForce RTX 4090": {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6},
    "NVIDIA GeForce RTX 3090 Ti": {"bf16": 80.0, "fp16": 80.0, "fp32": 40.0},
    "NVIDIA GeForce RTX 3090": {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6},
    "NVIDIA GeForce RTX 3070 Ti": {"bf16": 43.5, "fp16": 43.5, "fp32": 21.7},
    "NVIDIA GeForce RTX 3070": {"bf16": 40.6, "fp16": 40.6, "fp32": 20.3},
    # The 2-core KVM VM of docs/benchmarks.md (Zen 4: family 25 model 17, AVX-512 with bf16): the
    # best of `python -m bench peak --size 1024` at load 0.6 (fp32 0.178, bf16 0.428; 2048^3 gives
    # 0.15-0.16 and 0.40-0.42).
    "AMD EPYC (2 cores)": {"bf16": 0.43, "fp32": 0.18},
}


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    return f"{model} ({os.cpu_count()} cores)"


def peak_tflops(name: str, precision: str) -> float | None:
    return PEAK_TFLOPS.get(name, {}).get(precision)


def total_peak_tflops(
    gpus: list[str], precision: str, per_device: float | None = None
) -> float | None:
    """The peak of a run's GPUs together, each rank's its own (mixed GPUs); None when one is
    unknown. `per_device` (--peak-tflops) stands for every GPU."""
    peaks = [per_device or peak_tflops(name, precision) for name in gpus]
    return None if None in peaks else sum(peaks)


def flops_per_image(model: nn.Module, img_size: int) -> float:
    """Forward FLOPs of one image; attention through the math kernel, whose matmuls the counter
    sees."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    x = torch.randn(1, 3, img_size, img_size, device=next(model.parameters()).device)
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(x)
    return float(counter.get_total_flops())


def seed_list(text: str) -> list[int]:
    """argparse type: comma-separated seeds, e.g. 0,1,2."""
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a comma-separated list of seeds, e.g. 0,1,2"
        ) from None
    if any(x < 0 for x in seeds):
        raise argparse.ArgumentTypeError(f"'{text}': seeds are 0 or more")
    return seeds


def child_env(**extra) -> dict:
    """This environment for a child python: ROOT first on PYTHONPATH, keeping what was there (a
    --target install of DeepSpeed on a lent GPU machine, say)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def publish(out: str | None, name: str, result: dict, table: str, quiet: bool = False) -> None:
    """Print a benchmark's markdown table (unless quiet); with --out also write it as NAME.md and
    the numbers as NAME.json."""
    if not quiet:
        print(table)
    if out:
        os.makedirs(out, exist_ok=True)
        write_json(os.path.join(out, f"{name}.json"), result)
        Path(out, f"{name}.md").write_text(table)


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


class OthersCpu:
    """Cores kept busy by other processes (and other VMs' steal) while a row ran: the machine's busy
    time from /proc/stat less this process's and its children's CPU time. On a shared machine it
    says which rows to trust."""

    def __init__(self):
        self.start = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float]:
        # the cpu line's user .. steal; busy: all of them less idle and iowait
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
        busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        own = sum(
            getattr(resource.getrusage(who), f)
            for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
            for f in ("ru_utime", "ru_stime")
        )
        return time.perf_counter(), busy, own

    def cores(self) -> float:
        (t0, busy0, own0), (t1, busy1, own1) = self.start, self._now()
        return round(max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0), 2)


def mpirun_train(
    train: list,
    ranks: int,
    log_dir: Path,
    timeout: float,
    mpirun_args: str = "",
    env: dict | None = None,
) -> int | str:
    """`mpirun -np ranks ./entry_cn.sh TRAIN...`, its output in LOG_DIR/output.log; the exit code,
    or why it was killed. With a --hostfile in mpirun_args, no --oversubscribe: Open MPI 5 then puts
    every rank on the first host (scripts/compare.sh). One rank without mpirun options runs as one
    process of this python, no launcher. `env`: variables for every rank (mpirun -x passes them to
    other hosts)."""
    env = env or {}
    extra = shlex.split(mpirun_args)
    mpirun = [
        str(ROOT / "scripts" / "mpirun"),
        "-np",
        str(ranks),
        *([] if "--hostfile" in extra else ["--oversubscribe"]),
        *extra,
        *(a for k in env for a in ("-x", k)),
    ]
    cmd = (
        [sys.executable, "-m", "vit.train"]
        if ranks == 1 and not extra
        else [*mpirun, str(ROOT / "entry_cn.sh")]
    )
    with open(log_dir / "output.log", "w") as out:
        p = subprocess.Popen(
            [*cmd, *map(str, train)],
            cwd=ROOT,
            env=child_env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM first: scripts/mpirun passes it on to Open MPI (in a session of its own)
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            return f"timed out after {timeout} s"


def failure_tail(log_dir: Path) -> str:
    return f"{log_dir / 'output.log'} ends:\n  " + "\n  ".join(
        (log_dir / "output.log").read_text().splitlines()[-5:]
    )


def median_step_s(log_dir: Path, warmup: int) -> float:
    """Rank 0's median step time over the metric windows after the first (warm-up) one: a burst of
    load from other processes on a shared machine skews one window, not all."""
    records = [r for r in read_jsonl(log_dir / "metrics_rank0.jsonl") if r["kind"] == "train"]
    return statistics.median(r["step_time_s"] for r in records if r["step"] > warmup)
