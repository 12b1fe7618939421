"""A rank that ran out of device memory: whether an error says so (in any of the forms torch and
CUDA's libraries raise), and the one message that names the device, the micro-batch, what would fit
and what to try."""

import re
from collections.abc import Callable

import torch

from vit.core.batch import Batch
from vit.core.costs import USABLE_MEMORY
from vit.core.errors import OutOfMemory
from vit.planner.memory import RunMemory, device_memory, estimate_fit
from vit.planner.profile import profile_layers

# The words CUDA's libraries put in their out-of-memory errors: CUDA itself ("CUDA error: out of
# memory", as torch.AcceleratorError or RuntimeError), NCCL creating communicators (DistBackendError
# "Cuda failure 'out of memory'"), cuBLAS and cuDNN creating handles and workspaces
# ("CUBLAS_STATUS_ALLOC_FAILED", "..._ALLOC_FAILED").
OOM_WORDS = re.compile(r"out of memory|_ALLOC_FAILED")


def is_oom(error: BaseException) -> bool:
    """Whether `error` is a device that ran out of memory, in any of the forms torch and CUDA's
    libraries raise."""
    if isinstance(error, OutOfMemory):  # ours: already the message
        return False
    return isinstance(error, torch.cuda.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and OOM_WORDS.search(str(error)) is not None
    )


def first_line(error: BaseException) -> str:
    return (
        str(error).strip().splitlines()[0].rstrip(".")
        if str(error).strip()
        else type(error).__name__
    )


def estimate(
    dev: torch.device,
    local_world_size: int,
    memory: RunMemory,
    layers: Callable[[], list],
    sample: torch.Tensor,
) -> tuple[str, str, int, str]:
    """(the device and its memory, and the precision, as the message names them; the samples per
    micro-batch that fit; how that was estimated) for layers() (the model, profiled on the CPU: the
    GPU is full) trained by the run whose terms of the memory model are `memory`, in the precision
    it likely trains in. The device is asked first: after a CUDA error it may not answer, and
    nothing else need be done."""
    name, _, total = device_memory(dev, local_world_size)
    precision = memory.likely_precision(dev)
    profile = profile_layers(layers(), sample, precision)
    params, act = sum(p["params"] for p in profile), sum(p["act_bytes"] for p in profile)
    per_param = memory.per_param(precision)
    fit = estimate_fit(total, params, act, memory.reserved(dev, precision), per_param)
    return (
        f"{dev} ({name}, {total / 2**30:.1f} GiB)",
        f" ({precision})",
        fit,
        f"Estimated to fit: {max(fit, 0)} samples per micro-batch (weights, gradients and "
        f"optimizer state, {per_param:g} bytes per parameter under {memory.engine.name}: "
        f"{params * per_param / 2**30:.2f} GiB + activations {act / 2**20:.2f} MiB per sample, in "
        f"{USABLE_MEMORY:.0%} of {total / 2**30:.1f} GiB)",
    )


def out_of_memory(
    error: Exception,
    dev: torch.device,
    step: int,
    batch: Batch,
    estimated: Callable[[], tuple[str, str, int, str]],
) -> OutOfMemory:
    """An out-of-memory error (is_oom) as one message: the device and its memory, the micro-batch,
    what would fit and what to try. The hints stay when the estimate fails too (after a CUDA error
    the device may not even say how much memory it has). `estimated`: estimate() for this run."""
    micro, accum = batch.micro_batch, batch.grad_accum
    try:
        where, precision, fit, estimate = estimated()
    except Exception as e:
        where, precision, fit, estimate = (
            str(dev),
            "",
            None,
            f"No estimate ({type(e).__name__}: {first_line(e)})",
        )
    hints = []
    if fit is not None and 1 <= fit < micro:
        keep = f" --grad-accum {micro * accum // fit}" if micro * accum % fit == 0 else ""
        hints.append(
            f"--micro-batch-size {fit}{keep}" + (" (the same global batch)" if keep else "")
        )
    elif fit is None or fit >= micro:
        hints.append(
            f"--micro-batch-size {max(1, micro // 2)}"
            + (
                ""
                if fit is None
                else f" (the estimate, {fit}, says {micro} fits: other processes "
                "may hold memory on this device)"
            )
        )
    hints += [
        "--micro-batch-size auto",
        "deepspeed_configs/zero2_offload.json (optimizer state in CPU memory)",
        "--engine pipeline with more --pipeline-stages (each rank holds fewer layers)",
    ]
    return OutOfMemory(
        f"out of memory during step {step + 1} on {where} at micro-batch {micro}{precision}: "
        f"{first_line(error)}. {estimate}. Try " + ", or ".join(hints)
    )


def nccl_out_of_memory(dev: torch.device, error: Exception) -> OutOfMemory:
    """NCCL ran out of GPU memory creating its communicators, before any training: what holds the
    memory."""
    return OutOfMemory(
        f"out of memory on {dev} as NCCL created its communicators: {first_line(error)}. "
        "Another process may hold this GPU's memory (nvidia-smi lists them); "
        "NCCL_BUFFSIZE smaller than its 4 MiB default needs less"
    )
