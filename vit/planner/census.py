"""The census: what every rank's device is and can run, and how fast it is (vit.runtime.precision
settles the precision)."""

import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from vit.core.spec import EngineSpec
from vit.planner.memory import device_memory
from vit.runtime import plugins
from vit.runtime.precision import DTYPES, deepspeed_fp16, gpu_precisions
from vit.runtime.slowdown import Clock


def capabilities(dev: torch.device, local_world_size: int, engine: EngineSpec) -> dict:
    """This rank's device: name, memory, compute capability and what it trains in under `engine`
    (vit.runtime.precision.gpu_precisions; on a CPU, what DeepSpeed's accelerator says).

    A plugin may change the report (vit.runtime.plugins' "census" hook), so that tests can stand in
    for a GPU without bf16 on a machine that has none."""
    from deepspeed.accelerator import get_accelerator

    name, free, total = device_memory(dev, local_world_size)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        capability = f"{props.major}.{props.minor}"
        native = gpu_precisions((props.major, props.minor), engine, deepspeed_fp16(dev.index or 0))
    else:
        capability = None
        acc = get_accelerator()
        native = {"fp16": bool(acc.is_fp16_supported()), "bf16": bool(acc.is_bf16_supported())}
    report = {
        "host": socket.gethostname(),
        "machine": machine_id(),
        "device": name,
        "capability": capability,
        "mem_total_gib": total / 2**30,
        "mem_free_gib": free / 2**30,
        **native,
    }
    plugins.call("census", report)
    return report


def machine_id() -> str:
    """What ranks sharing one machine's processors have in common and ranks on other machines do
    not: the running kernel's boot id (network namespaces and containers on one machine share it,
    with their own host names), else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


# consumer GPUs ramp their clocks up over the first few hundred ms of load: time only after that
WARMUP_S = 0.2
TIMED_REPS = 20


def warmup_s(dev: torch.device) -> float:
    """How long to run what is timed before timing it: a GPU's clock ramp; a CPU has none to wait
    for (the first, untimed call and the fastest of the timed ones are enough), and the 0.2 s cost
    every CPU rank of every run about 0.4 CPU-s at start-up."""
    return WARMUP_S if dev.type == "cuda" else 0.0


def _timed(fn, clock: Clock, reps: int = TIMED_REPS, warmup: float | None = None) -> float:
    """Fastest of `reps` runs of fn() after running it for at least `warmup` seconds (the device's
    warmup_s), slowed like the rank's layers (in seconds; the fastest, because a busy host only ever
    slows a run down)."""
    warmup = warmup_s(clock.device) if warmup is None else warmup
    start = clock.now()
    fn()
    while clock.now() - start < warmup:
        fn()
    times = []
    for _ in range(reps):
        start = clock.now()
        clock.start()
        fn()
        clock.stop()
        times.append(clock.now() - start)
    return min(times)


def measure_speed(
    dev: torch.device,
    precision: str,
    block: nn.Module,
    block_input: tuple[int, ...],
    slowdown: float,
    autocast: bool = False,
) -> dict:
    """A timed matmul and one timed forward and backward of a ViT block on an input of the run's
    shape; with `autocast`, the block in fp32 under torch.autocast in `precision`, as an engine that
    autocasts trains it."""
    dtype = DTYPES[precision]
    clock = Clock(slowdown, dev)
    n = 4096 if dev.type == "cuda" else 512
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    matmul_s = _timed(lambda: a @ b, clock)
    cast = torch.float32 if autocast else dtype
    block = block.to(dev, cast)
    x = torch.randn(*block_input, device=dev, dtype=cast, requires_grad=True)

    def step():
        with torch.autocast(dev.type, dtype, enabled=autocast and precision != "fp32"):
            y = block(x)
        y.float().sum().backward()

    block_s = _timed(step, clock)
    return {"matmul_tflops": 2 * n**3 / matmul_s / 1e12, "block_ms": 1e3 * block_s}


def gather(report: dict) -> list[dict]:
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports


def census_table(reports: list[dict], precision: str) -> str:
    lines = [
        f"census ({precision}; block: one forward and backward of a ViT "
        "block at the run's micro-batch)",
        f"{'rank':>4}  {'host':<12} {'device':<32} {'cc':>4} {'free/total GiB':>15} {'fp16':>4} "
        f"{'bf16':>4} {'matmul TFLOP/s':>14} {'block ms':>9}",
    ]
    for r, rep in enumerate(reports):
        slow = f"  (slowed x{rep['slowdown']:g})" if rep["slowdown"] != 1 else ""
        lines.append(
            f"{r:>4}  {rep['host'][:12]:<12} {rep['device'][:32]:<32} "
            f"{rep['capability'] or '-':>4} "
            f"{rep['mem_free_gib']:>6.1f}/{rep['mem_total_gib']:<8.1f} "
            f"{'yes' if rep['fp16'] else 'no':>4} {'yes' if rep['bf16'] else 'no':>4} "
            f"{rep['matmul_tflops']:>14.3f} {rep['block_ms']:>9.2f}" + slow
        )
    return "\n".join(lines)
