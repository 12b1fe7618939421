"""Pipeline stages balanced by measured speed and free memory: the contiguous split of the layers with the
fastest slowest stage that fits, by exact dynamic programming (tested against brute force)."""
import itertools
from dataclasses import dataclass

from vit.errors import ConfigError
from vit.hetero.profile import BYTES_PER_PARAM, plan_bytes


@dataclass
class StagePlan:
    parts: list[int]  # stage s holds layers parts[s]:parts[s+1] (PipelineModule's convention)
    times: list[float]  # predicted seconds per micro-batch, forward and backward
    mems: list[float]  # predicted bytes
    speed: list[float] | None = None  # FLOP/s of each stage (set by plan_stages)


def stage_cost(s, i, j, cost, static, act, speed, inflight) -> tuple[float, float]:
    """(seconds, bytes) of layers i..j-1 on stage s."""
    return sum(cost[i:j]) / speed[s], sum(static[i:j]) + sum(act[i:j]) * inflight[s]


def balanced_split(cost: list[float], static: list[float], act: list[float], speed: list[float],
                   capacity: list[float], inflight: list[int]) -> StagePlan | None:
    """The contiguous split of layers into len(speed) non-empty stages that minimises the slowest stage's time
    (sum of its layers' cost / its speed) with every stage's memory (static + act x inflight) within its
    capacity; None when no split fits. Exact dynamic programming over the end of each stage."""
    n, stages = len(cost), len(speed)
    best = {(0, 0): (0.0, None)}  # (stages used, layers placed) -> (slowest time so far, previous cut)
    for s in range(stages):
        for j in range(s + 1, n - (stages - s - 1) + 1):
            options = []
            for i in range(s, j):
                if (s, i) not in best:
                    continue
                t, m = stage_cost(s, i, j, cost, static, act, speed, inflight)
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
    stats = [stage_cost(s, parts[s], parts[s + 1], cost, static, act, speed, inflight) for s in range(stages)]
    return StagePlan(parts, [t for t, _ in stats], [m for _, m in stats])


def pipeline_inflight(stages: int, grad_accum: int) -> list[int]:
    """Micro-batches whose activations stage s holds at once under DeepSpeed's 1F1B schedule."""
    return [max(1, min(stages - s, grad_accum)) for s in range(stages)]


def plan_stages(profile: list[dict], reports: list[dict], stages: int, micro_batch: int, grad_accum: int
                ) -> StagePlan:
    """Stage s runs on ranks s*dp .. s*dp+dp-1 (DeepSpeed's pipe-major rank order): its speed is their slowest,
    its capacity their smallest free memory. Costs are FLOPs; a rank's speed is one block's FLOPs over its
    measured block time."""
    dp = len(reports) // stages
    groups = [reports[s * dp:(s + 1) * dp] for s in range(stages)]
    block_flops = max(p["flops"] for p in profile)
    speed = [block_flops / max(r["block_ms"] / 1e3 for r in g) for g in groups]  # FLOP/s at this micro-batch
    cost = [p["flops"] for p in profile]
    static = [p["params"] * BYTES_PER_PARAM for p in profile]
    act = [p["act_bytes"] * micro_batch for p in profile]  # profiled in the run's precision
    capacity = [min(plan_bytes(r) for r in g) for g in groups]
    plan = balanced_split(cost, static, act, speed, capacity, pipeline_inflight(stages, grad_accum))
    if plan is None:
        need = (sum(static) + sum(act)) / stages / 2**30
        raise ConfigError(f"--partition balanced: no split of the {len(profile)} layers into {stages} stages fits "
                          f"in the ranks' free memory (at least {need:.2f} GiB per stage on average, smallest "
                          f"free {min(capacity) / 2**30:.2f} GiB usable); use more stages or a smaller micro-batch")
    plan.speed = speed
    return plan


def stage_plan_text(plan: StagePlan, profile: list[dict], reports: list[dict], compare: dict[str, list[int]]) -> str:
    stages = len(plan.times)
    dp = len(reports) // stages
    lines = ["pipeline plan (--partition balanced): layer costs are FLOPs, speeds and free memory from the census"]
    for s in range(stages):
        i, j = plan.parts[s], plan.parts[s + 1]
        names = ", ".join(f"{n} x{len(list(g))}" for n, g in itertools.groupby(p["name"] for p in profile[i:j]))
        hosts = ", ".join(f"rank {r} ({reports[r]['host']})" for r in range(s * dp, (s + 1) * dp))
        lines.append(f"  stage {s} on {hosts}: layers {i}-{j - 1} ({names}); predicted "
                     f"{1e3 * plan.times[s]:.2f} ms per micro-batch, {plan.mems[s] / 2**30:.3f} GiB")
    for name, parts in compare.items():
        slowest = max(sum(p["flops"] for p in profile[parts[s]:parts[s + 1]]) / plan.speed[s] for s in range(stages))
        lines.append(f"  slowest stage {1e3 * max(plan.times):.2f} ms; with --partition {name} (layers "
                     f"{parts}) it would be {1e3 * slowest:.2f} ms")
    return "\n".join(lines)
