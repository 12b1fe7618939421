"""--freeze-replan (PipeTransformer's AutoPipe and AutoDP): the pipeline's stages planned again at a
freeze point, and halved when the active layers fit in fewer stages, the freed ranks becoming
data-parallel copies.

One planner, vit.planner.stages, with the free memory measured at startup and the layer times
measured when a plan of more than one stage first needs them (vit.planner.survey.time_each_rank):
frozen layers cost their forward only and keep their weights only, no activations. K stages shrink
to K/2 when such a plan fits every rank's memory, else K stages are balanced again; the first stage
keeps an active layer (a stage of frozen layers only has no backward, which DeepSpeed's pipeline
cannot skip)."""

from collections.abc import Callable
from dataclasses import replace

from vit.core.batch import Batch
from vit.core.errors import ConfigError
from vit.core.layout import Layout
from vit.planner.stages import StageSplit, plan_stages


def replan(
    census: dict,
    frozen: int,
    current: Layout,
    micro_batch: int,
    time_layers: Callable[[], list] | None = None,
) -> tuple[Layout, StageSplit]:
    """Collective when it times the layers: the layout after `frozen` layers froze, and its plan:
    K/2 stages with twice the copies (the same global batch, half the micro-batches each) when they
    fit, else K stages balanced again. census: vit.planner.survey's record (its "layers" profile and
    "census" reports), whose reports get their layer_ms from time_layers() (every rank's) the first
    time a plan of several stages needs them (a one-stage plan has no boundary to place: its
    predicted times are 0)."""

    def plan(stages: int, grad_accum: int) -> StageSplit:
        # alike on every rank
        if stages > 1 and "layer_ms" not in census["census"][0] and time_layers:
            for report, layer_ms in zip(census["census"], time_layers()):
                report.update(layer_ms=layer_ms, layer_ms_micro_batch=micro_batch)
        return plan_stages(
            census["layers"],
            census["census"],
            stages,
            micro_batch,
            grad_accum,
            census["state_bytes_per_param"],
            frozen,
            first_active=True,
        )

    if current.stages % 2 == 0 and current.grad_accum % 2 == 0:
        try:
            half = plan(current.stages // 2, current.grad_accum // 2)
            return Layout(current.stages // 2, half.parts, current.grad_accum // 2), half
        except ConfigError:
            pass  # the active layers do not fit in fewer stages yet
    same = plan(current.stages, current.grad_accum)
    return Layout(current.stages, same.parts, current.grad_accum), same


def with_layout(ctx, layout: Layout):
    """An EngineContext for `layout`: its stages and boundaries, and the batch re-split (the same
    micro-batch and global batch, grad_accum micro-batches per copy)."""
    world = ctx.pipeline_stages * ctx.batch.dp_size
    batch = Batch(ctx.batch.micro_batch, layout.grad_accum, world // layout.stages)
    ds_config = {
        **ctx.ds_config,
        "gradient_accumulation_steps": layout.grad_accum,
        "train_batch_size": batch.global_size,
    }
    return replace(
        ctx,
        pipeline_stages=layout.stages,
        partition="balanced",
        parts=layout.parts,
        batch=batch,
        ds_config=ds_config,
    )
