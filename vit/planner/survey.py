"""Before the engine is built, survey() takes a census of every rank (device, memory, what it can
run, how fast it is), settles the precision, and where asked plans balanced pipeline stages
(vit.planner.balance), proportional batches and the fp16 loss scale. Rank 0 prints each decision;
`record` goes to cluster.json. time_each_rank: the layer times a re-plan at a freeze point measures
when it first needs them.

census: the measuring, collective part; profile: per-layer costs and times; stages (re-planning at a
freeze point), batch_split: the planners (pure, tested against brute force); loss_scale: the fp16
probe.
"""

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from vit.core.costs import Candidate
from vit.core.spec import EngineSpec
from vit.core.speeds import local_steps
from vit.planner.balance import plan_partition
from vit.planner.batch_split import split_batches
from vit.planner.census import capabilities, census_table, gather, measure_speed
from vit.planner.links import measure_links
from vit.planner.loss_scale import tune
from vit.planner.memory import plan_bytes
from vit.planner.profile import LAYER_TURNS, Timing, profile_layers, time_layers
from vit.runtime.dist_env import Job, rank0_decides
from vit.runtime.gpu import fork_rng
from vit.runtime.precision import choose


@dataclass(frozen=True, kw_only=True)
class Asked:
    """What a run asks the survey to settle (vit.trainer fills it in from the plan)."""

    # --precision's, or the JSON's; None: none given (runtime.precision)
    requested_precision: str | None
    engine: EngineSpec
    micro_batch: int
    grad_accum: int
    sample: torch.Tensor  # one input image, a batch of 1
    state_bytes: Callable[[str], float]  # precision -> bytes of state a parameter
    reserved_bytes: float = 0.0  # a GPU's headroom for NCCL, ZeRO's buckets and cuBLAS
    slowdown: float = 1.0  # --simulate-slowdown's factor for this rank
    balanced: Candidate | None = None  # the pipeline whose stages to balance (vit.planner.balance)
    parts: list[int] | None = None  # --engine auto's stages
    proportional: bool = False  # --batch-split proportional
    split: list[int] | None = (
        None  # micro-batches chosen before (--engine auto, --micro-batch-size auto, --resume)
    )
    probe_batches: Callable[[], Iterable] | None = (
        None  # this rank's batches for --loss-scale auto's probe
    )
    probe_on_cpu: bool = (
        False  # the probe on the CPU (engines whose GPUs hold only part of the model)
    )
    profile_only: bool = (
        False  # profile the layers for a re-plan at a freeze point (times: time_each_rank)
    )
    local_steps: str | None = None  # --local-steps (DiLoCo's engines), with --sync-every's H
    sync_every: int = 1


@dataclass(frozen=True)
class Survey:
    """What the census decided for this run."""

    precision: str
    scale_power: int | None = None  # fp16 initial_scale_power chosen by --loss-scale auto
    loss_weight: float = 1.0  # this rank's share of a micro-step's samples x data-parallel size
    split: list[int] | None = (
        None  # every data-parallel rank's micro-batch (--batch-split proportional)
    )
    parts: list[int] | None = None  # pipeline stage boundaries (--partition balanced)
    local_steps: list[int] | None = None  # every rank's inner steps in a window (--local-steps)
    record: dict = field(default_factory=dict)  # cluster.json


def survey(job: Job, device: torch.device, layers: list[nn.Module], asked: Asked) -> Survey:
    """Collective: every rank's report and the decisions taken from them, printed by rank 0."""
    reserved_gib = asked.reserved_bytes / 2**30 if device.type == "cuda" else 0.0
    caps = gather(
        {
            **capabilities(device, job.local_world_size, asked.engine),
            "mem_reserved_gib": reserved_gib,
        }
    )
    precision, why = choose(asked.requested_precision, asked.engine, caps)
    reports = gather(
        {
            **caps[job.rank],
            **measure(job, device, layers, asked, precision),
            "slowdown": asked.slowdown,
        }
    )
    per_param = asked.state_bytes(precision)
    record = {
        "census": reports,
        "precision": precision,
        "precision_why": why,
        "state_bytes_per_param": per_param,
    }
    say, decided = [census_table(reports, precision), f"precision {precision}: {why}"], {}
    if asked.balanced or asked.proportional or asked.profile_only:
        record["layers"] = profile_layers(layers, asked.sample, precision)
    if asked.parts:
        decided["parts"], record["stages"] = (
            asked.parts,
            {"parts": asked.parts, "by": "--engine auto"},
        )
    if asked.balanced:
        links = measure_links([r["host"] for r in reports], job.rank, device)
        decided["parts"], record["stages"], text = rank0_decides(
            lambda: plan_partition(
                asked.balanced, record["layers"], layers, reports, links, precision
            )
        )
        say.append(text)
    if asked.proportional:
        split = asked.split or split_batches(
            record["layers"], reports, asked.micro_batch, per_param
        )
        decided.update(split=split, loss_weight=split[job.rank] * len(split) / sum(split))
        record["batch_split"] = split
        how = (
            "chosen by --engine auto, --micro-batch-size auto or a resume keeping its global batch"
            if asked.split
            else "proportional to block speed"
        )
        say.append(f"batch split ({how}): micro-batches {split} (sum {sum(split)} a micro-step)")
    if asked.local_steps is not None:
        speeds = [r["block_ms"] for r in reports]
        steps = local_steps(asked.sync_every, speeds, asked.local_steps)
        record["local_steps"] = steps or [asked.sync_every] * len(reports)
        if steps:
            decided["local_steps"] = steps
            how = (
                f"inner steps in each window of {asked.sync_every}, by rank: {steps} (in "
                "proportion to block speed; a worker takes its slowest rank's; the average weighs "
                "each worker by the samples it trained on)"
            )
        else:
            how = f"{asked.sync_every} for every worker"
            if asked.local_steps == "auto":
                how += " (the block speeds differ by less than the noise)"
        say.append(f"local steps (--local-steps {asked.local_steps}): {how}")
    if asked.probe_batches is not None and precision == "fp16":
        decided["scale_power"], record["loss_scale"], line = tune(
            layers,
            asked.probe_batches(),
            device,
            asked.grad_accum,
            asked.sample,
            plan_bytes(reports[job.rank]),
            max(decided.get("split") or asked.split or [asked.micro_batch]),
            asked.probe_on_cpu,
        )
        say.append(line)
    elif asked.probe_batches is not None:
        say.append(f"--loss-scale auto: nothing to tune in {precision}")
    if job.is_main:
        print("\n".join(say), flush=True)
    return Survey(precision, record=record, **decided)


def measure(
    job: Job, device: torch.device, layers: list[nn.Module], asked: Asked, precision: str
) -> dict:
    """Collective: this rank's speed (one block's forward and backward, one rank at a time) and, for
    balanced stages, each layer's times (LAYER_TURNS turns a rank, each layer's fastest kept)."""
    with torch.no_grad(), fork_rng(device):
        block_input = (asked.micro_batch, *layers[0](asked.sample).shape[1:])
    speed = {}

    def measure_turn(first: bool) -> None:
        if first:
            speed.update(
                measure_speed(
                    device,
                    precision,
                    copy.deepcopy(layers[1]),
                    block_input,
                    asked.slowdown,
                    autocast=asked.engine.autocast,
                )
            )
        if (
            asked.balanced
        ):  # warmed up on a rank's first turn only: a later turn's times are kept where faster
            now = time_layers(
                layers,
                asked.sample,
                asked.micro_batch,
                precision,
                device,
                asked.slowdown,
                Timing(warmup_s=None if first else 0.0),
                autocast=asked.engine.autocast,
            )
            speed["layer_ms"] = [
                [min(a, b) for a, b in zip(old, new)]
                for old, new in zip(speed.get("layer_ms", now), now)
            ]
            speed["layer_ms_micro_batch"] = asked.micro_batch

    in_turns(job, LAYER_TURNS if asked.balanced else 1, measure_turn)
    return speed


def in_turns(job: Job, turns: int, measure: Callable[[bool], None]) -> None:
    """Collective: measure(first turn) on one rank at a time (ranks sharing a host's cores would
    slow each other), every rank `turns` times in turn."""
    for turn in range(job.world_size * turns):
        if turn % job.world_size == job.rank:
            measure(turn < job.world_size)
        dist.barrier()


def time_each_rank(
    job: Job,
    make_layers: Callable[[], list[nn.Module]],
    sample: torch.Tensor,
    micro_batch: int,
    precision: str,
    device: torch.device,
    slowdown: float,
) -> list[list[list[float]]]:
    """Collective: every rank's layer times (time_layers, one turn a rank, on layers from
    make_layers(), which leaves torch's generator as it was) for a re-plan at a freeze point,
    measured when one first needs them: a run that never freezes, or halves its 2 stages to 1, times
    nothing."""
    with fork_rng(device):
        layers = make_layers()
    mine = {}

    def measure(first: bool) -> None:
        mine["layer_ms"] = time_layers(layers, sample, micro_batch, precision, device, slowdown)

    in_turns(job, 1, measure)
    return [report["layer_ms"] for report in gather(mine)]
