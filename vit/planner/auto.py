"""--engine auto: once the process group runs, measure what the cost model needs (each rank's layer
times at the run's micro-batch, every rank at once and then one at a time, and its free memory; the
link from the first host to each other host), rank every candidate (vit.planner.search), take the
fastest that fits every rank and that runs as a command line would ask for it, and plan the run
again with it. Rank 0 prints the table and the choice; config.json keeps both (engine_auto). The
fixed costs come from a calibration file where there is one, else the defaults (docs/planner.md)."""

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vit.core.batch import Batch
from vit.core.costs import Candidate, Workload
from vit.core.errors import ConfigError, NothingToDo
from vit.engines.registry import spec
from vit.engines.step_cost import SHARED
from vit.planner.census import capabilities, gather
from vit.planner.cli import NO_FILE, PLAN_ONLY, row, run_calibration, table
from vit.planner.inputs import describe_layers, ranks_from_census
from vit.planner.links import measure_links, network
from vit.planner.predict import engine_key
from vit.planner.profile import Timing, time_layers
from vit.planner.search import rank_candidates
from vit.planner.survey import in_turns
from vit.runtime.dist_env import Job, rank0_decides
from vit.telemetry.metrics import write_json

TOP = 10  # rows printed
# of every layer's forward and backward, the median kept: ranks timed at once are noisier than alone
# the same rounds alone, one rank at a time: with 5 alone, background load read as sharing
ROUNDS = 30
# the contention is measured again until it moves less than this from the pair before, PAIRS at most
STABLE, PAIRS = 0.1, 3
TIE = 0.02  # predictions this close are a tie (the model's error is larger)
# a family (family()) to run instead of the choice: the model's validation, bench planner
PICK = "VIT_ENGINE_AUTO_PICK"


@dataclass(frozen=True, kw_only=True)
class Request:
    """What the run asks of --engine auto beyond the measurements: its batch (the global batch
    every candidate keeps, the micro-batch the layers are timed at), each engine's planner input
    (vit.core.costs.Workload.inputs), what --auto-allow lets it choose though it changes what is
    learned (not_chosen), and `cannot_take`: why a candidate cannot load the checkpoint a resume on
    a changed cluster goes on from."""

    batch: Batch
    inputs: dict = dataclasses.field(default_factory=dict)  # vit.core.costs.Workload.inputs
    allowed: frozenset = frozenset()
    cannot_take: Callable[[Candidate], str | None] | None = None


def choose(
    job: Job,
    dev: torch.device,
    layers: list,
    sample: torch.Tensor,
    precision: str,
    engine: str,
    request: Request,
    slowdown: float = 1.0,
) -> dict:
    """Collective: measure `layers` (the model as the run builds it) on every rank at the request's
    micro-batch in `precision`, rank every candidate (rank 0 decides for all) and return the record
    of the choice (its table, its measurements), which vit.run.plan.with_auto_choice turns into
    the run's plan. `engine`: the one the run is planned as until it chooses."""
    start = time.perf_counter()
    micro = request.batch.micro_batch
    report = {
        **capabilities(dev, job.local_world_size, spec(engine)),
        "layer_ms_micro_batch": micro,
    }
    reports = measure_contention(
        job,
        report,
        lambda: time_layers(
            layers, sample, micro, precision, dev, slowdown, Timing(ROUNDS, statistics.median)
        ),
    )
    links = measure_links([r["host"] for r in reports], job.rank, dev)
    record = rank0_decides(
        lambda: decide(layers, sample, precision, reports, links, start, job.world_size, request)
    )
    text = record.pop("text")
    if job.is_main:
        print(text, flush=True)
    if only := os.environ.get(PLAN_ONLY):
        if job.is_main and only != NO_FILE:
            write_json(only, record)
        where = "" if only == NO_FILE else f"; the table and the choice are in {only}"
        raise NothingToDo(f"engine auto: planned only, nothing trained{where}")
    return record


def decide(
    layers: list,
    sample: torch.Tensor,
    precision: str,
    reports: list[dict],
    links: dict[str, tuple[float, float]],
    start: float,
    world_size: int,
    request: Request,
) -> dict:
    """Rank 0: every candidate ranked, the first that fits and runs chosen; ConfigError when none
    does."""
    described, flops = describe_layers(layers, sample, precision)
    ranks, _ = ranks_from_census(reports, flops, request.batch.micro_batch)
    net = network(reports, links)
    work = Workload(tuple(described), request.batch.global_size, precision, request.inputs)
    (calib, calib_from), rows = run_calibration(), []
    for p in rank_candidates(ranks, net, work, calib):
        cannot = cannot_run(p.candidate, world_size, precision) or (
            request.cannot_take(p.candidate) if request.cannot_take else None
        )
        rows.append(
            {
                **row(p, work.global_batch),
                "engine_key": engine_key(p.candidate),
                "runs": cannot is None,
                "not_chosen": "does not fit every rank"
                if not p.fits
                else cannot or not_chosen(p.candidate, request.allowed),
            }
        )
    runs = [r for r in rows if r["not_chosen"] is None]
    if not runs:
        raise ConfigError(
            f"--engine auto: none of the {len(rows)} candidates fits every rank's memory and runs "
            f"({rows[0]['candidate']}: {rows[0]['not_chosen']}); name an engine"
        )
    chosen = pick(runs) if not os.environ.get(PICK) else forced(rows, os.environ[PICK])
    why = (
        f"{PICK} asked for #{rows.index(chosen) + 1}"
        if os.environ.get(PICK)
        else f"within {TIE:.0%} of #{rows.index(chosen) + 1}, which is plainer"
    )
    for r in rows[: rows.index(chosen)]:
        r["not_chosen"] = r["not_chosen"] or why
    mbit = {h: 8 * b / 1e6 for h, b in net.host_bytes_s.items()}
    hosts = len({r["host"] for r in reports})
    said = [
        f"engine auto: {len(reports)} ranks on {hosts} host{'s' if hosts > 1 else ''}, "
        f"{precision}, global batch {work.global_batch}; links "
        + (", ".join(f"{h} {v:.1f} Mbit/s" for h, v in mbit.items()) or "none (one host)")
        + f", latency {1e3 * net.latency_s:.2f} ms; fixed costs from "
        f"{calib_from or 'the defaults (bench planner --save-calibration measures them)'}"
    ]
    if shared := [r["contention"] for r in reports if r["contention"] > SHARED]:
        said.append(
            f"  {len(shared)} of the ranks share processors: layer times with every rank at once "
            f"{min(shared):.1f}x to {max(shared):.1f}x their times alone (their pipelines' idle "
            "stages leave the processors to the others: docs/planner.md)"
        )
    said.append(table(rows, TOP))
    said += [
        f"  not #{i}: {r['not_chosen']}"
        for i, r in enumerate(rows[: min(rows.index(chosen), TOP)], 1)
    ]
    plan_s = time.perf_counter() - start
    said.append(
        f"engine auto chose #{rows.index(chosen) + 1}: {chosen['candidate']} (predicted "
        f"{chosen['step_ms']:.1f} ms a step, {chosen['images_per_s']:.0f} images/s; "
        f"planned in {plan_s:.1f} s)"
    )
    return {
        "choice": chosen,
        "candidates": rows,
        "links_mbit": mbit,
        "latency_ms": 1e3 * net.latency_s,
        "precision": precision,
        "layer_flops": flops,
        "calibration": dataclasses.asdict(calib),
        "contention": [r["contention"] for r in reports],
        "calibration_from": calib_from,
        "planning_s": plan_s,
        "allowed": sorted(request.allowed),
        "text": "\n".join(said),
    }


def measure_contention(job: Job, report: dict, time_all: Callable[[], list]) -> list[dict]:
    """Collective: every rank's report with its layer times (time_all()) measured with every rank at
    once, as training runs, and its machine's contention: those times over the same rounds with one
    rank at a time, where a machine holds several (a rank alone on its machine cannot share).
    Repeated until every machine's contention moves less than STABLE from the pair before (at most
    PAIRS pairs): background load in one pair was read as sharing (one rank alone: 2.1x)."""
    machines = [r["machine"] for r in gather({"machine": report["machine"]})]
    sharing = machines.count(report["machine"]) > 1
    before = None
    for _ in range(PAIRS):
        dist.barrier()
        report["layer_ms"] = time_all()
        alone = {"layer_ms": report["layer_ms"]}

        def time_alone(first: bool) -> None:
            if sharing:
                alone["layer_ms"] = time_all()

        dist.barrier()  # no rank's turn alone while another still times at once
        in_turns(job, 1, time_alone)
        report["contention"] = max(
            1.0, sum(map(sum, report["layer_ms"])) / sum(map(sum, alone["layer_ms"]))
        )
        reports = machine_contention(gather(report))
        now = [r["contention"] for r in reports]
        if len(set(machines)) == len(machines) or (
            before and all(abs(a - b) <= STABLE * b for a, b in zip(now, before))
        ):
            break
        before = now
    return reports


def machine_contention(reports: list[dict]) -> list[dict]:
    """Every rank of a machine with its machine's median contention: ranks alike on one machine
    share it alike, and one rank's burst of background load is not read as its own (two identical
    ranks got a 43/21 batch split from 1.0 and 2.1)."""
    by_machine = {}
    for r in reports:
        by_machine.setdefault(r["machine"], []).append(r["contention"])
    return [{**r, "contention": statistics.median(by_machine[r["machine"]])} for r in reports]


def pick(runs: list[dict]) -> dict:
    """Of the candidates that run, in the model's order: within TIE of the fastest the model cannot
    tell them apart, so the plainest wins (no compression, equal micro-batches, fewer stages), then
    the model's order."""
    near = [r for r in runs if r["step_ms"] <= (1 + TIE) * runs[0]["step_ms"]]
    return min(
        near, key=lambda r: (r["compression"] != "none", r["split"] is not None, r["stages"])
    )


def family(r: dict) -> str:
    """A candidate's family, as stable between runs as the measurements are: all but its
    micro-batch, batch split and stage boundaries (each run's model chooses those again)."""
    return f"{r['engine']}:zero{r['zero_stage']}:stages{r['stages']}:{r['compression']}"


def forced(rows: list[dict], wanted: str) -> dict:
    """The best of family `wanted` that fits and has a DeepSpeed JSON ($VIT_ENGINE_AUTO_PICK)."""
    for r in rows:
        if family(r) == wanted and r["fits"] and r["runs"]:
            return r
    raise ConfigError(
        f"{PICK}={wanted}: no candidate of that family fits and runs; families: "
        f"{', '.join(sorted({family(r) for r in rows}))}"
    )


def not_chosen(c: Candidate, allowed: frozenset = frozenset()) -> str | None:
    """Why a candidate that fits and runs is not chosen however fast (None: it may be): one that
    changes what is learned (EngineSpec.changes_learning) is the user's to choose, unless its
    engine or compression is `allowed` (--auto-allow diloco, powersgd)."""
    if c.engine in allowed or c.compression in allowed:
        return None
    return spec(c.engine).changes_learning(c)


def cannot_run(c: Candidate, world_size: int, precision: str) -> str | None:
    """Why a candidate cannot run as a command line would ask for it (None: it can)."""
    engine = spec(c.engine)
    if precision not in engine.precisions:
        return f"--engine {c.engine} does not train in {precision}"
    if engine.config_for(c.zero_stage, c.stages, world_size) is None:
        return f"no DeepSpeed JSON of --engine {c.engine} at ZeRO-{c.zero_stage}"
    return None
