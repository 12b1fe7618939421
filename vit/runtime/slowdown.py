"""--simulate-slowdown RANK=FACTOR[,...]: make some ranks' compute FACTOR times slower, to study
mixed GPUs on identical hardware (or on one CPU machine).

Honest, not a fixed delay: every layer's forward, and its backward, is timed as it runs and followed
by a wait of (FACTOR - 1) x that time, so a rank behaves like a device FACTOR times slower at every
shape. Waiting (not repeating the work) leaves the host's cores to the other ranks, as a slower GPU
would. Communication and the optimizer are not slowed, except ZeRO-3's parameter gathering, which
runs inside a layer's forward.
"""

import time

import torch
from torch import nn

from vit.core.errors import ConfigError
from vit.runtime.gpu import wait_for_queued


def factors(text: str | None, world_size: int) -> dict[int, float]:
    """'1=2,3=1.5' -> {1: 2.0, 3: 1.5}."""
    factors = {}
    for item in filter(None, (text or "").split(",")):
        rank, _, factor = item.partition("=")
        try:
            rank, factor = int(rank), float(factor)
        except ValueError:
            raise ConfigError(
                f"--simulate-slowdown: '{item}' is not RANK=FACTOR (e.g. 1=2)"
            ) from None
        if not 0 <= rank < world_size:
            raise ConfigError(
                f"--simulate-slowdown: rank {rank} does not exist (world size {world_size})"
            )
        if factor < 1:
            raise ConfigError(
                f"--simulate-slowdown: factor {factor} for rank {rank} must be at least 1"
            )
        factors[rank] = factor
    return factors


class Clock:
    """Waits (factor - 1) x the compute time since start()."""

    def __init__(self, factor: float, device: torch.device):
        self.factor, self.device, self.t0 = factor, device, 0.0

    def now(self) -> float:
        # the layer's kernels, on this stream only (not NCCL's receives posted ahead)
        wait_for_queued(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self.t0 = self.now()

    def stop(self) -> None:
        time.sleep((self.factor - 1) * max(0.0, self.now() - self.t0))


class _Mark(torch.autograd.Function):
    """Identity whose backward starts (at a layer's output) or stops (at its input) the layer's
    clock."""

    @staticmethod
    def forward(ctx, x, clock, is_input):
        ctx.clock, ctx.is_input = clock, is_input
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.stop() if ctx.is_input else ctx.clock.start()
        return grad, None, None


def attach(module: nn.Module, factor: float, device: torch.device) -> None:
    """Slow down `module`'s forward and backward by `factor` (one tensor in, one tensor out)."""
    fwd, bwd = Clock(factor, device), Clock(factor, device)

    def before(_, inputs):
        fwd.start()
        x = inputs[0]
        # the first layer: mark where its backward ends
        if torch.is_grad_enabled() and not x.requires_grad:
            x = x.detach().requires_grad_()
        return (_Mark.apply(x, bwd, True), *inputs[1:]) if torch.is_grad_enabled() else None

    def after(_, inputs, output):
        fwd.stop()
        return _Mark.apply(output, bwd, False) if torch.is_grad_enabled() else None

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def attach_all(layers: list[nn.Module], factor: float, device: torch.device) -> list[nn.Module]:
    """attach() to every layer when factor is not 1; returns the layers."""
    if factor != 1:
        for layer in layers:
            attach(layer, factor, device)
    return layers
