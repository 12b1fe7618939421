"""What a rank's measured speed decides, with no torch: when speeds count as one, and DiLoCo's
inner steps in proportion to them (the census's, then each window's)."""

# Ranks whose speeds are this close are one speed (proportional): 5 identical ranks sharing 2 cores,
# timed at once (--engine auto), differed by up to 28%.
SAME_SPEED = 0.3


def local_steps(sync_every: int, times: list[float], mode: str) -> list[int] | None:
    """--local-steps: each rank's inner steps between syncs, H x its speed / the fastest's (at
    least 1), from its time per unit of work (the census's block time, or a window's time per
    step); None for equal steps (mode equal, or auto with speeds within SAME_SPEED of each
    other)."""
    fastest, slowest = min(times), max(times)
    if mode == "equal" or (mode == "auto" and slowest < (1 + SAME_SPEED) * fastest):
        return None
    return [max(1, round(sync_every * fastest / t)) for t in times]
