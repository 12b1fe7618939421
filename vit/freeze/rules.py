"""The freeze rules (PipeTransformer's AutoFreeze and ours): how many layers of the list are frozen
after a decision point. The freezable layers are the embedding and the blocks (layer list indices 0
.. L-1); the head, last, never freezes. schedule: PipeTransformer's calendar; grad and settled: the
prefix grows while each next layer's measure (vit.freeze.measures) is below a threshold."""

import math


def scheduled(intervals: int, num_freezable: int, alpha: float) -> int:
    """PipeTransformer's released rule: frozen(e) = ceil(L (1 - (1 - alpha)^e)) after e
    intervals."""
    # The epsilon keeps float noise (5 x (1 - 2/3) = 1.6666...7) from rounding a whole number up.
    return min(num_freezable, math.ceil(num_freezable * (1 - (1 - alpha) ** intervals) - 1e-9))


# --freeze-threshold's default for each rule (and the schedule's warning)
THRESHOLDS = {"grad": 0.1, "settled": 0.65}


def by_measure(
    change: list[float], frozen: int, threshold: float, alpha: float, allowed: int
) -> int:
    """The convergence rules (grad, settled): the frozen prefix grows over the next layers while
    each one's measure is below `threshold` (a settled layer behind one still learning does not
    freeze), by at most alpha of the active layers (at least one) at a time, and to at most
    `allowed` (the schedule's count at this point) in all."""
    cap = min(len(change), allowed, frozen + max(1, math.floor(alpha * (len(change) - frozen))))
    count = frozen
    while count < cap and change[count] < threshold:
        count += 1
    return count


def next_measure(
    change: list[float] | None,
    frozen: int,
    threshold: float,
    num_freezable: int,
    rule: str = "grad",
) -> str:
    """What the decision line says of the next layer to freeze: its measure against the
    threshold."""
    if frozen >= num_freezable:
        return "all freezable layers frozen"
    if change is None:
        return f"next: layer {frozen}, " + (
            "no weight move over a whole interval yet (resumed)"
            if rule == "settled"
            else "no gradient change yet (the first interval has nothing to compare with)"
        )
    sign = "<" if change[frozen] < threshold else ">="
    what = (
        "weights moved {:.3g} of their fastest" if rule == "settled" else "gradient change {:.3g}"
    )
    return f"next: layer {frozen}, {what.format(change[frozen])} {sign} {threshold:g}"


def layer_range(frozen: int) -> str:
    return "nothing" if frozen == 0 else "layer 0" if frozen == 1 else f"layers 0-{frozen - 1}"
