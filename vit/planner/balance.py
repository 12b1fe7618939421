"""--partition balanced by the planner's cost model: the pipeline's stage boundaries whose predicted
step (each stage's compute and the engine's cost per micro-batch over 1F1B's slots, or its link's
transfers: vit.planner.predict) is the fastest that fits every stage's memory (search.best_parts),
from each layer's time measured on every rank, the links measured from the first host and the
calibration's fixed costs. Uniform stays unless the model predicts the balanced split at least GAIN
faster (less is within its error) or uniform does not fit."""

import dataclasses
import itertools

from vit.core.costs import Candidate, Workload
from vit.core.errors import ConfigError
from vit.engines.registry import spec
from vit.planner.cli import run_calibration
from vit.planner.inputs import from_profile, ranks_from_census
from vit.planner.links import network
from vit.planner.predict import predict
from vit.planner.search import best_parts

GAIN = 0.05


def candidate(
    engine: str,
    partition: str,
    stages: int,
    micro_batch: int,
    grad_accum: int,
    zero_stage: int,
    compression: str,
) -> Candidate | None:
    """The run's pipeline as the cost model names it, when it asks for balanced stages."""
    if not spec(engine).pipeline or partition != "balanced":
        return None
    return Candidate(engine, zero_stage, stages, micro_batch, grad_accum, compression)


def plan_partition(
    c: Candidate,
    profile: list[dict],
    layers: list,
    reports: list[dict],
    links: dict[str, tuple[float, float]],
    precision: str,
) -> tuple[list[int], dict, str]:
    """(stage boundaries, cluster.json's record, the plan as rank 0 prints it) from the census
    (`reports`, with each rank's layer_ms), vit.planner.profile's `profile` of `layers` and the
    links (links.measure_links)."""
    from deepspeed.runtime import utils as ds_utils

    described, flops = from_profile(profile, layers)
    ranks, _ = ranks_from_census(reports, flops, c.micro_batch)
    net, (calib, source) = network(reports, links), run_calibration()
    work = Workload(
        tuple(described), c.micro_batch * c.grad_accum * len(ranks) // c.stages, precision
    )
    splits = {
        "balanced": best_parts(c, ranks, net, work, calib),
        "uniform": ds_utils.partition_uniform(len(layers), c.stages),
        "parameters": ds_utils.partition_balanced([p["params"] for p in profile], c.stages),
    }
    splits = {k: [int(i) for i in v] for k, v in splits.items()}
    pred = {
        k: predict(dataclasses.replace(c, parts=tuple(v)), ranks, net, work, calib)
        for k, v in splits.items()
    }
    if not pred["balanced"].fits:
        smallest = min(pred["balanced"].capacity_bytes) / 2**30
        raise ConfigError(
            f"--partition balanced: no split of the {len(layers)} layers into {c.stages} stages "
            f"fits in the ranks' free memory (smallest usable {smallest:.2f} GiB); "
            "use more stages or a smaller micro-batch"
        )
    gain = pred["uniform"].step_s / pred["balanced"].step_s - 1
    chosen = "balanced" if gain >= GAIN or not pred["uniform"].fits else "uniform"
    why = (
        f"predicted {gain:.1%} faster than uniform"
        if chosen == "balanced"
        else f"balanced predicted only {gain:.1%} faster than uniform, within the "
        f"model's error (under {GAIN:.0%})"
    )
    parts = splits[chosen]
    stage_s = [
        spec(c.engine).stage_time_s(c, ranks, net, work, calib, s, parts[s], parts[s + 1])
        for s in range(c.stages)
    ]
    record = {
        "parts": parts,
        "by": "cost model",
        "chosen": chosen,
        "why": why,
        "compare": splits,
        "predicted_step_s": {k: p.step_s for k, p in pred.items()},
        "stage_compute_s": [t for t, _ in stage_s],
        "stage_link_s": [t for _, t in stage_s],
        "predicted_bytes": list(pred[chosen].mem_bytes),
        "calibration_from": source,
        "links_mbit": {h: 8 * b / 1e6 for h, b in net.host_bytes_s.items()},
    }
    dp = len(reports) // c.stages
    lines = [
        "pipeline plan (--partition balanced): the planner's cost model from each layer's forward "
        "and backward time measured on each rank, the links and fixed costs from "
        f"{source or 'the defaults (python -m bench planner --save-calibration measures them)'}"
    ]
    for s in range(c.stages):
        i, j = parts[s], parts[s + 1]
        names = ", ".join(
            f"{n} x{len(list(g))}" for n, g in itertools.groupby(p["name"] for p in profile[i:j])
        )
        hosts = ", ".join(f"rank {r} ({reports[r]['host']})" for r in range(s * dp, (s + 1) * dp))
        lines.append(
            f"  stage {s} on {hosts}: layers {i}-{j - 1} ({names}); per micro-batch "
            f"{1e3 * stage_s[s][0]:.2f} ms compute, {1e3 * stage_s[s][1]:.2f} ms link; "
            f"{pred[chosen].mem_bytes[s * dp] / 2**30:.3f} GiB"
        )
    lines.append(
        "  predicted step: "
        + ", ".join(f"{k} {v} {1e3 * pred[k].step_s:.1f} ms" for k, v in splits.items())
        + f"; {chosen}: {why}"
    )
    return parts, record, "\n".join(lines)
