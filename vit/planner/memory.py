"""The memory model: what a rank's training holds per parameter (each engine's own terms, from its
spec, and the EMA's), the headroom a GPU keeps for NCCL, cuBLAS and the engine's buffers, what a
plan may fill and what fits. Pure except for device_memory and RunMemory.likely_precision (which
asks a GPU what it runs); it knows nothing of plans or the census (their callers pass numbers in, or
a RunMemory)."""

from dataclasses import dataclass

import psutil
import torch

from vit.core.costs import USABLE_MEMORY
from vit.core.spec import EngineSpec
from vit.runtime.precision import likely


def state_bytes(
    engine: EngineSpec,
    precision: str,
    ds_config: dict,
    dp_size: int = 1,
    ema_on_gpu: bool = False,
    stashed_copies: int = 0,
    compression: str = "none",
) -> dict[str, float]:
    """Bytes per parameter one rank holds for the model's state (not activations), by what holds
    them, for `engine` in `precision` (EngineSpec.state_bytes: its optimizer, its buffers, its
    `stashed_copies` of the weights and what its `compression` keeps), with `ema_on_gpu`: timm's
    ModelEmaV3 in fp32 on the rank's device (vit/training/ema.py). AdamW throughout
    (vit/training/optim.py)."""
    terms = engine.state_bytes(
        precision, ds_config, dp_size, stashed_copies=stashed_copies, compression=compression
    )
    if ema_on_gpu:
        # vit/training/ema.py: ModelEmaV3(dtype=float32, device=engine.device), never partitioned
        terms["ema fp32 copy"] = 4
    return terms


def bytes_per_param(*args, **kwargs) -> float:
    """sum(state_bytes(...)): the bytes one rank holds per parameter, activations aside."""
    return sum(state_bytes(*args, **kwargs).values())


def gpu_reserved_bytes(engine: EngineSpec, ds_config: dict, precision: str) -> float:
    """The headroom memory plans keep on a GPU rank (EngineSpec.reserved_bytes: NCCL, cuBLAS, ZeRO's
    buckets)."""
    return engine.reserved_bytes(ds_config, precision)


@dataclass(frozen=True, kw_only=True)
class RunMemory:
    """A run's terms of the memory model, in whichever precision a rank trains: what it holds per
    parameter beside the activations (bytes_per_param) and what a GPU keeps free (reserved). What
    --micro-batch-size auto and the out-of-memory message estimate with."""

    engine: EngineSpec
    requested_precision: str | None  # --precision or the JSON's (auto too); None: none given
    ds_config: dict
    dp_size: int
    ema_on_gpu: bool  # --model-ema
    stashed_copies: int  # the async pipeline's stashed or predicted weights; 0 for the others
    compression: str  # EngineSpec.compression_of
    freezing: bool  # --freeze: a GPU keeps a freeze point's handover free too

    def likely_precision(self, dev: torch.device) -> str:
        """What a rank on `dev` will probably train in, before the census settles it."""
        return likely(self.requested_precision, self.engine, dev)

    def per_param(self, precision: str) -> float:
        """bytes_per_param for this run in `precision`."""
        return bytes_per_param(
            self.engine,
            precision,
            self.ds_config,
            self.dp_size,
            ema_on_gpu=self.ema_on_gpu,
            stashed_copies=self.stashed_copies,
            compression=self.compression,
        )

    def reserved(self, dev: torch.device, precision: str) -> float:
        """What a GPU rank keeps free beside the plan's memory (0 on a CPU), a freeze point's
        handover included."""
        if dev.type != "cuda":
            return 0.0
        return gpu_reserved_bytes(self.engine, self.ds_config, precision) + (
            self.engine.handover_bytes() if self.freezing else 0.0
        )


def plan_bytes(report: dict) -> float:
    """What a plan may fill on a rank of the census: USABLE_MEMORY of its free memory less its
    reserved headroom (mem_reserved_gib: gpu_reserved_bytes on a GPU, 0 on a CPU)."""
    return (USABLE_MEMORY * report["mem_free_gib"] - report.get("mem_reserved_gib", 0.0)) * 2**30


def estimate_fit(
    total_bytes: float, params: int, act_bytes_per_sample: float, reserved: float, per_param: float
) -> int:
    """Samples per micro-batch that fit: `per_param` bytes of state per parameter (bytes_per_param)
    and activations (profiled in the run's precision), within USABLE_MEMORY of the device less
    `reserved` (a GPU's headroom for NCCL, ZeRO's buckets and cuBLAS); negative when the model alone
    does not fit."""
    return int(
        (USABLE_MEMORY * total_bytes - reserved - params * per_param) // act_bytes_per_sample
    )


def device_memory(dev: torch.device, local_world_size: int) -> tuple[str, float, float]:
    """(device name, free bytes, total bytes); ranks on one host share its RAM."""
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return torch.cuda.get_device_properties(dev).name, free, total
    mem = psutil.virtual_memory()
    name = next(
        (
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        ),
        "CPU",
    )
    return name, mem.available / local_world_size, mem.total / local_world_size
