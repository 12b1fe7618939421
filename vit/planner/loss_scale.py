"""The fp16 initial loss scale from a short fp32 probe of the gradients (--loss-scale auto), in
chunks of samples that fit an fp32 copy of the model on the rank's device, or on the CPU when not
even one sample does."""

import copy
import gc
import math

import torch
import torch.distributed as dist
from torch import nn

from vit.core.costs import ELEMENT_BYTES
from vit.core.errors import ConfigError, OutOfMemory
from vit.core.settings import DEFAULT_FP16_SCALE_POWER
from vit.model.layers import loss_fn
from vit.planner.oom import first_line, is_oom
from vit.planner.profile import profile_layers

FP16_MAX = 65504.0
SCALE_MARGIN = 16  # --loss-scale auto leaves the largest probed gradient this far below FP16_MAX


class GradPeak:
    """The largest |gradient| seen: every layer's output (hooked in backward) and the parameters
    (read())."""

    def __init__(self, layers: list[nn.Module], dev: torch.device):
        self.value = torch.zeros((), device=dev)
        self.handles = [layer.register_forward_hook(self._watch) for layer in layers]

    def keep(self, grad: torch.Tensor) -> None:
        self.value.copy_(torch.maximum(self.value, grad.detach().abs().max().float()))

    def _watch(self, module, inputs, output):
        if output.requires_grad:
            output.register_hook(self.keep)

    def read(self, model: nn.Module) -> torch.Tensor:
        """Fold in the parameters' gradients; the peak so far."""
        for p in model.parameters():
            if p.grad is not None:
                self.keep(p.grad)
        return self.value

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def probe_chunk(
    capacity_bytes: float, params: int, act_bytes_per_sample: float, micro_batch: int
) -> int:
    """Samples per forward and backward of the probe: its fp32 copy's weights and gradients and fp32
    activations within capacity_bytes (vit.planner.memory.plan_bytes), at most micro_batch; 0 when
    not even one sample fits."""
    room = capacity_bytes - 2 * ELEMENT_BYTES["fp32"] * params
    return max(0, min(micro_batch, int(room // act_bytes_per_sample)))


def probe_grad_max(
    layers: list[nn.Module],
    batches,
    dev: torch.device,
    grad_accum: int,
    on_cpu: bool = False,
    chunk: int | None = None,
) -> float:
    """The largest |gradient| of fp32 forward and backward passes of (loss / grad_accum), over the
    parameters and every layer's output, on this rank's real batches; the maximum over all ranks. A
    micro-batch runs `chunk` samples at a time (all at once without), each chunk's loss weighted by
    its share of the micro-batch, so the gradients are the micro-batch's.

    It trains a copy, on the rank's device or with on_cpu (the pipeline and ZeRO-3, where a GPU is
    not meant to hold the whole fp32 model) on the CPU; the copy is dropped and its memory released
    before returning, and `layers` are left as they were (where they were, without gradients). Out
    of memory: OutOfMemory naming the probe."""
    probe_dev = torch.device("cpu") if on_cpu else dev
    model = copy.deepcopy(nn.Sequential(*layers)).to(probe_dev)
    peak = GradPeak(list(model), probe_dev)
    try:
        with torch.random.fork_rng(devices=[probe_dev] if probe_dev.type == "cuda" else []):
            for x, y in batches:
                for xs, ys in zip(x.split(chunk or len(x)), y.split(chunk or len(x))):
                    loss = loss_fn(model(xs.to(probe_dev)), ys.to(probe_dev))
                    (loss * (len(xs) / len(x) / grad_accum)).backward()
                peak.read(model)
                model.zero_grad(set_to_none=True)
    except RuntimeError as e:
        if not is_oom(e):
            raise
        raise OutOfMemory(
            f"out of memory in the --loss-scale auto probe on {probe_dev} (an fp32 copy of "
            f"the model, {chunk or 'whole'} samples per forward and backward), before step "
            f"1: {first_line(e)}. Skip the probe: --loss-scale config (the DeepSpeed "
            f"JSON's fp16.initial_scale_power, else {DEFAULT_FP16_SCALE_POWER}), or "
            "--precision bf16 where every GPU has it"
        ) from None
    finally:
        peak.remove()
        model = None
        gc.collect()
        if probe_dev.type == "cuda":
            torch.cuda.empty_cache()
    value = peak.value.to(dev)  # all-reduced on the rank's own device: NCCL takes no CPU tensors
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def tune(
    layers: list[nn.Module],
    batches,
    dev: torch.device,
    grad_accum: int,
    sample: torch.Tensor,
    capacity_bytes: float,
    micro_batch: int,
    on_cpu: bool,
) -> tuple[int, dict, str]:
    """--loss-scale auto: probe_grad_max on the rank's device in chunks whose fp32 forward and
    backward fit capacity_bytes (probe_chunk, from the layers' fp32 profile), or on the CPU with
    on_cpu or when not even one sample fits. (initial_scale_power, cluster.json's loss_scale record,
    the line rank 0 prints)."""
    chunk = None
    if not on_cpu:
        fp32 = profile_layers(layers, sample, "fp32")
        chunk = (
            probe_chunk(
                capacity_bytes,
                sum(p["params"] for p in fp32),
                sum(p["act_bytes"] for p in fp32),
                micro_batch,
            )
            or None
        )
        on_cpu = chunk is None
    grad_max = probe_grad_max(layers, batches, dev, grad_accum, on_cpu=on_cpu, chunk=chunk)
    power = scale_power(grad_max)
    how = "on the CPU" if on_cpu else f"{chunk} samples at a time"
    return (
        power,
        {"probe_grad_max": grad_max, "initial_scale_power": power, "probe_chunk": chunk},
        (
            f"fp16 loss scale: largest gradient of a {2 * grad_accum}-micro-batch fp32 probe "
            f"({how}) {grad_max:.3g} -> initial_scale_power {power} (2^{power} x {grad_max:.3g} x "
            f"margin {SCALE_MARGIN} < {FP16_MAX:g})"
        ),
    )


def scale_power(grad_max: float) -> int:
    """The largest initial_scale_power with grad_max x 2^power x SCALE_MARGIN below the fp16 limit
    (0..32)."""
    if not math.isfinite(grad_max):
        raise ConfigError(
            f"--loss-scale auto: the fp32 probe's gradients are not finite ({grad_max}); "
            "lower --lr or check the data"
        )
    if grad_max == 0:
        return 16
    return max(0, min(32, math.floor(math.log2(FP16_MAX / (grad_max * SCALE_MARGIN)))))
