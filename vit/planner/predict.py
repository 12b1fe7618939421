"""One candidate's predicted step, as its engine prices it (the engine's spec:
vit/engines/<engine>/), and its name in the planner's table. Pure."""

from vit.core.costs import Calibration, Candidate, Network, Prediction, Rank, Workload
from vit.engines.registry import SPECS, spec


def predict(
    c: Candidate, ranks: list[Rank], net: Network, work: Workload, calib: Calibration
) -> Prediction:
    return spec(c.engine).predict(c, ranks, net, work, calib)


def label(c: Candidate) -> str:
    """'zero2 mb 16 x1', 'async-pipeline 5 stages [0, 2, 3, 4, 5, 6] mb 4 x8 wire-bf16'."""
    what = spec(c.engine).label(c.zero_stage)
    if c.stages > 1:
        what += f" {c.stages} stages {list(c.parts) if c.parts else ''}".rstrip()
    what += f" mb {'/'.join(map(str, c.split)) if c.split else c.micro_batch} x{c.grad_accum}"
    return what + ("" if c.compression == "none" else f" {c.compression}")


def engine_key(c: Candidate) -> str:
    """The engine as a calibration names it: with its ZeRO stage where its DeepSpeed JSON sets it
    ('zero2')."""
    return spec(c.engine).key(c.zero_stage)


def calibration_key(c: Candidate) -> str:
    """The engine key with the compression, where there is one ('ddp bf16', 'zero1 comm-bf16')."""
    return spec(c.engine).calibration_key(c)


def calibration_keys() -> list[str]:
    """Every key Calibration.engine_micro_s may hold: each engine's (at each ZeRO stage its key
    tells apart), alone or with a compression it has."""
    return [
        e.calibration_key(Candidate(e.name, z, 1, 1, 1, comp))
        for e in SPECS.values()
        for z in e.keyed_zero_stages()
        for comp in e.compressions("fp32")
    ]
