"""The census: what every rank's device is and can run, how fast it is, and the precision all of them can run."""
import json
import os
import socket

import torch
import torch.distributed as dist
from torch import nn

from vit.errors import ConfigError
from vit.gpu import FP16_FAST, native_precisions
from vit.slowdown import Clock

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def capabilities(dev: torch.device, local_world_size: int) -> dict:
    """This rank's device: name, memory, compute capability and what DeepSpeed says it can run.

    VIT_CENSUS_OVERRIDE (a JSON object) replaces fields of the report, so that tests can stand in for a GPU
    without bf16 on a machine that has none."""
    from deepspeed.accelerator import get_accelerator

    from vit.memory import device_memory

    acc = get_accelerator()
    name, free, total = device_memory(dev, local_world_size)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        capability = f"{props.major}.{props.minor}"
        native = native_precisions((props.major, props.minor))  # not acc's: it counts emulated bf16 as supported
    else:
        capability = None
        native = {"fp16": bool(acc.is_fp16_supported()), "bf16": bool(acc.is_bf16_supported())}
    report = {"host": socket.gethostname(), "device": name, "capability": capability,
              "mem_total_gib": total / 2**30, "mem_free_gib": free / 2**30, **native}
    override = os.environ.get("VIT_CENSUS_OVERRIDE")
    if override:
        try:
            report.update(json.loads(override))
        except (json.JSONDecodeError, TypeError, ValueError):
            raise ConfigError(f"VIT_CENSUS_OVERRIDE is not a JSON object: {override!r}") from None
    return report


def who(rank: int, report: dict) -> str:
    return f"rank {rank} ({report['host']}, {report['device']})"


def negotiate(requested: str, reports: list[dict]) -> tuple[str, str]:
    """(precision, why). 'auto': bf16 if every rank has it, else fp16, else fp32; 'default' (none given): auto on
    GPUs, fp32 on CPUs. An explicit precision that some rank lacks is an error naming those ranks. fp16 on a card
    before Volta comes with a warning."""
    if requested == "default":
        if reports[0].get("capability") is None:
            return "fp32", "no precision given: fp32 on CPUs"
        precision, why = negotiate("auto", reports)
        return precision, f"no precision given: auto on GPUs; {why}"
    precision, why = _negotiate(requested, reports)
    slow = [who(r, rep) for r, rep in enumerate(reports)
            if precision == "fp16" and rep.get("capability") and _cc(rep["capability"]) < FP16_FAST]
    if slow:
        why += (f"; warning: {', '.join(slow)} run fp16 without tensor cores (compute capability below "
                f"{FP16_FAST[0]}.{FP16_FAST[1]}), which can be slower than fp32 there")
    return precision, why


def _cc(capability: str) -> tuple[int, int]:
    major, minor = capability.split(".")
    return int(major), int(minor)


def _negotiate(requested: str, reports: list[dict]) -> tuple[str, str]:
    def lacking(p):
        return [who(r, rep) for r, rep in enumerate(reports) if p != "fp32" and not rep[p]]

    if requested != "auto":
        missing = lacking(requested)
        if missing:
            every = [p for p in ("bf16", "fp16", "fp32") if not lacking(p)]
            raise ConfigError(f"precision {requested} is not supported by {', '.join(missing)}; every rank can run "
                              f"{', '.join(every)}: use --precision auto or one of those")
        return requested, "every rank supports it"
    why = []
    for p in ("bf16", "fp16"):
        missing = lacking(p)
        if not missing:
            return p, "; ".join([*why, f"every rank supports {p}"])
        why.append(f"no {p} on {', '.join(missing)}")
    return "fp32", "; ".join(why)


WARMUP_S = 0.2  # consumer GPUs ramp their clocks up over the first few hundred ms of load: time only after that
TIMED_REPS = 20


def _timed(fn, clock: Clock, reps: int = TIMED_REPS, warmup_s: float = WARMUP_S) -> float:
    """Fastest of `reps` runs of fn() after running it for at least warmup_s, slowed like the rank's layers (in
    seconds; the fastest, because a busy host only ever slows a run down)."""
    start = clock.now()
    fn()
    while clock.now() - start < warmup_s:
        fn()
    times = []
    for _ in range(reps):
        start = clock.now()
        clock.start()
        fn()
        clock.stop()
        times.append(clock.now() - start)
    return min(times)


def measure_speed(dev: torch.device, precision: str, block: nn.Module, block_input: tuple[int, ...],
                  slowdown: float) -> dict:
    """A timed matmul and one timed forward and backward of a ViT block on an input of the run's shape."""
    dtype = DTYPES[precision]
    clock = Clock(slowdown, dev)
    n = 4096 if dev.type == "cuda" else 512
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    matmul_s = _timed(lambda: a @ b, clock)
    block = block.to(dev, dtype)
    x = torch.randn(*block_input, device=dev, dtype=dtype, requires_grad=True)

    def step():
        block(x).float().sum().backward()

    block_s = _timed(step, clock)
    return {"matmul_tflops": 2 * n**3 / matmul_s / 1e12, "block_ms": 1e3 * block_s}


def gather(report: dict) -> list[dict]:
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports


def census_table(reports: list[dict], precision: str) -> str:
    lines = [f"census ({precision}; block: one forward and backward of a ViT block at the run's micro-batch)",
             f"{'rank':>4}  {'host':<12} {'device':<32} {'cc':>4} {'free/total GiB':>15} {'fp16':>4} {'bf16':>4} "
             f"{'matmul TFLOP/s':>14} {'block ms':>9}"]
    for r, rep in enumerate(reports):
        slow = f"  (slowed x{rep['slowdown']:g})" if rep["slowdown"] != 1 else ""
        lines.append(f"{r:>4}  {rep['host'][:12]:<12} {rep['device'][:32]:<32} {rep['capability'] or '-':>4} "
                     f"{rep['mem_free_gib']:>6.1f}/{rep['mem_total_gib']:<8.1f} {'yes' if rep['fp16'] else 'no':>4} "
                     f"{'yes' if rep['bf16'] else 'no':>4} {rep['matmul_tflops']:>14.3f} {rep['block_ms']:>9.2f}"
                     + slow)
    return "\n".join(lines)
