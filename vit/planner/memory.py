"""The memory model: what a rank's training holds per parameter under each engine, the headroom a GPU keeps for
NCCL, cuBLAS and ZeRO's buckets, and what fits. Pure except for device_memory and the measured forward and
backward; it knows nothing of plans or the census (their callers pass numbers in)."""
import contextlib
import re
from collections.abc import Callable

import psutil
import torch
from torch import nn

from vit.engines.registry import EngineSpec, spec
from vit.core.errors import OutOfMemory

USABLE_MEMORY = 0.9  # plans leave 10% of the free memory for the allocator's fragmentation and the unforeseen
# What a GPU rank holds outside the weights, gradients, optimizer state and activations a plan counts: NCCL's
# buffers (NCCL_BUFFSIZE 4 MiB per channel, send and receive, on the rings and trees of each communicator) and the
# cuBLAS and cuBLASLt workspaces (up to 32 MiB each per stream in recent torch). ZeRO's buckets come from the JSON.
NCCL_BYTES = 384 * 2**20
CUBLAS_BYTES = 2 * 32 * 2**20
ZERO_BUCKET_DEFAULT = 500_000_000  # DeepSpeed's reduce_bucket_size and allgather_bucket_size, in elements
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
FROZEN_BYTES_PER_PARAM = 4  # a frozen layer keeps its weights only (fp32 at most): no gradients, no optimizer state


def state_bytes(engine: str, precision: str, ds_config: dict, dp_size: int = 1, ema_on_gpu: bool = False,
                stashed_copies: int = 0, powersgd: bool = False) -> dict[str, float]:
    """Bytes per parameter one rank holds for the model's state (not activations), by what holds them, for
    `engine` ('zero', 'pipeline', 'ddp', 'async-pipeline') in `precision`; ZeRO's stage, gradient accumulation
    dtype and optimizer offload come from the DeepSpeed JSON, and what ZeRO partitions is divided by `dp_size`.
    `ema_on_gpu`: timm's ModelEmaV3 in fp32 on the rank's device (vit/loop/ema.py). `stashed_copies`: the async
    pipeline's weight copies kept for in-flight micro-batches. `powersgd`: DDP's --comm-hook powersgd. AdamW
    throughout (vit/loop/optim.py)."""
    engine_spec = spec(engine)
    if engine_spec.deepspeed:
        terms = deepspeed_state(engine_spec, precision, ds_config, dp_size)
    else:
        terms = torch_state(engine_spec, precision, dp_size, stashed_copies)
    if powersgd:
        # torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py: error_dict holds, per bucket, a tensor of the
        # bucket's length in the gradients' dtype (fp32 here). Its P and Q, (n + m) x rank numbers per n x m matrix,
        # are left out: 0.04 bytes a parameter for ViT-B/16 at rank 4
        terms["PowerSGD error feedback"] = 4
    if ema_on_gpu:
        # vit/loop/ema.py: ModelEmaV3(dtype=float32, device=engine.device), never partitioned
        terms["ema fp32 copy"] = 4
    return terms


def torch_state(engine: EngineSpec, precision: str, dp_size: int, stashed_copies: int) -> dict[str, float]:
    """DDP and the async pipeline: fp32 parameters trained under torch.autocast, torch's AdamW."""
    terms = {"fp32 weights": 4, "fp32 gradients": 4, "AdamW moments": 8}  # torch/optim/adamw.py: exp_avg, exp_avg_sq
    if precision != "fp32":
        # torch/amp/autocast_mode.py (cache_enabled): each fp32 weight's half cast is cached until the autocast
        # region exits, and backward keeps it for the matmuls' weight gradients
        terms["autocast half weights"] = 2
    if not engine.pipeline:  # ddp
        # torch/nn/parallel/distributed.py: gradient_as_bucket_view=False (our default) copies the gradients into
        # allreduce buckets as big as the gradients
        terms["DDP buckets"] = 4
    elif stashed_copies:  # vit/engines/async_pipeline/engine.py _weights: p.detach().clone() (or msnag's prediction)
        terms["stashed weights"] = 4 * stashed_copies
    if engine.pipeline and dp_size > 1:  # async_pipeline.py _update: torch.cat of every gradient
        terms["allreduce flat gradients"] = 4
    return terms


def deepspeed_state(engine: EngineSpec, precision: str, ds_config: dict, dp_size: int) -> dict[str, float]:
    """The optimizer DeepSpeed wraps around AdamW, as deepspeed/runtime/engine.py's _do_optimizer_sanity_check
    picks it: ZeRO (zero/stage_1_and_2.py, stage3.py), BF16_Optimizer (bf16_optimizer.py: bf16 with ZeRO-1 and
    fp32 gradient accumulation, and bf16 pipelines without ZeRO), FP16_UnfusedOptimizer (fp16/unfused_optimizer.py:
    fp16 or bf16 without ZeRO; torch's AdamW is not DeepSpeed's FusedAdam), or AdamW alone in fp32 without ZeRO."""
    zero = ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    accum = ds_config.get("data_types", {}).get("grad_accum_dtype")
    offload = zero.get("offload_optimizer", {}).get("device", "none") in ("cpu", "nvme")
    w = ELEMENT_BYTES[precision]
    if precision == "bf16" and ((stage == 1 and accum == "fp32" and not offload)
                                or (engine.pipeline and stage == 0 and accum in (None, "bf16"))):
        acc = ELEMENT_BYTES[accum or "bf16"]
        terms = {"bf16 weights": 2, "bf16 gradients": 2,
                 "gradient accumulation": acc,  # fp32_groups_gradients_flat: zeros_like(bf16_groups_flat)
                 "fp32 master weights": 4 / dp_size,  # fp32_groups_flat_partition
                 "AdamW moments": 8 / dp_size}
        if acc != 4:  # step(): param_partition.grad = grad_partition.to(fp32), else a view of the buffer
            terms["fp32 master gradients"] = 4 / dp_size
        return terms
    if stage == 0:
        if precision == "fp32":
            return {"fp32 weights": 4, "fp32 gradients": 4, "AdamW moments": 8}
        # fp32_groups = p.clone().float(); at step, fp32_param.grad = fp16_param.grad.to(fp32)
        return {f"{precision} weights": 2, f"{precision} gradients": 2, "fp32 master weights": 4,
                "fp32 master gradients": 4, "AdamW moments": 8}
    optimizer = 0 if offload else 1 / dp_size  # offload_optimizer: master weights, their gradients, moments on CPU
    # stage_1_and_2.py: single_partition_of_fp32_groups (a clone even in fp32) and its .grad at step; stage 2
    # partitions the gradients (averaged_gradients), stage 3 the weights too (stage3.py, whose fp32 master is the
    # weights' own partition when they are fp32 already)
    master = 0 if stage == 3 and precision == "fp32" else 4 * optimizer
    return {f"{precision} weights": w / (dp_size if stage == 3 else 1),
            f"{precision} gradients": w / (dp_size if stage >= 2 else 1),
            "fp32 master weights": master, "fp32 master gradients": 4 * optimizer,
            "AdamW moments": 8 * optimizer}


def bytes_per_param(*args, **kwargs) -> float:
    """sum(state_bytes(...)): the bytes one rank holds per parameter, activations aside."""
    return sum(state_bytes(*args, **kwargs).values())


def gpu_reserved_bytes(ds_config: dict, precision: str) -> float:
    """The headroom memory plans keep on a GPU rank: NCCL_BYTES + CUBLAS_BYTES, and with ZeRO its gradient buckets
    in the run's precision: reduce_bucket_size elements (twice with overlap_comm, which fills one bucket while the
    other is reduced) and allgather_bucket_size."""
    zero = ds_config.get("zero_optimization", {})
    buckets = 0
    if zero.get("stage", 0) >= 1:
        reduce = zero.get("reduce_bucket_size", ZERO_BUCKET_DEFAULT)
        buckets = (2 if zero.get("overlap_comm") else 1) * reduce + zero.get("allgather_bucket_size",
                                                                               ZERO_BUCKET_DEFAULT)
    return NCCL_BYTES + CUBLAS_BYTES + buckets * ELEMENT_BYTES[precision]


def plan_bytes(report: dict) -> float:
    """What a plan may fill on a rank of the census: USABLE_MEMORY of its free memory less its reserved headroom
    (mem_reserved_gib: gpu_reserved_bytes on a GPU, 0 on a CPU)."""
    return (USABLE_MEMORY * report["mem_free_gib"] - report.get("mem_reserved_gib", 0.0)) * 2**30


def estimate_fit(total_bytes: float, params: int, act_bytes_per_sample: float, reserved: float,
                 per_param: float) -> int:
    """Samples per micro-batch that fit: `per_param` bytes of state per parameter (bytes_per_param) and
    activations (profiled in the run's precision), within USABLE_MEMORY of the device less `reserved` (a GPU's
    headroom for NCCL, ZeRO's buckets and cuBLAS); negative when the model alone does not fit."""
    return int((USABLE_MEMORY * total_bytes - reserved - params * per_param) // act_bytes_per_sample)


def device_memory(dev: torch.device, local_world_size: int) -> tuple[str, float, float]:
    """(device name, free bytes, total bytes); ranks on one host share its RAM."""
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return torch.cuda.get_device_properties(dev).name, free, total
    mem = psutil.virtual_memory()
    name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                "CPU")
    return name, mem.available / local_world_size, mem.total / local_world_size


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


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__


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


def forward_backward_bytes(model: nn.Module, sample: torch.Tensor, n: int,
                           autocast: torch.dtype | None = None) -> float | None:
    """Bytes one forward and backward at micro-batch n holds at its peak (weights, gradients, activations and
    input): the allocator's peak on a GPU (None if it ran out), the tensors kept for backward on a CPU. autocast:
    the forward under torch.autocast to that dtype, as DDP and the async pipeline train (the model in fp32), whose
    activations are not those of the model cast to it (ViT-B/16: 63.3 MiB a sample against 56.4 on a CPU)."""
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
