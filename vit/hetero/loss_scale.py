"""The fp16 initial loss scale from a short fp32 probe of the gradients (--loss-scale auto)."""
import copy
import gc
import math

import torch
import torch.distributed as dist
from torch import nn

from vit.errors import ConfigError
from vit.model import loss_fn

FP16_MAX = 65504.0
SCALE_MARGIN = 16  # --loss-scale auto leaves the largest probed gradient this far below FP16_MAX


class GradPeak:
    """The largest |gradient| seen: every layer's output (hooked in backward) and the parameters (read())."""

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


def probe_grad_max(layers: list[nn.Module], batches, dev: torch.device, grad_accum: int,
                   on_cpu: bool = False) -> float:
    """The largest |gradient| of fp32 forward and backward passes of (loss / grad_accum), over the parameters
    and every layer's output, on this rank's real batches; the maximum over all ranks.

    It trains a copy, on the rank's device or with on_cpu (the pipeline and ZeRO-3, where a GPU is not meant to
    hold the whole fp32 model) on the CPU; the copy is dropped and its memory released before returning, and
    `layers` are left as they were (where they were, without gradients)."""
    probe_dev = torch.device("cpu") if on_cpu else dev
    model = copy.deepcopy(nn.Sequential(*layers)).to(probe_dev)
    peak = GradPeak(list(model), probe_dev)
    with torch.random.fork_rng(devices=[probe_dev] if probe_dev.type == "cuda" else []):
        for x, y in batches:
            (loss_fn(model(x.to(probe_dev)), y.to(probe_dev)) / grad_accum).backward()
            peak.read(model)
            model.zero_grad(set_to_none=True)
    peak.remove()
    del model
    gc.collect()
    if probe_dev.type == "cuda":
        torch.cuda.empty_cache()
    value = peak.value.to(dev)  # all-reduced on the rank's own device: NCCL takes no CPU tensors
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def scale_power(grad_max: float) -> int:
    """The largest initial_scale_power with grad_max x 2^power x SCALE_MARGIN below the fp16 limit (0..32)."""
    if not math.isfinite(grad_max):
        raise ConfigError(f"--loss-scale auto: the fp32 probe's gradients are not finite ({grad_max}); lower --lr "
                          "or check the data")
    if grad_max == 0:
        return 16
    return max(0, min(32, math.floor(math.log2(FP16_MAX / (grad_max * SCALE_MARGIN)))))
