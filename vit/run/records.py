"""A run's own files besides the metrics: config.json and cluster.json at the start (with rank 0's
header line), summary.json at the end."""

import os
import time
from dataclasses import dataclass

from vit.engines.registry import spec
from vit.telemetry.metrics import write_json
from vit.telemetry.monitor import gpu_util_mean_per_host


def start_record(
    log_dir: str,
    plan,
    *,
    ds_config: dict,
    precision: str,
    cluster: dict,
    start_step: int,
    resumed_from: str | None,
) -> None:
    """Rank 0: config.json (the resolved settings and DeepSpeed JSON), cluster.json (the census and
    its decisions), and one line saying what trains on what."""
    s, job, batch, data = plan.settings, plan.job, plan.batch, plan.data
    os.makedirs(log_dir, exist_ok=True)
    write_json(os.path.join(log_dir, "cluster.json"), cluster)
    write_json(
        os.path.join(log_dir, "config.json"),
        {
            "args": s.flat(),
            "deepspeed": ds_config,
            "precision": precision,
            "world_size": job.world_size,
            "launcher": job.launcher,
            "master": f"{job.master_addr}:{job.master_port}",
            "global_batch": batch.global_size,
            "data_parallel_size": batch.dp_size,
            "total_steps": plan.total_steps,
            **({"micro_batch_auto": plan.micro_search} if plan.micro_search else {}),
            **({"engine_auto": plan.auto} if plan.auto else {}),
            **plan.engine.resolved_options(plan.settings, precision),
        },
    )
    resumed = f" (resumed from {resumed_from})" if resumed_from else ""
    print(
        f"{s.parallel.engine}: {s.model.model} on {s.data.dataset} ({len(data.train)} train / "
        f"{len(data.test)} held-out), {job.world_size} ranks, {precision}; {batch.arithmetic()}; "
        f"{plan.steps_per_epoch} steps/epoch; steps {start_step + 1}..{plan.total_steps}{resumed}",
        flush=True,
    )


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What a run measured by its end, for summary.json."""

    totals: dict  # the loop's (vit.training.stats.StepStats.totals)
    evaluation: dict  # the final evaluation's
    peak_mem_gib: float  # the largest over the ranks
    monitors: list[dict]  # every rank's monitor summary


def write_summary(
    log_dir: str,
    plan,
    *,
    precision: str,
    ds_config: dict,
    start_step: int,
    start_time: float,
    measured: Measured,
) -> dict:
    """Rank 0: summary.json, what plot_logs.py's tables read."""
    totals, evaluation, monitors = measured.totals, measured.evaluation, measured.monitors
    s, batch, total = plan.settings, plan.batch, plan.total_steps
    engine = s.parallel.engine
    summary = {
        "engine": engine,
        "model": s.model.model,
        "dataset": s.data.dataset,
        "precision": precision,
        # as the checkpoints' layout (vit.run.plan)
        "zero_stage": spec(engine).zero_stage_of(ds_config),
        "pipeline_stages": s.parallel.pipeline_stages if spec(engine).pipeline else None,
        "world_size": plan.job.world_size,
        "data_parallel_size": batch.dp_size,
        "micro_batch": batch.micro_batch,
        "grad_accum": batch.grad_accum,
        "global_batch": batch.global_size,
        "steps": total,
        "steps_this_run": total - start_step,
        "final_loss": totals["final_loss"],
        **evaluation,
        "images_per_s": totals["images_per_s"],
        "train_s": totals["train_s"],
        "train_s_this_run": totals["train_s_this_run"],
        "segments": totals["segments"],
        "wall_s": time.time() - start_time,
        "peak_mem_gib": measured.peak_mem_gib,
        "breakdown": totals["breakdown"],
        "monitor": monitors,
        "gpu_util_mean_per_host": gpu_util_mean_per_host(monitors),
        **plan.engine.resolved_options(plan.settings, precision),
    }
    write_json(os.path.join(log_dir, "summary.json"), summary)
    ema = f" (EMA {100 * evaluation['ema_top1']:.2f}%)" if "ema_top1" in evaluation else ""
    top5 = f", top-5 {100 * evaluation['top5']:.2f}%" if "top5" in evaluation else ""
    print(
        f"done: {total} steps in {summary['wall_s']:.1f} s, top-1 "
        f"{100 * evaluation['top1']:.2f}%{ema}{top5}, logs in {log_dir}",
        flush=True,
    )
    return summary
