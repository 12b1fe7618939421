"""GEMM TFLOP/s of this machine in fp32 and bf16, the best of --repeats (for a CPU's entry in
PEAK_TFLOPS)."""

import time

import torch

from bench.common import device_name, load_avg
from vit.core.settings import positive_int


def run(a) -> int:
    """GEMM throughput of this device, for PEAK_TFLOPS where no vendor figure applies (a CPU)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"{device_name()}, {torch.get_num_threads()} threads, load average {load_avg()}")
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = torch.randn(a.size, a.size, device=dev, dtype=dtype)
        best = float("inf")
        for _ in range(a.repeats):  # the best of several: other processes only ever slow it down
            if dev.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            x @ x
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        print(
            f"{precision}: {2 * a.size**3 / best / 1e12:.4f} TFLOP/s "
            f"({a.size}^3 GEMM, best of {a.repeats})"
        )
    return 0


def add_arguments(p) -> None:
    p.add_argument("--size", type=positive_int, default=2048, help="side of the square matrices")
    p.add_argument(
        "--repeats", type=positive_int, default=10, help="GEMMs timed; the fastest counts"
    )


COMMANDS = {"peak": (__doc__, add_arguments, run)}
