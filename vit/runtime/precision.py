"""The run's precision, decided in one place. What a rank can train in depends on its device and on
the engine's rules (its spec: vit.core.spec.EngineSpec's precisions, fp16_on_gpu and fp16_hint):
bf16 where the card has it natively (Ampere on), fp16 under torch's autocast on every CUDA card,
under DeepSpeed's engines where DeepSpeed's accelerator says so (compute capability 7.0 on, 6.x only
with DS_ALLOW_DEPRECATED_FP16=1: its engines raise otherwise), never under an engine without a loss
scaler. Every rank reaches the same choice from every rank's report: before the process group from
the device reports (vit.runtime.gpu), and at the census (vit.planner)."""

import torch

from vit.core.errors import ConfigError
from vit.core.spec import BF16_NATIVE, FP16_FAST, EngineSpec

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def deepspeed_fp16(local_rank: int) -> bool:
    """DeepSpeed's own verdict on fp16 for this host's GPU local_rank, in this rank's
    environment."""
    # get_accelerator() may not be chosen yet
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    with torch.cuda.device(local_rank):
        return bool(CUDA_Accelerator().is_fp16_supported())


def gpu_precisions(capability: tuple[int, int], engine: EngineSpec, ds_fp16: bool) -> dict:
    """What a CUDA card of this compute capability trains in under `engine` (ds_fp16:
    deepspeed_fp16's verdict)."""
    return {"fp16": engine.fp16_on_gpu(ds_fp16), "bf16": tuple(capability) >= BF16_NATIVE}


def likely(requested: str | None, engine: EngineSpec, dev: torch.device) -> str:
    """The precision this rank will probably train in, before the census settles it (for memory
    estimates)."""
    if requested in ("fp32", "fp16", "bf16"):
        return requested
    if dev.type != "cuda":
        return "fp32"
    runs = gpu_precisions(
        torch.cuda.get_device_capability(dev), engine, deepspeed_fp16(dev.index or 0)
    )
    return next(p for p in engine.precisions if p == "fp32" or runs[p])


def who(rank: int, report: dict) -> str:
    return f"rank {rank} ({report['host']}, {report['device']})"


def _cc(capability: str) -> tuple[int, int]:
    major, minor = capability.split(".")
    return int(major), int(minor)


def choose(requested: str | None, engine: EngineSpec, reports: list[dict]) -> tuple[str, str]:
    """(precision, why) from every rank's report (host, device, capability 'X.Y' or None on a CPU,
    and what it trains in under `engine`: fp16, bf16). requested None (none given): auto on GPUs,
    fp32 on CPUs. An explicit precision some rank lacks is one ConfigError naming those ranks and
    the fix; fp16 on a card before Volta comes with a warning."""
    engine.check_precision(requested)
    if requested is None:
        if reports[0].get("capability") is None:
            return "fp32", "no precision given: fp32 on CPUs"
        precision, why = choose("auto", engine, reports)
        return precision, f"no precision given: auto on GPUs; {why}"
    precision, why = _choose(requested, engine, reports)
    slow = [
        who(r, rep)
        for r, rep in enumerate(reports)
        if precision == "fp16" and rep.get("capability") and _cc(rep["capability"]) < FP16_FAST
    ]
    if slow:
        why += (
            f"; warning: {', '.join(slow)} run fp16 without tensor cores (compute capability below "
            f"{FP16_FAST[0]}.{FP16_FAST[1]}), which can be slower than fp32 there"
        )
    return precision, why


def _choose(requested: str, engine: EngineSpec, reports: list[dict]) -> tuple[str, str]:
    def lacking(p):
        return [r for r, rep in enumerate(reports) if p != "fp32" and not rep[p]]

    def named(ranks):
        return ", ".join(who(r, reports[r]) for r in ranks)

    if requested != "auto":
        missing = lacking(requested)
        if missing:
            every = [p for p in engine.precisions if not lacking(p)]
            raise ConfigError(
                f"precision {requested} is not supported by {named(missing)}"
                f"{_deepspeed_fp16_hint(requested, engine, [reports[r] for r in missing])}; "
                f"every rank can run {', '.join(every)}: use --precision auto or one of those"
            )
        return requested, "every rank supports it"
    why = []
    for p in engine.precisions[:-1]:
        missing = lacking(p)
        if not missing:
            return p, "; ".join([*why, f"every rank supports {p}"])
        why.append(f"no {p} on {named(missing)}")
    return "fp32", "; ".join(why)


def _deepspeed_fp16_hint(requested: str, engine: EngineSpec, missing: list[dict]) -> str:
    """Why the engine refuses fp16 on these GPUs, and what runs it there (EngineSpec.fp16_hint)."""
    caps = [_cc(rep["capability"]) for rep in missing if rep.get("capability")]
    return engine.fp16_hint(caps) if requested == "fp16" and caps else ""
