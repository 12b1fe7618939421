"""What fits in a rank's memory: the message of a rank that ran out of it (with what would fit), and
--micro-batch-size auto (the largest micro-batch whose forward and backward fit every rank)."""
import re
import socket
from collections.abc import Callable

import psutil
import torch
import torch.distributed as dist
from torch import nn

from vit.errors import ConfigError, OutOfMemory
from vit.gpu import fork_rng
from vit.hetero.profile import BYTES_PER_PARAM, USABLE_MEMORY, gpu_reserved_bytes
from vit.model import build_layers
from vit.precision import likely

# What an engine holds per parameter beyond the weights and gradients a forward and backward already hold:
# AdamW's two moments and, in half precision, the fp32 master weights.
OPTIMIZER_BYTES_PER_PARAM = 12


def device_memory(dev: torch.device, local_world_size: int) -> tuple[str, float, float]:
    """(device name, free bytes, total bytes); ranks on one host share its RAM."""
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return torch.cuda.get_device_properties(dev).name, free, total
    mem = psutil.virtual_memory()
    name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                "CPU")
    return name, mem.available / local_world_size, mem.total / local_world_size


def likely_precision(plan, dev: torch.device) -> str:
    return likely(plan.requested_precision, plan.settings.parallel.engine, dev)


def _layers(plan) -> list:
    data, s = plan.data, plan.settings
    return build_layers(s.model.model, data.num_classes, data.in_chans, data.img_size, s.train.seed)


def estimate_fit(total_bytes: float, params: int, act_bytes_per_sample: float, reserved: float = 0.0) -> int:
    """Samples per micro-batch that fit: parameters, gradients and AdamW state, and activations (profiled in the
    run's precision), within USABLE_MEMORY of the device less `reserved` (a GPU's headroom for NCCL, ZeRO's
    buckets and cuBLAS; a plan; negative when the model alone does not fit)."""
    return int((USABLE_MEMORY * total_bytes - reserved - params * BYTES_PER_PARAM) // act_bytes_per_sample)


def reserved_on(dev: torch.device, plan, precision: str) -> float:
    return gpu_reserved_bytes(plan.ds_config, precision) if dev.type == "cuda" else 0.0


# The words CUDA's libraries put in their out-of-memory errors: CUDA itself ("CUDA error: out of memory", as
# torch.AcceleratorError or RuntimeError), NCCL creating communicators (DistBackendError "Cuda failure 'out of
# memory'"), cuBLAS and cuDNN creating handles and workspaces ("CUBLAS_STATUS_ALLOC_FAILED", "..._ALLOC_FAILED").
OOM_WORDS = re.compile(r"out of memory|_ALLOC_FAILED")


def is_oom(error: BaseException) -> bool:
    """Whether `error` is a device that ran out of memory, in any of the forms torch and CUDA's libraries raise."""
    if isinstance(error, OutOfMemory):  # ours: already the message
        return False
    return isinstance(error, torch.cuda.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and OOM_WORDS.search(str(error)) is not None)


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__


def _estimate(plan, dev: torch.device) -> tuple[str, str, int, str]:
    """(the device and its memory, and the precision, as the message names them; the samples per micro-batch that
    fit; how that was estimated)."""
    from vit.hetero.profile import profile_layers

    name, _, total = device_memory(dev, plan.job.local_world_size)
    precision = likely_precision(plan, dev)
    profile = profile_layers(_layers(plan), plan.data.train[0][0][None], precision)  # on the CPU: the GPU is full
    params, act = sum(p["params"] for p in profile), sum(p["act_bytes"] for p in profile)
    fit = estimate_fit(total, params, act, reserved_on(dev, plan, precision))
    return (f"{dev} ({name}, {total / 2**30:.1f} GiB)", f" ({precision})", fit,
            f"Estimated to fit: {max(fit, 0)} samples per micro-batch (parameters, gradients and AdamW state "
            f"{params * BYTES_PER_PARAM / 2**30:.2f} GiB + activations {act / 2**20:.2f} MiB per sample, in "
            f"{USABLE_MEMORY:.0%} of {total / 2**30:.1f} GiB)")


def out_of_memory(plan, dev: torch.device, step: int, error: Exception) -> OutOfMemory:
    """An out-of-memory error (is_oom) as one message: the device and its memory, the micro-batch, what would fit
    and what to try. The hints stay when the estimate fails too (after a CUDA error the device may not even say
    how much memory it has)."""
    micro, accum = plan.batch.micro_batch, plan.batch.grad_accum
    try:
        where, precision, fit, estimate = _estimate(plan, dev)
    except Exception as e:
        where, precision, fit, estimate = str(dev), "", None, f"No estimate ({type(e).__name__}: {_first_line(e)})"
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
                       f"{_first_line(error)}. {estimate}. Try " + ", or ".join(hints))


def nccl_out_of_memory(dev: torch.device, error: Exception) -> OutOfMemory:
    """NCCL ran out of GPU memory creating its communicators, before any training: what holds the memory."""
    return OutOfMemory(f"out of memory on {dev} as NCCL created its communicators: {_first_line(error)}. Another "
                       "process may hold this GPU's memory (nvidia-smi lists them); NCCL_BUFFSIZE smaller than its "
                       "4 MiB default needs less")


def largest_fitting(need: Callable[[int], float | None], budget: float, upper: int) -> int:
    """The largest micro-batch n <= upper whose forward and backward need(n) bytes within budget (need returns None
    when the device ran out of memory); 0 when not even 1 fits. n doubles from 1, then bisects. A size whose
    need, extrapolated from two sizes already measured (it is affine in n), is over budget is not tried: on a CPU
    trying would swap, or meet the out-of-memory killer."""
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


def forward_backward_bytes(model: nn.Module, sample: torch.Tensor, n: int) -> float | None:
    """Bytes one forward and backward at micro-batch n holds at its peak (weights, gradients, activations and
    input): the allocator's peak on a GPU (None if it ran out), the tensors kept for backward on a CPU."""
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev) - weights
            model(sample.to(dev, dtype).repeat(n, *[1] * sample.dim())).float().sum().backward()
            return torch.cuda.max_memory_allocated(dev) - before
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in own:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = sample.to(dtype).repeat(n, *[1] * sample.dim())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
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


def fit_micro_batch(plan):
    """--micro-batch-size auto (collective): every rank finds the largest micro-batch whose forward and backward
    fit its free memory less the optimizer's state and USABLE_MEMORY's headroom (up to one step per epoch); the
    job takes the smallest, or with --batch-split proportional each rank its own. The plan follows."""
    from vit.dist_env import device
    from vit.hetero.census import DTYPES
    from vit.plan import with_micro_batch

    if plan.settings.parallel.micro_batch_size != "auto":
        return plan
    job, batch = plan.job, plan.batch
    dev = device(job)
    name, free, _ = device_memory(dev, job.local_world_size)
    precision = likely_precision(plan, dev)
    with fork_rng(dev):
        model = nn.Sequential(*_layers(plan)).to(dev, DTYPES[precision])
    params = sum(p.numel() for p in model.parameters())
    budget = USABLE_MEMORY * free - reserved_on(dev, plan, precision) - params * OPTIMIZER_BYTES_PER_PARAM
    upper = len(plan.data.train) // (batch.dp_size * batch.grad_accum)
    mine = largest_fitting(lambda n: forward_backward_bytes(model, plan.data.train[0][0], n), budget, upper)
    model = None
    if dev.type == "cuda":  # the census reads free memory next
        torch.cuda.empty_cache()
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
    return with_micro_batch(plan, micro, split, search)
