"""--freeze-replan (PipeTransformer's AutoPipe and AutoDP): the pipeline's stages planned again at a freeze point,
and halved when the active layers fit in fewer stages, the freed ranks becoming data-parallel copies.

A layer's memory is counted in parameters: an active layer holds its weights, gradients and two Adam moments
(4 units a parameter), a frozen one its weights only (1 unit) and no activations for a backward. The pipeline the
run started with fits its devices, so its largest stage (every layer active) is the budget: K stages shrink to
K/2 when the K/2-stage plan's largest stage stays within it."""
from dataclasses import dataclass, replace

from torch import nn

ACTIVE_UNITS, FROZEN_UNITS = 4, 1


@dataclass(frozen=True)
class Layout:
    stages: int
    parts: list[int]  # stage s holds layers parts[s] .. parts[s+1]-1
    grad_accum: int  # micro-batches per step and data-parallel copy


def layer_memory(layers: list[nn.Module], frozen: int) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) * (FROZEN_UNITS if i < frozen else ACTIVE_UNITS)
            for i, layer in enumerate(layers)]


def largest_stage(costs: list[int], parts: list[int]) -> int:
    return max(sum(costs[a:b]) for a, b in zip(parts, parts[1:]))


def balanced(costs: list[int], stages: int, first_active: int) -> list[int]:
    """Contiguous stages minimising the largest stage's cost, the first stage holding an active layer (a stage of
    frozen layers only has no backward, which DeepSpeed's pipeline cannot skip). Exact, by dynamic programming."""
    n, inf = len(costs), float("inf")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][j]: the least largest cost of layers 0..j-1 in k stages, and the cut before the last stage
    best = [[(inf, 0)] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            if k == 1 and j <= first_active:
                continue
            best[k][j] = min((max(best[k - 1][i][0], prefix[j] - prefix[i]), i) for i in range(k - 1, j))
    parts, j = [n], n
    for k in range(stages, 0, -1):
        j = best[k][j][1]
        parts.append(j)
    return parts[::-1]


def replan(layers: list[nn.Module], frozen: int, current: Layout, budget: int) -> Layout:
    """The layout after `frozen` layers froze: K/2 stages with twice the copies (the same global batch, half the
    micro-batches each) when they fit the budget, else K stages balanced again."""
    costs = layer_memory(layers, frozen)
    if current.stages % 2 == 0 and current.grad_accum % 2 == 0:
        half = balanced(costs, current.stages // 2, frozen)
        if largest_stage(costs, half) <= budget:
            return Layout(current.stages // 2, half, current.grad_accum // 2)
    return Layout(current.stages, balanced(costs, current.stages, frozen), current.grad_accum)


def with_layout(ctx, layout: Layout):
    """An EngineContext for `layout`: its stages and boundaries, and the batch re-split (the same micro-batch and
    global batch, grad_accum micro-batches per copy)."""
    from vit.ds_config import Batch

    world = ctx.pipeline_stages * ctx.batch.dp_size
    batch = Batch(ctx.batch.micro_batch, layout.grad_accum, world // layout.stages)
    ds_config = {**ctx.ds_config, "gradient_accumulation_steps": layout.grad_accum,
                 "train_batch_size": batch.global_size}
    return replace(ctx, pipeline_stages=layout.stages, partition="balanced", parts=layout.parts, batch=batch,
                   ds_config=ds_config)
