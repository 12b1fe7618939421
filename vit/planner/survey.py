"""Before the engine is built, adapt() takes a census of every rank (device, memory, what it can run,
how fast it is), settles the precision, and where asked plans balanced pipeline stages (vit.planner.balance),
proportional batches and the fp16 loss scale. Rank 0 prints each decision; `record` goes to cluster.json.
time_each_rank: the layer times a re-plan at a freeze point measures when it first needs them.

census: the measuring, collective part; profile: per-layer costs and times; stages (re-planning at a freeze point),
batch_split: the planners (pure, tested against brute force); loss_scale: the fp16 probe.
"""
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from vit.planner.batch_split import split_batches
from vit.planner.census import WARMUP_S, capabilities, census_table, gather, measure_speed
from vit.planner.memory import plan_bytes
from vit.planner.loss_scale import tune
from vit.planner.profile import LAYER_TURNS, profile_layers, time_layers
from vit.core.costs import Candidate
from vit.core.spec import EngineSpec
from vit.planner.balance import plan_partition
from vit.planner.links import measure_links
from vit.runtime.dist_env import Job, rank0_decides
from vit.runtime.gpu import fork_rng
from vit.runtime.precision import choose


@dataclass(frozen=True)
class Adapted:
    """What the census decided for this run."""
    precision: str
    scale_power: int | None = None  # fp16 initial_scale_power chosen by --loss-scale auto
    loss_weight: float = 1.0  # this rank's share of a micro-step's samples x data-parallel size
    split: list[int] | None = None  # every data-parallel rank's micro-batch (--batch-split proportional)
    parts: list[int] | None = None  # pipeline stage boundaries (--partition balanced)
    record: dict = field(default_factory=dict)  # cluster.json


def adapt(job: Job, device: torch.device, layers: list[nn.Module], *, requested_precision: str | None,
          engine: EngineSpec,
          micro_batch: int, grad_accum: int, sample: torch.Tensor, balanced: "Candidate | None", proportional: bool,
          probe_batches: Callable[[], Iterable] | None, slowdown: float, split: list[int] | None = None,
          state_bytes: Callable[[str], float], reserved_bytes: float = 0.0, probe_on_cpu: bool = False,
          profile_only: bool = False, parts: list[int] | None = None) -> Adapted:
    """Collective. `requested_precision`: --precision's, or the JSON's, or None (vit.runtime.precision.choose);
    `sample`: one input image batch of 1; `balanced`: the pipeline whose stages to balance (vit.planner.balance);
    `probe_batches`: this rank's batches for the fp16 loss-scale probe (--loss-scale auto); `split`: proportional
    micro-batches chosen before (--engine or --micro-batch-size auto); `state_bytes`: precision -> bytes/parameter;
    `reserved_bytes`: a GPU's headroom for NCCL, ZeRO's buckets and cuBLAS, which memory plans keep free;
    `probe_on_cpu`: run the loss-scale probe on the CPU (engines whose GPUs hold only part of the model);
    `profile_only`: profile the layers (record["layers"]) for a re-plan at a freeze point, which times them when it
    first needs the times (time_each_rank); `parts`: --engine auto's stages."""
    reserved_gib = reserved_bytes / 2**30 if device.type == "cuda" else 0.0
    caps = gather({**capabilities(device, job.local_world_size, engine), "mem_reserved_gib": reserved_gib})
    precision, why = choose(requested_precision, engine, caps)
    with torch.no_grad(), fork_rng(device):
        block_input = (micro_batch, *layers[0](sample).shape[1:])
    speed = {}

    def measure(first: bool) -> None:
        if first:
            speed.update(measure_speed(device, precision, copy.deepcopy(layers[1]), block_input, slowdown))
        if balanced:  # warmed up on a rank's first turn only: a later turn's times are kept where faster
            now = time_layers(layers, sample, micro_batch, precision, device, slowdown, warmup_s=WARMUP_S * first)
            speed["layer_ms"] = [[min(a, b) for a, b in zip(old, new)] for old, new in
                                 zip(speed.get("layer_ms", now), now)]
            speed["layer_ms_micro_batch"] = micro_batch
    in_turns(job, LAYER_TURNS if balanced else 1, measure)
    reports = gather({**caps[job.rank], **speed, "slowdown": slowdown})
    per_param = state_bytes(precision)
    record = {"census": reports, "precision": precision, "precision_why": why, "state_bytes_per_param": per_param}
    say, decided = [census_table(reports, precision), f"precision {precision}: {why}"], {}
    if balanced or proportional or profile_only:
        record["layers"] = profile = profile_layers(layers, sample, precision)
    if parts:
        decided["parts"], record["stages"] = parts, {"parts": parts, "by": "--engine auto"}
    if balanced:
        links = measure_links([r["host"] for r in reports], job.rank, device)
        decided["parts"], record["stages"], text = rank0_decides(
            lambda: plan_partition(balanced, profile, layers, reports, links, precision))
        say.append(text)
    if proportional:
        how = "chosen by --engine or --micro-batch-size auto" if split else "proportional to block speed"
        split = split or split_batches(profile, reports, micro_batch, per_param)
        decided.update(split=split, loss_weight=split[job.rank] * len(split) / sum(split))
        record["batch_split"] = split
        say.append(f"batch split ({how}): micro-batches {split} (sum {sum(split)} = {micro_batch} x {len(split)} "
                   "ranks)")
    if probe_batches is not None and precision == "fp16":
        decided["scale_power"], record["loss_scale"], line = tune(
            layers, probe_batches(), device, grad_accum, sample, plan_bytes(reports[job.rank]),
            max(split or [micro_batch]), probe_on_cpu)
        say.append(line)
    elif probe_batches is not None:
        say.append(f"--loss-scale auto: nothing to tune in {precision}")
    if job.is_main:
        print("\n".join(say), flush=True)
    return Adapted(precision, record=record, **decided)


def in_turns(job: Job, turns: int, measure: Callable[[bool], None]) -> None:
    """Collective: measure(first turn) on one rank at a time (ranks sharing a host's cores would slow each other),
    every rank `turns` times in turn."""
    for turn in range(job.world_size * turns):
        if turn % job.world_size == job.rank:
            measure(turn < job.world_size)
        dist.barrier()


def time_each_rank(job: Job, make_layers: Callable[[], list[nn.Module]], sample: torch.Tensor, micro_batch: int,
                   precision: str, device: torch.device, slowdown: float) -> list[list[list[float]]]:
    """Collective: every rank's layer times (time_layers, one turn a rank, on layers from make_layers(), which
    leaves torch's generator as it was) for a re-plan at a freeze point, measured when one first needs them: a run
    that never freezes, or halves its 2 stages to 1, times nothing."""
    with fork_rng(device):
        layers = make_layers()
    mine = {}

    def measure(first: bool) -> None:
        mine["layer_ms"] = time_layers(layers, sample, micro_batch, precision, device, slowdown)
    in_turns(job, 1, measure)
    return [report["layer_ms"] for report in gather(mine)]
