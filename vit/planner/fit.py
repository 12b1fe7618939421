"""--micro-batch-size auto: the largest micro-batch whose forward and backward fit every rank's free
memory with the engine's state and headroom, measured (on a GPU, the allocator's peak; on a CPU, the
tensors kept for backward)."""

import contextlib
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from vit.core.costs import USABLE_MEMORY
from vit.core.errors import ConfigError
from vit.planner.memory import RunMemory, device_memory
from vit.planner.oom import is_oom
from vit.runtime.dist_env import Job
from vit.runtime.gpu import fork_rng
from vit.runtime.precision import DTYPES


def largest_fitting(need: Callable[[int], float | None], budget: float, upper: int) -> int:
    """The largest micro-batch n <= upper whose forward and backward need(n) bytes within budget
    (need returns None when the device ran out of memory); 0 when not even 1 fits. n doubles from 1,
    then bisects. A size whose need, extrapolated from two sizes already measured (it is affine in
    n), is over budget is not tried: on a CPU trying would swap, or meet the out-of-memory killer.
    """
    measured: dict[int, float] = {}

    def fits(n: int) -> bool:
        if len(measured) >= 2:
            (n1, b1), (n2, b2) = sorted(measured.items())[-2:]
            if b2 + (b2 - b1) / (n2 - n1) * (n - n2) > budget:
                return False
        got = need(n)
        if got is None:
            return False
        measured[n] = got
        return got <= budget

    if upper < 1 or not fits(1):
        return 0
    lo, hi = 1, None
    while lo < upper:
        n = min(2 * lo, upper)
        if not fits(n):
            hi = n
            break
        lo = n
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def forward_backward_bytes(
    model: nn.Module, sample: torch.Tensor, n: int, autocast: torch.dtype | None = None
) -> float | None:
    """Bytes one forward and backward at micro-batch n holds at its peak (weights, gradients,
    activations and input): the allocator's peak on a GPU (None if it ran out), the tensors kept for
    backward on a CPU. autocast: the forward under torch.autocast to that dtype, as DDP and the
    async pipeline train (the model in fp32), whose activations are not those of the model cast to
    it (ViT-B/16: 63.3 MiB a sample against 56.4 on a CPU)."""
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cast = torch.autocast(dev.type, dtype=autocast) if autocast else contextlib.nullcontext()
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev) - weights
            with cast:
                out = model(sample.to(dev, dtype).repeat(n, *[1] * sample.dim()))
            out.float().sum().backward()
            return torch.cuda.max_memory_allocated(dev) - before
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in own:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = sample.to(dtype).repeat(n, *[1] * sample.dim())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
            out = model(x)
        out.float().sum().backward()
        return 2 * weights + x.nbytes + sum(saved.values())
    except RuntimeError as e:
        if not is_oom(e):
            raise
        return None
    finally:
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def largest_micro_batch(
    dev: torch.device,
    local_world_size: int,
    precision: str,
    memory: RunMemory,
    layers: Callable[[], list],
    sample: torch.Tensor,
    upper: int,
) -> tuple[int, str, float]:
    """(this rank's largest micro-batch up to `upper`, its device's name, its free bytes): forward
    and backward of layers() measured in `precision` (fp32 weights under torch.autocast where the
    engine autocasts, EngineSpec.autocast; else the model cast) against its free memory less the
    engine's state beyond the weights and gradients measured (`memory`'s bytes a parameter in all;
    none where ZeRO partitions more than that away), its reserved bytes and USABLE_MEMORY's
    headroom."""
    name, free, _ = device_memory(dev, local_world_size)
    half = DTYPES[precision] if precision != "fp32" and memory.engine.autocast else None
    with fork_rng(dev):
        model = nn.Sequential(*layers()).to(dev, torch.float32 if half else DTYPES[precision])
    params = sum(p.numel() for p in model.parameters())
    # the weights and gradients forward_backward_bytes counts, and autocast's cached half copy of
    # the weights
    measured = 2 * 4 + 2 if half else 2 * DTYPES[precision].itemsize
    beyond = max(0.0, memory.per_param(precision) - measured)
    budget = USABLE_MEMORY * free - memory.reserved(dev, precision) - params * beyond
    mine = largest_fitting(lambda n: forward_backward_bytes(model, sample, n, half), budget, upper)
    model = None
    if dev.type == "cuda":  # the census reads free memory next
        torch.cuda.empty_cache()
    return mine, name, free


def fit_micro_batch(
    job: Job,
    dev: torch.device,
    precision: str,
    upper: int,
    dp_size: int,
    proportional: bool,
    **measure,
) -> tuple[int, list[int] | None, dict]:
    """--micro-batch-size auto (collective): every rank finds the largest micro-batch that fits
    (largest_micro_batch(**measure), up to `upper`: one step per epoch); the job takes the smallest,
    or with --batch-split proportional each rank its own. (micro-batch, per-rank split or None, the
    search's record), which vit.run.plan.with_micro_batch applies."""
    mine, name, free = largest_micro_batch(
        dev, job.local_world_size, precision, upper=upper, **measure
    )
    found = [None] * job.world_size
    dist.all_gather_object(
        found, (mine, job.rank, f"{socket.gethostname()}, {name}, {free / 2**30:.1f} GiB free")
    )
    sizes = [f[0] for f in found]
    none = [f"rank {r} ({where})" for n, r, where in found if n < 1]
    if none:
        raise ConfigError(
            f"--micro-batch-size auto: not even micro-batch 1 fits {', '.join(none)} with the "
            "model's optimizer state: try deepspeed_configs/zero2_offload.json (optimizer state in "
            "CPU memory), or --engine pipeline"
        )
    split = None
    if proportional:
        split = list(sizes)
        # the global batch is micro-batch x data-parallel size
        for _ in range(sum(split) % dp_size):
            split[split.index(max(split))] -= 1
    micro = sum(split) // dp_size if split else min(sizes)
    search = {
        "per_rank": sizes,
        "micro_batch": micro,
        "split": split,
        "precision": precision,
        "limit": f"one step per epoch: {upper}",
    }
    if job.is_main:
        chosen = f"micro-batches {split} (one per rank)" if split else f"micro-batch {micro}"
        print(
            "--micro-batch-size auto: the largest forward and backward "
            f"({precision}) that fit each rank with headroom: {sizes} (at most "
            f"{upper}, one step per epoch) -> {chosen}",
            flush=True,
        )
    return micro, split, search
