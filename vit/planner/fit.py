"""What fits in a rank's memory: the message of a rank that ran out of it (with what would fit), and
--micro-batch-size auto (the largest micro-batch whose forward and backward fit every rank)."""
import socket

import torch
import torch.distributed as dist
from torch import nn

from vit.engines.registry import spec
from vit.core.errors import ConfigError, OutOfMemory
from vit.planner.memory import (
    USABLE_MEMORY,
    bytes_per_param,
    device_memory,
    estimate_fit,
    first_line,
    forward_backward_bytes,
    gpu_reserved_bytes,
    largest_fitting,
)
from vit.planner.profile import profile_layers
from vit.model.layers import build_layers
from vit.runtime.gpu import fork_rng
from vit.runtime.precision import DTYPES, likely


def likely_precision(plan, dev: torch.device) -> str:
    return likely(plan.requested_precision, plan.settings.parallel.engine, dev)


def _layers(plan) -> list:
    data, s = plan.data, plan.settings
    return build_layers(s.model.model, data.num_classes, data.in_chans, data.img_size, s.train.seed)


def reserved_on(dev: torch.device, plan, precision: str) -> float:
    return gpu_reserved_bytes(plan.ds_config, precision) if dev.type == "cuda" else 0.0


def state_bytes_per_param(plan, precision: str) -> float:
    """vit.planner.memory.bytes_per_param for this run's engine, DeepSpeed JSON, data-parallel size, EMA and the async
    pipeline's weight stashing or prediction (one copy of the weights either way)."""
    s = plan.settings
    a = s.asynchrony
    stashed = int(a.weight_stashing == "on" or a.weight_prediction == "msnag")
    return bytes_per_param(s.parallel.engine, precision, plan.ds_config, plan.batch.dp_size,
                           ema_on_gpu=s.recipe.model_ema, stashed_copies=stashed,
                           powersgd=s.comm.comm_hook == "powersgd")


def _estimate(plan, dev: torch.device) -> tuple[str, str, int, str]:
    """(the device and its memory, and the precision, as the message names them; the samples per micro-batch that
    fit; how that was estimated)."""
    name, _, total = device_memory(dev, plan.job.local_world_size)
    precision = likely_precision(plan, dev)
    profile = profile_layers(_layers(plan), plan.data.train[0][0][None], precision)  # on the CPU: the GPU is full
    params, act = sum(p["params"] for p in profile), sum(p["act_bytes"] for p in profile)
    per_param = state_bytes_per_param(plan, precision)
    fit = estimate_fit(total, params, act, reserved_on(dev, plan, precision), per_param)
    return (f"{dev} ({name}, {total / 2**30:.1f} GiB)", f" ({precision})", fit,
            f"Estimated to fit: {max(fit, 0)} samples per micro-batch (weights, gradients and optimizer state, "
            f"{per_param:g} bytes per parameter under {plan.settings.parallel.engine}: {params * per_param / 2**30:.2f}"
            f" GiB + activations {act / 2**20:.2f} MiB per sample, in "
            f"{USABLE_MEMORY:.0%} of {total / 2**30:.1f} GiB)")


def out_of_memory(plan, dev: torch.device, step: int, error: Exception) -> OutOfMemory:
    """An out-of-memory error (is_oom) as one message: the device and its memory, the micro-batch, what would fit
    and what to try. The hints stay when the estimate fails too (after a CUDA error the device may not even say
    how much memory it has)."""
    micro, accum = plan.batch.micro_batch, plan.batch.grad_accum
    try:
        where, precision, fit, estimate = _estimate(plan, dev)
    except Exception as e:
        where, precision, fit, estimate = str(dev), "", None, f"No estimate ({type(e).__name__}: {first_line(e)})"
    hints = []
    if fit is not None and 1 <= fit < micro:
        keep = f" --grad-accum {micro * accum // fit}" if micro * accum % fit == 0 else ""
        hints.append(f"--micro-batch-size {fit}{keep}" + (" (the same global batch)" if keep else ""))
    elif fit is None or fit >= micro:
        hints.append(f"--micro-batch-size {max(1, micro // 2)}" + (
            "" if fit is None else f" (the estimate, {fit}, says {micro} fits: other processes may hold memory on "
            "this device)"))
    hints += ["--micro-batch-size auto", "deepspeed_configs/zero2_offload.json (optimizer state in CPU memory)",
              "--engine pipeline with more --pipeline-stages (each rank holds fewer layers)"]
    return OutOfMemory(f"out of memory during step {step + 1} on {where} at micro-batch {micro}{precision}: "
                       f"{first_line(error)}. {estimate}. Try " + ", or ".join(hints))


def nccl_out_of_memory(dev: torch.device, error: Exception) -> OutOfMemory:
    """NCCL ran out of GPU memory creating its communicators, before any training: what holds the memory."""
    return OutOfMemory(f"out of memory on {dev} as NCCL created its communicators: {first_line(error)}. Another "
                       "process may hold this GPU's memory (nvidia-smi lists them); NCCL_BUFFSIZE smaller than its "
                       "4 MiB default needs less")


def _my_largest(plan, dev: torch.device, precision: str) -> tuple[int, str, float]:
    """(this rank's largest micro-batch, its device's name, its free bytes): forward and backward measured in
    `precision` against its free memory less the engine's state beyond the weights and gradients measured
    (vit.planner.memory.state_bytes; none where ZeRO partitions more than that away) and USABLE_MEMORY's headroom."""
    name, free, _ = device_memory(dev, plan.job.local_world_size)
    # DeepSpeed casts the model to the half dtype; the torch engines keep it in fp32 and autocast the forward
    autocast = DTYPES[precision] if precision != "fp32" and not spec(plan.settings.parallel.engine).deepspeed else None
    with fork_rng(dev):
        model = nn.Sequential(*_layers(plan)).to(dev, torch.float32 if autocast else DTYPES[precision])
    params = sum(p.numel() for p in model.parameters())
    # the weights and gradients forward_backward_bytes counts, and autocast's cached half copy of the weights
    measured = 2 * 4 + 2 if autocast else 2 * DTYPES[precision].itemsize
    beyond = max(0.0, state_bytes_per_param(plan, precision) - measured)
    budget = USABLE_MEMORY * free - reserved_on(dev, plan, precision) - params * beyond
    upper = len(plan.data.train) // (plan.batch.dp_size * plan.batch.grad_accum)
    mine = largest_fitting(lambda n: forward_backward_bytes(model, plan.data.train[0][0], n, autocast), budget,
                           upper)
    model = None
    if dev.type == "cuda":  # the census reads free memory next
        torch.cuda.empty_cache()
    return mine, name, free


def fit_micro_batch(plan, dev: torch.device) -> tuple[int, list[int] | None, dict]:
    """--micro-batch-size auto (collective): every rank finds the largest micro-batch that fits (_my_largest, up
    to one step per epoch); the job takes the smallest, or with --batch-split proportional each rank its own.
    (micro-batch, per-rank split or None, the search's record), which vit.config.plan.with_micro_batch applies."""
    job, batch = plan.job, plan.batch
    precision = likely_precision(plan, dev)
    mine, name, free = _my_largest(plan, dev, precision)
    upper = len(plan.data.train) // (batch.dp_size * batch.grad_accum)
    found = [None] * job.world_size
    dist.all_gather_object(found, (mine, job.rank, f"{socket.gethostname()}, {name}, {free / 2**30:.1f} GiB free"))
    sizes = [f[0] for f in found]
    none = [f"rank {r} ({where})" for n, r, where in found if n < 1]
    if none:
        raise ConfigError(f"--micro-batch-size auto: not even micro-batch 1 fits {', '.join(none)} with the model's "
                          "optimizer state: try deepspeed_configs/zero2_offload.json (optimizer state in CPU "
                          "memory), or --engine pipeline")
    split = None
    if plan.settings.parallel.batch_split == "proportional":
        split = list(sizes)
        for _ in range(sum(split) % batch.dp_size):  # the global batch is micro-batch x data-parallel size
            split[split.index(max(split))] -= 1
    micro = sum(split) // batch.dp_size if split else min(sizes)
    search = {"per_rank": sizes, "micro_batch": micro, "split": split, "precision": precision,
              "limit": f"one step per epoch: {upper}"}
    if job.is_main:
        chosen = f"micro-batches {split} (one per rank)" if split else f"micro-batch {micro}"
        print(f"--micro-batch-size auto: the largest forward and backward ({precision}) that fit each rank with "
              f"headroom: {sizes} (at most {upper}, one step per epoch) -> {chosen}", flush=True)
    return micro, split, search
