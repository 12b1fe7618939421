"""Per-layer cost of the network: forward FLOPs, activation bytes kept for backward, parameters, and
each layer's measured forward and backward time (the memory rules the planners share are
vit.planner.memory's)."""

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vit.planner.census import warmup_s
from vit.runtime.gpu import fork_rng
from vit.runtime.precision import DTYPES
from vit.runtime.slowdown import Clock


def profile_layers(
    layers: list[nn.Module], sample: torch.Tensor, precision: str = "fp32"
) -> list[dict]:
    """Per layer and per sample: forward FLOPs, bytes kept for backward (activations), parameter
    count, output elements (what a pipeline boundary after it sends). In half precision the
    activations are measured on a copy of the layers in that dtype, as DeepSpeed runs them (what
    stays in fp32 there, stays in fp32 here)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    if precision != "fp32":
        layers = [copy.deepcopy(layer).to(DTYPES[precision]) for layer in layers]
        sample = sample.to(DTYPES[precision])
    out, x = [], sample
    with fork_rng(sample.device):
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
            # the math kernel's matmuls are counted
            with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
                layer(x)
            out.append(
                {
                    "name": type(layer).__name__,
                    "flops": counter.get_total_flops(),
                    "act_bytes": sum(saved.values()),
                    "params": sum(p.numel() for p in layer.parameters()),
                    "out_elems": y.numel() // y.shape[0],
                }
            )
            x = y.detach().requires_grad_()
    return out


LAYER_ROUNDS = 10  # rounds per turn of time_layers
LAYER_TURNS = 2  # for balanced stages survey() alternates the ranks' turns this many times


@dataclass(frozen=True)
class Timing:
    """How time_layers times: `rounds` rounds kept, after `warmup_s` of such rounds (None: the
    device's, census.warmup_s; 0 for a rank timed moments before, whose times are kept only where
    faster); `pick`: how a layer's rounds (and a group's layers) become one time, statistics.median
    for the time while other ranks load the host as training does (--engine auto times every rank
    at once)."""

    rounds: int = LAYER_ROUNDS
    pick: Callable = min
    warmup_s: float | None = None


def time_layers(
    layers: list[nn.Module],
    sample: torch.Tensor,
    micro_batch: int,
    precision: str,
    dev: torch.device,
    slowdown: float = 1.0,
    timing: Timing = Timing(),
    autocast: bool = False,
) -> list[list[float]]:
    """[forward ms, backward ms] of each layer at the run's micro-batch on this rank, slowed like
    the rank's layers: the fastest of the timing's rounds that each time every layer once, after its
    warm-up. Round by round, so that a burst of load on a shared host slows all layers alike, not a
    few. Identical layers (the blocks) get their group's fastest: they cost the same, and any
    difference is noise. The fixed costs of tiny layers (kernel launches, the embedding's reshapes)
    count, which FLOPs do not see. Runs a copy of the layers on `dev`. `autocast`: the layers stay
    fp32 and run under torch.autocast in `precision`, as an engine that autocasts trains them
    (EngineSpec.autocast: DDP, the async pipeline), not cast to it as DeepSpeed's are."""
    dtype, clock = DTYPES[precision], Clock(slowdown, dev)
    cast = torch.float32 if autocast else dtype
    copies = [copy.deepcopy(layer).to(dev, cast) for layer in layers]
    inputs, grads = [], []
    x = sample.to(dev, cast).expand(micro_batch, *sample.shape[1:]).contiguous()
    autocasting = torch.autocast(dev.type, dtype, enabled=autocast and precision != "fp32")
    with fork_rng(dev), autocasting:
        with torch.no_grad():
            for i, layer in enumerate(copies):
                # the images need no gradient; a later stage's input does
                inputs.append(x.requires_grad_(i > 0))
                x = layer(x)
                grads.append(torch.randn_like(x))
        times = [[] for _ in copies]

        def one_round(keep: bool) -> None:
            for i, layer in enumerate(copies):
                clock.start()
                y = layer(inputs[i])
                clock.stop()
                mid = clock.now()
                forward_s = mid - clock.t0
                clock.start()
                y.backward(grads[i])
                clock.stop()
                if keep:
                    times[i].append((forward_s, clock.now() - mid))

        start, warmup = clock.now(), warmup_s(dev) if timing.warmup_s is None else timing.warmup_s
        while clock.now() - start < warmup:
            one_round(False)
        for _ in range(timing.rounds):
            one_round(True)
    groups = {}
    for i, layer in enumerate(layers):
        shapes = tuple((n, tuple(p.shape)) for n, p in layer.named_parameters())
        groups.setdefault((type(layer).__name__, shapes, tuple(inputs[i].shape)), []).append(i)
    best = [None] * len(copies)
    for members in groups.values():
        pooled = [timing.pick(t[k] for i in members for t in times[i]) for k in (0, 1)]
        for i in members:
            best[i] = pooled
    return [[1e3 * f, 1e3 * b] for f, b in best]
