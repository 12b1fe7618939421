"""Data-parallel micro-batches in proportion to each rank's measured speed, within its free
memory; DiLoCo's inner steps in proportion to it."""

import math

from vit.core.errors import ConfigError
from vit.planner.memory import plan_bytes
from vit.runtime.precision import who


def proportional_split(total: int, speed: list[float], cap: list[int]) -> list[int]:
    """`total` samples over the ranks in proportion to speed, each at least 1 and at most its cap.

    Ranks that hit their cap keep it and the rest is shared by the others in proportion; integers by
    the largest remainders."""
    n = len(speed)
    if sum(cap) < total or min(cap) < 1:
        raise ValueError(f"cannot place {total} samples within the per-rank limits {cap}")
    capped: dict[int, int] = {}
    while True:
        free = [r for r in range(n) if r not in capped]
        left = total - sum(capped.values())
        share = {r: left * speed[r] / sum(speed[q] for q in free) for r in free}
        over = [r for r in free if share[r] > cap[r]]
        if not over:
            break
        capped.update({r: cap[r] for r in over})
    sizes = {**capped, **{r: max(1, math.floor(share[r])) for r in free}}
    by_remainder = sorted(free, key=lambda r: share[r] - math.floor(share[r]), reverse=True)
    while sum(sizes.values()) != total:
        step = 1 if sum(sizes.values()) < total else -1
        for r in by_remainder if step > 0 else reversed(by_remainder):
            if sum(sizes.values()) != total and 1 <= sizes[r] + step <= cap[r]:
                sizes[r] += step
    return [sizes[r] for r in range(n)]


def split_batches(
    profile: list[dict], reports: list[dict], micro_batch: int, bytes_per_param: float
) -> list[int]:
    """Per-rank micro-batch for --batch-split proportional: the data-parallel total micro x ranks
    shared in proportion to the measured block speed, within each rank's free memory less
    bytes_per_param per parameter (vit.planner.memory.bytes_per_param)."""
    static = sum(p["params"] for p in profile) * bytes_per_param
    per_sample = sum(p["act_bytes"] for p in profile)  # profiled in the run's precision
    caps = [int((plan_bytes(r) - static) // per_sample) for r in reports]
    total = micro_batch * len(reports)
    if sum(caps) < total or min(caps) < 1:
        worst = min(range(len(reports)), key=lambda r: caps[r])
        raise ConfigError(
            f"--batch-split proportional: the ranks' free memory holds {max(0, sum(caps))} samples "
            f"at once, fewer than the {total} of a micro-step ({who(worst, reports[worst])} fits "
            f"{max(0, caps[worst])}); lower --micro-batch-size"
        )
    return proportional_split(total, [1 / r["block_ms"] for r in reports], caps)
