"""The candidates: every engine (vit.engines.registry's specs) at each ZeRO stage it runs, each
stage count that divides the ranks with its best partition, equal and proportional batch splits,
each compression option, each micro-batch that divides the global batch; the best micro-batch of
each, ranked by predicted time per image (those that fit every rank's memory first)."""

import math
from collections.abc import Iterator

from vit.core.costs import Calibration, Candidate, Network, Prediction, Rank, Workload
from vit.core.spec import EngineSpec
from vit.core.speeds import SAME_SPEED
from vit.engines.registry import SPECS, spec
from vit.planner.batch_split import proportional_split
from vit.planner.predict import predict
from vit.planner.stages import balanced_split


def divisors(k: int) -> list[int]:
    return [d for d in range(1, k + 1) if k % d == 0]


def zero_stages(engine: EngineSpec, dp: int) -> tuple[int, ...]:
    """The ZeRO stages worth trying: those the engine runs at; only 0 without data parallelism."""
    stages = (engine.zero_stage,) if engine.zero_stage is not None else engine.zero_stages
    return stages if dp > 1 else (0,)


def best_parts(
    c: Candidate, ranks: list[Rank], net: Network, work: Workload, calib: Calibration
) -> tuple[int, ...] | None:
    """The contiguous split of the layers whose slowest stage (what it alone makes the step, from
    its compute and its link per micro-batch: the engine's stage_step_s) is fastest and fits each
    stage's memory: vit.planner.stages' exact dynamic programming with the planner's stage cost (the
    stages' all-reduce among data-parallel copies aside). Among the splits that reach that step
    (many, where the link sets it), the one with the least compute on its busiest stage: a second
    pass of the same programming, the others ruled out. When no split fits, the fastest regardless
    of memory (predicted as not fitting); None only when there are fewer layers than stages."""
    n, dp, engine = len(work.layers), len(ranks) // c.stages, spec(c.engine)
    caps = [
        min(engine.capacity(r, c.zero_stage, work.precision) for r in ranks[s * dp : (s + 1) * dp])
        for s in range(c.stages)
    ]
    costs, busy = {}, engine.busy_slots(c, ranks)

    def cost(s: int, i: int, j: int) -> tuple[float, float, float]:
        if (s, i, j) not in costs:
            compute, transfer = engine.stage_time_s(c, ranks, net, work, calib, s, i, j)
            costs[s, i, j] = (
                engine.stage_step_s(c, calib, compute, transfer, busy),
                engine.stage_mem_bytes(c, work, dp, s, i, j),
                compute,
            )
        return costs[s, i, j]

    def split(caps: list[float], limit: float = math.inf):
        def within(s: int, i: int, j: int) -> tuple[float, float]:
            step, mem, compute = cost(s, i, j)
            return (
                (step, mem) if limit == math.inf else (compute, mem if step <= limit else math.inf)
            )

        return balanced_split(
            [[]] * c.stages, [0.0] * n, [0.0] * n, caps, [1] * c.stages, cost=within
        )

    plan = split(caps) or split([math.inf] * c.stages)
    if plan is None:
        return None
    fitting = caps if split(caps) else [math.inf] * c.stages
    return tuple(split(fitting, max(plan.times) * (1 + 1e-12)).parts)


def proportional(c: Candidate, ranks: list[Rank], work: Workload) -> tuple[int, ...] | None:
    """--batch-split proportional: micro_batch x ranks shared in proportion to each rank's speed (1
    / its per-sample forward and backward) within what its memory holds
    (batch_split.proportional_split); None when it does not fit or equals the equal split, or when
    the ranks' speeds are within SAME_SPEED of each other."""
    speeds = [1 / (sum(r.fwd_s) + sum(r.bwd_s)) for r in ranks]
    if max(speeds) < (1 + SAME_SPEED) * min(speeds):
        return None
    engine = spec(c.engine)
    state = work.params * engine.per_param_bytes(c, work, len(ranks))
    act = sum(x.act_bytes for x in work.layers)
    caps = [int((engine.capacity(r, c.zero_stage, work.precision) - state) // act) for r in ranks]
    try:
        split = proportional_split(c.micro_batch * len(ranks), speeds, caps)
    except ValueError:
        return None
    return None if len(set(split)) == 1 else tuple(split)


def families(ranks: list[Rank], work: Workload) -> Iterator[tuple[EngineSpec, int, int, str, bool]]:
    """(engine, pipeline stages, ZeRO stage, compression, proportional split) of every candidate
    family."""
    n = len(ranks)
    for engine in SPECS.values():
        for stages in (
            [s for s in divisors(n) if 1 < s <= len(work.layers)] if engine.pipeline else [1]
        ):
            dp = n // stages
            for zero in zero_stages(engine, dp):
                for comp in engine.compressions(work.precision):
                    if dp == 1 and comp not in ("none", "wire-bf16"):
                        continue  # nothing to all-reduce
                    # DiLoCo refuses --batch-split proportional: its inner steps follow speed
                    splits = stages == 1 and n > 1 and not engine.local_steps
                    for split in (False, True) if splits else (False,):
                        yield engine, stages, zero, comp, split


def family_best(
    family, ranks: list[Rank], net: Network, work: Workload, calib: Calibration
) -> Prediction | None:
    """The family's best micro-batch: the fastest that fits, else the fastest (marked as not
    fitting). A pipeline takes at least as many micro-batches as stages."""
    engine, stages, zero, comp, split = family
    dp = len(ranks) // stages
    if work.global_batch % dp:
        return None
    best = None
    for micro in divisors(work.global_batch // dp):
        c = Candidate(engine.name, zero, stages, micro, work.global_batch // dp // micro, comp)
        if c.grad_accum < stages:
            # 1F1B needs a micro-batch per stage to fill; fewer leave transfers the model assumes
            # hidden
            continue
        if split:
            sizes = proportional(c, ranks, work)
            if sizes is None:
                continue
            c = Candidate(engine.name, zero, stages, micro, c.grad_accum, comp, split=sizes)
        if stages > 1:
            parts = best_parts(c, ranks, net, work, calib)
            if parts is None:
                continue
            c = Candidate(engine.name, zero, stages, micro, c.grad_accum, comp, parts=parts)
        p = predict(c, ranks, net, work, calib)
        if best is None or (not p.fits, p.step_s) < (not best.fits, best.step_s):
            best = p
    return best


def rank_candidates(
    ranks: list[Rank], net: Network, work: Workload, calib: Calibration
) -> list[Prediction]:
    """Every family's best, those that fit first, then by predicted seconds per image."""
    found = [
        p
        for f in families(ranks, work)
        if (p := family_best(f, ranks, net, work, calib)) is not None
    ]
    return sorted(found, key=lambda p: (not p.fits, p.step_s / work.global_batch))
