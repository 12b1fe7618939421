"""Per-layer cost of the network: forward FLOPs, activation bytes kept for backward, parameters; and the memory
rules the planners share."""
import copy

import torch
from torch import nn

BYTES_PER_PARAM = 16  # fp32 weights, gradients and two AdamW moments; or half weights + grads + fp32 master
USABLE_MEMORY = 0.9  # plans leave 10% of the free memory for the allocator's fragmentation and the unforeseen
# What a GPU rank holds outside the weights, gradients, optimizer state and activations a plan counts: NCCL's
# buffers (NCCL_BUFFSIZE 4 MiB per channel, send and receive, on the rings and trees of each communicator) and the
# cuBLAS and cuBLASLt workspaces (up to 32 MiB each per stream in recent torch). ZeRO's buckets come from the JSON.
NCCL_BYTES = 384 * 2**20
CUBLAS_BYTES = 2 * 32 * 2**20
ZERO_BUCKET_DEFAULT = 500_000_000  # DeepSpeed's reduce_bucket_size and allgather_bucket_size, in elements


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
    return NCCL_BYTES + CUBLAS_BYTES + buckets * (2 if precision in ("fp16", "bf16") else 4)


def plan_bytes(report: dict) -> float:
    """What a plan may fill on a rank of the census: USABLE_MEMORY of its free memory less its reserved headroom
    (mem_reserved_gib: gpu_reserved_bytes on a GPU, 0 on a CPU)."""
    return (USABLE_MEMORY * report["mem_free_gib"] - report.get("mem_reserved_gib", 0.0)) * 2**30


def profile_layers(layers: list[nn.Module], sample: torch.Tensor, precision: str = "fp32") -> list[dict]:
    """Per layer and per sample: forward FLOPs, bytes kept for backward (activations), parameter count. In half
    precision the activations are measured on a copy of the layers in that dtype, as DeepSpeed runs them (what
    stays in fp32 there, stays in fp32 here)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from vit.hetero.census import DTYPES

    if precision != "fp32":
        layers = [copy.deepcopy(layer).to(DTYPES[precision]) for layer in layers]
        sample = sample.to(DTYPES[precision])
    out, x = [], sample
    with torch.random.fork_rng():
        for layer in layers:
            own = {p.untyped_storage().data_ptr() for p in layer.parameters()}
            saved = {}

            def pack(t):
                s = t.untyped_storage()
                if s.data_ptr() not in own:
                    saved[s.data_ptr()] = s.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = layer(x)
            counter = FlopCounterMode(display=False)
            with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):  # the math kernel's matmuls are counted
                layer(x)
            out.append({"name": type(layer).__name__, "flops": counter.get_total_flops(),
                        "act_bytes": sum(saved.values()), "params": sum(p.numel() for p in layer.parameters())})
            x = y.detach().requires_grad_()
    return out


def time_layers(layers: list[nn.Module], sample: torch.Tensor, micro_batch: int, precision: str,
                dev: torch.device, slowdown: float = 1.0) -> list[list[float]]:
    """[forward ms, backward ms] of each layer at the run's micro-batch on this rank, after a warm-up, slowed like
    the rank's layers (vit.hetero.census._timed). Measured on a copy of one layer at a time, so that a device
    too small for the whole model can time it; the fixed costs of tiny layers (kernel launches, the embedding's
    reshapes) count, which FLOPs do not see."""
    from vit.hetero.census import DTYPES, _timed
    from vit.slowdown import Clock

    dtype, clock, out = DTYPES[precision], Clock(slowdown, dev), []
    x = sample.to(dev, dtype).expand(micro_batch, *sample.shape[1:]).contiguous()
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        for i, layer in enumerate(layers):
            layer = copy.deepcopy(layer).to(dev, dtype)
            x = x.detach().requires_grad_(i > 0)  # the images need no gradient; a later stage's input does
            with torch.no_grad():
                grad = torch.randn_like(layer(x))

            def forward():
                return (layer(x),)

            def backward(y):
                y.backward(grad)

            out.append([1e3 * _timed(forward, clock), 1e3 * _timed(backward, clock, prepare=forward)])
            with torch.no_grad():
                x = layer(x)
    return out
