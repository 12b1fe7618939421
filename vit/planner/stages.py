"""Pipeline stages balanced by each layer's measured forward and backward time on each rank and by
free memory: the contiguous split of the layers with the fastest slowest stage that fits, by exact
dynamic programming (tested against brute force). Frozen prefix layers cost their forward only and
keep no activations (re-planning at a freeze point)."""

from collections.abc import Callable
from dataclasses import dataclass

from vit.core.costs import FROZEN_BYTES_PER_PARAM, pipeline_inflight
from vit.core.errors import ConfigError
from vit.planner.memory import plan_bytes


@dataclass
class StageSplit:
    parts: list[int]  # stage s holds layers parts[s]:parts[s+1] (PipelineModule's convention)
    times: list[float]  # predicted seconds per micro-batch, forward and backward
    mems: list[float]  # predicted bytes
    # the per-stage, per-rank layer seconds it was planned with
    layer_s: list[list[list[float]]] | None = None


def stage_cost(s, i, j, time, static, act, inflight) -> tuple[float, float]:
    """(seconds, bytes) of layers i..j-1 on stage s: its slowest rank's sum of their times
    (time[s][r][layer])."""
    return max(sum(row[i:j]) for row in time[s]), sum(static[i:j]) + sum(act[i:j]) * inflight[s]


def balanced_split(
    time: list[list[list[float]]],
    static: list[float],
    act: list[float],
    capacity: list[float],
    inflight: list[int],
    min_first: int = 0,
    cost: Callable[[int, int, int], tuple[float, float]] | None = None,
) -> StageSplit | None:
    """The contiguous split of the layers into len(time) non-empty stages that minimises the slowest
    stage's time (time[s][r][i]: seconds of layer i on rank r of stage s) with every stage's memory
    (static + act x inflight) within its capacity, the first stage ending past layer min_first; None
    when no split fits. Exact dynamic programming over the end of each stage. `cost`(s, i, j) ->
    (seconds, bytes) replaces stage_cost (the planner's stage time with its boundaries' transfer,
    vit.planner)."""
    n, stages = len(static), len(time)
    cost = cost or (lambda s, i, j: stage_cost(s, i, j, time, static, act, inflight))
    # (stages used, layers placed) -> (slowest time so far, previous cut)
    best = {(0, 0): (0.0, None)}
    for s in range(stages):
        for j in range(max(s + 1, min_first + 1 if s == 0 else 0), n - (stages - s - 1) + 1):
            options = []
            for i in range(s, j):
                if (s, i) not in best:
                    continue
                t, m = cost(s, i, j)
                if m <= capacity[s]:
                    options.append((max(best[(s, i)][0], t), i))
            if options:
                best[(s + 1, j)] = min(options)
    if (stages, n) not in best:
        return None
    parts = [n]
    for s in range(stages, 0, -1):
        parts.append(best[(s, parts[-1])][1])
    parts.reverse()
    stats = [cost(s, parts[s], parts[s + 1]) for s in range(stages)]
    return StageSplit(parts, [t for t, _ in stats], [m for _, m in stats], time)


@dataclass(frozen=True)
class FrozenRules:
    """How a stage plan prices the frozen layers beyond their forward only and no activations kept:
    `share`, what they keep of their state when trained (their weights: 4 of fp32 AdamW's 16 bytes
    per parameter by default); `first_active`, whether the first stage must hold an active layer (a
    stage of frozen layers only has no backward, which DeepSpeed's pipeline cannot skip)."""

    share: float = 0.25
    first_active: bool = False


def plan_layers(
    layer_s: list[list[tuple[float, float]]],
    static_bytes: list[float],
    act_bytes: list[float],
    capacity_bytes: list[float],
    stages: int,
    grad_accum: int,
    frozen: int = 0,
    rules: FrozenRules = FrozenRules(),
) -> StageSplit:
    """The balanced plan from measurements. layer_s[rank][i]: (forward, backward) seconds of layer i
    at the run's micro-batch on that rank; static_bytes[i]: its weights, gradients and optimizer
    state when trained; act_bytes[i]: its activations kept for backward per micro-batch;
    capacity_bytes[rank]: what a plan may fill. The first `frozen` layers cost their forward only
    and keep no activations, their state and place as `rules` has them. Stage s runs on ranks
    s*dp .. s*dp+dp-1 (DeepSpeed's pipe-major rank order, dp = ranks // stages). ConfigError when
    no split fits."""
    n, dp = len(static_bytes), len(layer_s) // stages
    time = [
        [
            [f + (b if i >= frozen else 0.0) for i, (f, b) in enumerate(layer_s[r])]
            for r in range(s * dp, (s + 1) * dp)
        ]
        for s in range(stages)
    ]
    static = [m * (rules.share if i < frozen else 1.0) for i, m in enumerate(static_bytes)]
    act = [0.0 if i < frozen else a for i, a in enumerate(act_bytes)]
    capacity = [min(capacity_bytes[s * dp : (s + 1) * dp]) for s in range(stages)]
    plan = balanced_split(
        time,
        static,
        act,
        capacity,
        pipeline_inflight(stages, grad_accum),
        frozen if rules.first_active else 0,
    )
    if plan is None:
        need = (sum(static) + sum(act)) / stages / 2**30
        raise ConfigError(
            f"--partition balanced: no split of the {n} layers into {stages} stages fits in the "
            f"ranks' free memory (at least {need:.2f} GiB per stage on average, smallest free "
            f"{min(capacity) / 2**30:.2f} GiB usable); use more stages or a smaller micro-batch"
        )
    return plan


def plan_stages(
    profile: list[dict],
    reports: list[dict],
    stages: int,
    micro_batch: int,
    grad_accum: int,
    bytes_per_param: float,
    frozen: int = 0,
    first_active: bool = False,
) -> StageSplit:
    """plan_layers from the census: each rank's measured layer times (layer_ms, at
    layer_ms_micro_batch) and free memory, the profile's parameters (bytes_per_param each:
    vit.planner.memory.bytes_per_param) and activations. A re-plan at another micro-batch (more
    data-parallel copies after a freeze) scales the times in proportion, which keeps the fixed
    costs' share as measured. One stage needs no times: without layer_ms they count 0."""
    if stages > 1 and not all("layer_ms" in r for r in reports):
        raise ValueError("a plan of several stages needs every rank's layer_ms")
    layer_s = [
        [
            (
                f / 1e3 * micro_batch / r.get("layer_ms_micro_batch", micro_batch),
                b / 1e3 * micro_batch / r.get("layer_ms_micro_batch", micro_batch),
            )
            for f, b in r.get("layer_ms", [(0.0, 0.0)] * len(profile))
        ]
        for r in reports
    ]
    return plan_layers(
        layer_s,
        [p["params"] * bytes_per_param for p in profile],
        # profiled in the run's precision
        [p["act_bytes"] * micro_batch for p in profile],
        [plan_bytes(r) for r in reports],
        stages,
        grad_accum,
        frozen,
        FrozenRules(min(1.0, FROZEN_BYTES_PER_PARAM / bytes_per_param), first_active),
    )
