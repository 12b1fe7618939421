"""Freeze training's engine side (PipeTransformer's AutoFreeze): the Freezer takes the rules'
decisions (vit.freeze.rules) at its cadence, freezes the prefix (no gradients, no activations kept,
no optimizer state, nothing to all-reduce) and rebuilds the engine on it, the pipeline re-planned
(vit.freeze.replan) and the frozen prefix's outputs cached (vit.freeze.activation_cache).

Decisions are taken every --freeze-interval-epochs, at the end of a step, from values every rank
holds alike (the step, gradient norms summed over all ranks or weight moves taken as the largest
over them; vit.freeze.measures), so every rank rebuilds its engine at the same step.
"""

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from vit.core.layout import Layout
from vit.core.settings import FreezeSettings
from vit.freeze.activation_cache import FeatureCache, cached_batches
from vit.freeze.measures import GradNorms, WeightMoves, changes
from vit.freeze.replan import replan
from vit.freeze.rules import THRESHOLDS, by_measure, layer_range, next_measure, scheduled
from vit.runtime.dist_env import live_process_groups


def _frozen_forward(layer: nn.Module, forward, cached: bool):
    def run(x, *args, **kwargs):
        # the input is already the frozen prefix's output (vit.freeze.activation_cache)
        if cached and layer.training:
            return x
        with torch.no_grad():
            return forward(x, *args, **kwargs)

    return run


def freeze_prefix(layers: list[nn.Module], count: int, cached: bool = False) -> None:
    """requires_grad False and a forward that records nothing for autograd, for layers[:count]
    (before an engine is built on them, so that its optimizer, its gradient buckets and DDP's
    reducer leave them out); cached: in training they pass their input through, which --freeze-cache
    has computed already."""
    for layer in layers[:count]:
        layer.requires_grad_(False)
        if getattr(layer, "frozen_forward", None) is None:
            layer.frozen_forward = _frozen_forward(layer, layer.forward, False)
            layer.forward = _frozen_forward(layer, layer.frozen_forward, cached)


@dataclass(frozen=True)
class RebuildParts:
    """What a freeze point takes from the run: make_layers(), a fresh copy of the layer list;
    make_engine(layers, layout), the run's engine built on them; census, vit.planner.survey's
    record, and time_layers() (collective), every rank's layer times, for --freeze-replan at the
    run's micro_batch; on_progress(), a sign of life inside a long carry of the cache."""

    make_layers: Callable[[], list] | None = None
    make_engine: Callable | None = None
    census: dict | None = None
    micro_batch: int = 1
    time_layers: Callable[[], list] | None = None
    on_progress: Callable[[], None] | None = None


class Freezer:
    """Decides its own cadence: after each step, `decide(step)` returns the new number of frozen
    layers at a freeze point where it grew, else None."""

    def __init__(
        self,
        s: FreezeSettings,
        num_layers: int,
        steps_per_epoch: int,
        total_steps: int,
        device: torch.device,
        *,
        frozen: int = 0,
        run_parts: RebuildParts = RebuildParts(),
        cache_dir: str | None = None,
    ):
        """frozen: layers frozen already (a resumed run); run_parts: what a freeze point takes from
        the run; cache_dir: --freeze-cache's spill folder (None: no cache)."""
        self.mode, self.alpha, self.total_steps = s.freeze, s.freeze_alpha, total_steps
        self.num_freezable = num_layers - 1
        self.interval_steps = max(1, round(s.freeze_interval_epochs * steps_per_epoch))
        self.frozen, self.previous, self.replan = frozen, None, s.freeze_replan == "on"
        self.threshold = s.freeze_threshold or THRESHOLDS.get(self.mode, THRESHOLDS["grad"])
        # grad decides by each layer's gradients and schedule warns when it outruns them; settled
        # decides by weights.
        self.norms = (
            GradNorms(self.num_freezable, device) if self.mode in ("grad", "schedule") else None
        )
        self.moves = (
            WeightMoves(self.num_freezable, self.interval_steps) if self.mode == "settled" else None
        )
        self.run_parts = run_parts
        self.planned = None  # the StageSplit of the last re-plan
        self.layout = None  # the pipeline's layout once a freeze point changed it
        self.cache = FeatureCache(s.freeze_cache_gib, cache_dir) if cache_dir else None
        self.layers = None
        self.said = None  # the last decision's measure of the next layer to freeze
        self.change = None  # the last decision's per-layer measure (None: nothing to compare yet)
        self.warned = False  # the schedule froze a layer still learning (said once per run)

    def freeze(self, layers: list[nn.Module], frozen: int) -> None:
        """Freeze the prefix of the layers an engine is about to be built on."""
        freeze_prefix(layers, frozen, cached=self.cache is not None)
        self.layers = layers

    def feeds_from_cache(self, engine) -> bool:
        """Whether this rank's engine takes the cache's features: the cache is on, something is
        frozen and this rank holds the first layer."""
        holds = any(name.startswith("0.") for name, _ in engine.live_module().named_parameters())
        return self.cache is not None and self.frozen > 0 and holds

    def samples(self, engine, workers: int):
        """The samples whose images this rank needs not read (the cache, looked up as they are
        fetched), where it feeds the engine from the cache and fetches in this process; a loader
        worker's copy of the cache would not see it grow. Else None."""
        return self.cache if workers == 0 and self.feeds_from_cache(engine) else None

    def cached(self, batches, order, engine):
        """This rank's batches, through the cache where it feeds the engine from it (its entries
        carried to the current frozen prefix first)."""
        if not self.feeds_from_cache(engine):
            if self.cache is not None:
                self.cache.clear()  # nothing to keep it for on this rank
            return batches
        prefix = self.layers[: self.frozen]
        dtype = next(prefix[0].parameters()).dtype

        def run(x, start: int = 0):
            x = x.to(dtype)
            for layer in prefix[start:]:
                x = layer.frozen_forward(x)
            return x

        self.cache.advance(
            self.frozen,
            lambda x, start: run(x.to(engine.device), start).cpu(),
            self.run_parts.on_progress,
        )
        return cached_batches(batches, order, run, self.cache, engine.device)

    def due(self, step: int) -> bool:
        """Whether after_step(step) is a decision point (where it may rebuild the engine)."""
        return self.mode != "none" and step % self.interval_steps == 0 and step < self.total_steps

    def after_step(self, step: int, engine, metrics) -> "object | None":
        """Collective: at a freeze point, the engine rebuilt with the longer frozen prefix (else
        None)."""
        current = engine.layout  # a pipeline's stages, else None
        # Without re-planning a pipeline's first stage must keep an active layer (it would have no
        # backward).
        if self.moves is not None:
            self.moves.stepped(engine.lr)
        frozen = self.decide(
            step, cap=current.parts[1] - 1 if current and not self.replan else None, engine=engine
        )
        if self.said:
            metrics.write(
                "freeze_decision",
                step,
                frozen=self.frozen,
                changes=self.change,
                norms=self.previous,
                threshold=self.threshold,
            )
        if frozen is None:
            if self.said and dist.get_rank() == 0:
                print(f"freeze at step {step}: nothing frozen ({self.said})", flush=True)
            return None

        def plan(layers: list) -> Layout | None:
            if current is None or not self.replan:
                # explicit boundaries: DeepSpeed's own methods count trainable layers
                self.layout = current
                return current
            self.layout, self.planned = replan(
                self.run_parts.census,
                frozen,
                current,
                self.run_parts.micro_batch,
                self.run_parts.time_layers,
            )
            return self.layout

        # the old engine's: nothing may keep them alive while the new one is built
        self.layers = None
        rebuilt, freed = rebuild(
            engine,
            lambda layers: self.freeze(layers, frozen),
            self.run_parts.make_layers,
            self.run_parts.make_engine,
            plan,
        )
        self.watch(rebuilt, step)
        self.rescale(current, rebuilt.layout if current else None)
        stages = rebuilt.layout.stages if current else 1
        planned = {"parts": rebuilt.layout.parts} if current else {}
        # one stage, never timed: no prediction
        if current and self.replan and any(self.planned.times):
            planned["predicted_ms"] = 1e3 * max(self.planned.times)
        measure = {
            "next_change": self.change[frozen]
            if self.change and frozen < len(self.change)
            else None,
            "threshold": self.threshold,
        }
        metrics.write(
            "freeze",
            step,
            frozen=frozen,
            **measure,
            stages=stages,
            dp=rebuilt.dp_size,
            cache=self.cache is not None,
            old_engine_freed=freed,
            process_groups=live_process_groups(),
            **planned,
        )
        if dist.get_rank() == 0:
            plan = f", layers {planned['parts']}" if planned else ""
            plan += (
                f", slowest stage {planned['predicted_ms']:.2f} ms predicted"
                if "predicted_ms" in planned
                else ""
            )
            print(
                f"freeze at step {step}: {layer_range(frozen)} frozen ({self.said}); "
                f"{stages} stages x {rebuilt.dp_size} data-parallel{plan}",
                flush=True,
            )
        return rebuilt

    def rescale(self, before: Layout | None, after: Layout | None) -> None:
        """A micro-batch's gradient is 1/grad_accum of its step's: when a re-plan changes the
        micro-batches per copy (the total stays), the last interval's norms are put on the new
        scale, else every layer would seem to change by the ratio (x2 when 2 stages become 1 stage x
        2 copies)."""
        if before and after and self.previous and before.grad_accum != after.grad_accum:
            self.previous = [p * before.grad_accum / after.grad_accum for p in self.previous]

    def watch(self, engine, step: int) -> None:
        """Collective: measure this (newly built) engine's gradients, or its weights from this step
        on (a freeze point's decision copied them already: the same weights)."""
        if self.norms is not None:
            self.norms.attach(engine.live_module())
        if self.moves is not None and self.moves.since != step:
            self.moves.snapshot(engine, step)

    def decide(self, step: int, cap: int | None = None, engine=None) -> int | None:
        """The new number of frozen layers (at most `cap`) at a freeze point where it grew, else
        None; at every freeze point `self.said` gives the next layer's measure. No decision once no
        more layers can freeze."""
        self.said = None
        limit = self.num_freezable if cap is None else min(cap, self.num_freezable)
        if (
            self.mode == "none"
            or step % self.interval_steps
            or step >= self.total_steps
            or self.frozen >= limit
        ):
            return None
        allowed = min(limit, scheduled(step // self.interval_steps, self.num_freezable, self.alpha))
        if self.moves is not None:
            self.change = self.moves.take(engine, step)
        else:
            now = self.norms.take()
            self.change = changes(self.previous, now) if self.previous is not None else None
            self.previous = now
        if self.mode == "schedule":
            frozen = max(allowed, self.frozen)
            self.warn_if_learning(step, frozen)
        elif self.change is None:
            frozen = self.frozen
        else:
            frozen = by_measure(self.change, self.frozen, self.threshold, self.alpha, allowed)
        self.said = next_measure(self.change, frozen, self.threshold, self.num_freezable, self.mode)
        if frozen <= self.frozen:
            return None
        self.frozen = frozen
        return frozen

    def warn_if_learning(self, step: int, frozen: int) -> None:
        """--freeze schedule: one line, once per run, when it freezes a layer whose gradient change
        says it is still learning."""
        learning = [
            i
            for i in range(self.frozen, frozen)
            if self.change and self.change[i] >= self.threshold
        ]
        if learning and not self.warned and dist.get_rank() == 0:
            print(
                f"warning: the freeze schedule freezes layer {learning[0]} at step {step} while it "
                f"still learns (gradient change {self.change[learning[0]]:.3g} >= "
                f"--freeze-threshold {self.threshold:g}); --freeze grad waits for it",
                flush=True,
            )
        self.warned = self.warned or bool(learning)

    def checkpoint_state(self) -> dict:
        """Collective: what a checkpoint records (nothing without --freeze)."""
        return {"freeze": self.state_dict()} if self.mode != "none" else {}

    def state_dict(self) -> dict:
        """Collective under --freeze (the gradient norms)."""
        return {
            "frozen": self.frozen,
            "previous": self.previous,
            "peak": self.moves.peak if self.moves else None,
            "layout": self.layout.__dict__ if self.layout else None,
            "sums": self.norms.state_dict() if self.norms is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.frozen, self.previous = state["frozen"], state["previous"]
        self.layout = Layout(**state["layout"]) if state.get("layout") else None
        if self.moves is not None and state.get("peak"):
            self.moves.peak = state["peak"]
        if self.norms is not None and state["sums"] is not None:
            self.norms.load_state_dict(state["sums"])


def rebuild(
    engine, freeze, make_layers, make_engine, plan=lambda layers: None
) -> tuple["object", bool]:
    """Collective: a new engine on fresh layers holding the old one's weights, freeze(layers)
    freezing a prefix, continuing the old one's optimizer state, LR schedule, loss scaler and EMA;
    plan(layers): a pipeline's new vit.core.layout.Layout (None: the engine's layout as it was).
    DeepSpeed and DDP fix their parameters, buckets and hooks at construction, so freezing means
    building them again. The old engine is closed and its memory freed first, its state held on the
    host meanwhile: (the new engine, whether the old one's module was gone before the new one was
    built)."""
    state, weights = engine.handover(), engine.whole_weights()
    device, module = engine.device, weakref.ref(engine.live_module())
    engine.close()
    freed = free_memory(device, module)
    # Building layers re-seeds torch's generator; dropout and drop-path must go on drawing as
    # before.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        layers = make_layers()
    with torch.no_grad():
        nn.Sequential(*layers).load_state_dict(weights)
    freeze(layers)
    rebuilt = make_engine(layers, plan(layers))
    rebuilt.take_over(state)
    return rebuilt, freed


def free_memory(device: torch.device, module: weakref.ref) -> bool:
    """Collect what a closed engine left (DeepSpeed's hooks hold its module in reference cycles) and
    hand the GPU memory it held back to the driver; True when `module` is gone."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return module() is None
