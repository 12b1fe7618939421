"""--engine diloco's options (vit.core.settings.option fields): local steps, the outer optimizer,
the wire, streaming's fragments, the workers. Its spec declares the group as `local`."""

from dataclasses import dataclass

from vit.core.settings import option, positive_int

DEFAULT_SYNC_EVERY = 10  # --sync-every: with 5 fragments and int8, as fast as 50 (benchmarks.md)
MAX_AUTO_FRAGMENTS = 5  # --fragments auto: the most fragments, each H / F steps after the last
WEIGHTINGS = ("steps", "uniform", "fednova")  # --outer-weighting


def parse_worker_ranks(text: str) -> str:
    """argparse type of --worker-ranks: auto, host or a whole number above zero."""
    if text in ("auto", "host"):
        return text
    return str(positive_int(text))


@dataclass(frozen=True)
class LocalStepSettings:
    """--engine diloco: local steps with an outer optimizer (DiLoCo, Douillard et al. 2023)."""

    sync_every: int = option(
        DEFAULT_SYNC_EVERY,
        "inner steps between syncs (DiLoCo's H): each worker trains alone for H steps with the "
        "command line's optimizer, then the workers average their pseudo-gradients",
        "positive",
        needs="diloco",
    )
    local_start_step: int = option(
        0,
        "steps trained as DDP (gradients averaged every step) before the local steps begin "
        "(post-local SGD's warm-up, torch's start_localSGD_iter; the syncs count from there)",
        "non_negative",
        needs="diloco",
    )
    # 1.0 and 0 (the workers' mean, as local SGD takes it), not the paper's 0.7 and Nesterov 0.9:
    # measured on the default job (docs/benchmarks.md), the paper's lost 8 points at H = 50
    outer_lr: float = option(
        1.0,
        "learning rate of the outer optimizer (SGD on the averaged pseudo-gradient, the global "
        "weights minus a worker's; 1 with no momentum: the workers' mean)",
        "positive",
        needs="diloco",
    )
    outer_momentum: float = option(
        0.0,
        "Nesterov momentum of the outer optimizer (0: plain SGD; the paper's 0.9 with --outer-lr "
        "0.7 suits runs of many syncs)",
        "below_one",
        needs="diloco",
    )
    outer_wire: str = option(
        "int8",
        "dtype of the pseudo-gradients on the wire: int8 (a quarter of fp32's bytes, with a "
        "scale per block of 256 values; it cost no measurable accuracy), bf16 (half) or fp32",
        choices=("fp32", "bf16", "int8"),
        needs="diloco",
    )
    # equal, not auto: with a rank slowed 2x on glyphs, proportional steps at the default fragments
    # gave 1.08x equal's images/s and lost 4 points (docs/benchmarks.md, 1 December 2026)
    local_steps: str = option(
        "equal",
        "inner steps of each worker between syncs: equal (H each: a slower GPU holds the others "
        "up, as under DDP), proportional (H x its speed / the fastest's, from the census, then "
        "from each window's measured times: a slower GPU takes fewer and waits less, and the "
        "batches it skips are not trained on; --outer-weighting says how the mean weighs it) "
        "or auto (proportional when the speeds differ by more than the noise)",
        choices=("auto", "proportional", "equal"),
        needs="diloco",
    )
    # steps (FedAvg's): with rank 1 slowed 2x on glyphs, uniform was within its error of it and
    # fednova 1.7 points lower (docs/benchmarks.md, 2 December 2026)
    outer_weighting: str = option(
        "steps",
        "how the workers' mean weighs a worker that trained fewer inner steps (--local-steps "
        "proportional): steps (by the steps it trained, FedAvg's), uniform (every worker alike) or "
        "fednova (each pseudo-gradient divided by its steps, the mean scaled by the workers' mean "
        "steps, FedNova's)",
        choices=WEIGHTINGS,
        needs="diloco",
    )
    fragments: int | str = option(
        "auto",
        "sync the model in F fragments (Streaming DiLoCo): fragment f's pseudo-gradient goes on "
        "the wire at its own step of each window and is applied H / F steps later, while the "
        "workers train on, so no step waits for the link; F divides H. auto: the largest F up "
        f"to {MAX_AUTO_FRAGMENTS} that divides H ({MAX_AUTO_FRAGMENTS} at the default H)",
        needs="diloco",
        type=lambda v: v if v == "auto" else positive_int(v),
        metavar="F|auto",
    )
    worker_ranks: str = option(
        "auto",
        "ranks per worker, which train as DDP among themselves: N, host (the ranks of a host), "
        "or auto (host on GPUs, one rank each on CPUs)",
        needs="diloco",
        type=parse_worker_ranks,
        metavar="N|host|auto",
    )

    @property
    def fragment_count(self) -> int:
        return fragment_count(self.sync_every, self.fragments)


def fragment_count(sync_every: int, fragments: int | str) -> int:
    """--fragments as a number: auto is the largest up to MAX_AUTO_FRAGMENTS that divides H."""
    if fragments != "auto":
        return fragments
    return max(f for f in range(1, MAX_AUTO_FRAGMENTS + 1) if sync_every % f == 0)
