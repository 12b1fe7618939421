"""What one monitor sample costs with each backend: NVML (where it initialises), GPUtil (the real
nvidia-smi, or tests/fake_bin/nvidia-smi when there is none) and CPU-only. A benchmark to read, not
a test.

    python -m bench monitor [--samples N]

Per backend: wall milliseconds per sample (median and 95th percentile; spent in the sampler thread,
not in the training loop), CPU milliseconds per sample in this process and in child processes
(nvidia-smi), and the share of one core that costs at the default interval of 1 s.
"""

import os
import resource
import shutil
import statistics
import tempfile
import time

from vit.core.paths import ROOT
from vit.core.settings import positive_int
from vit.telemetry.monitor import Monitor


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench(backend: str, samples: int) -> str:
    with tempfile.TemporaryDirectory() as d:
        # the thread sleeps; we call sample() ourselves
        mon = Monitor(d, 0, interval_s=3600, backend=backend)
        mon.start()
        try:
            if mon.backend != backend:
                return f"unavailable (fell back to {mon.backend})"
            mon.sample()  # warm-up: imports, first process spawn
            walls, cpu0, child0 = [], time.process_time(), children_cpu_s()
            for _ in range(samples):
                t0 = time.perf_counter()
                mon.sample()
                walls.append(time.perf_counter() - t0)
            cpu_ms = 1e3 * (time.process_time() - cpu0) / samples
            child_ms = 1e3 * (children_cpu_s() - child0) / samples
        finally:
            mon.stop()
    walls.sort()
    median, p95 = 1e3 * statistics.median(walls), 1e3 * walls[int(0.95 * (len(walls) - 1))]
    return (
        f"wall {median:7.2f} ms median, {p95:7.2f} ms p95 | CPU {cpu_ms:6.2f} ms in-process + "
        f"{child_ms:6.2f} ms in nvidia-smi = {(cpu_ms + child_ms) / 10:.2f}% of a core at 1 s"
    )


def run(args) -> int:
    smi = shutil.which("nvidia-smi")
    if not smi:
        os.environ["PATH"] = f"{ROOT / 'tests' / 'fake_bin'}:{os.environ['PATH']}"
    print(
        f"host CPUs: {os.cpu_count()}; nvidia-smi: "
        f"{smi or 'none, using tests/fake_bin/nvidia-smi (a bash script)'}"
    )
    for backend in ("nvml", "gputil", "none"):
        print(f"{backend:>7}: {bench(backend, args.samples)}", flush=True)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--samples", type=positive_int, default=50, help="timed samples per backend")


COMMANDS = {"monitor": ("what one GPU/CPU monitor sample costs per backend", add_arguments, run)}
