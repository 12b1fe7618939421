"""DeepSpeed pipeline parallelism: the layer list cut into --pipeline-stages stages, and data
parallelism across the copies of the pipeline when the world size is a multiple of the stages."""

import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe import schedule

from vit.core.layout import Layout
from vit.engines.base import EngineContext, StagedEngine
from vit.engines.deepspeed.engine import DeepSpeedEngine, deepspeed_comm
from vit.model.layers import Loss
from vit.runtime.dist_env import destroy_groups
from vit.training.optim import make_optimizer
from vit.training.stats import PhaseTimer

# The breakdown field of each instruction of DeepSpeed's pipeline schedule. A receive includes the
# wait for the neighbouring stage, so the pipeline bubble shows up in pipe_recv_s.
PHASES = {
    schedule.LoadMicroBatch: "data_s",
    schedule.ForwardPass: "forward_s",
    schedule.BackwardPass: "backward_s",
    schedule.SendActivation: "pipe_send_s",
    schedule.SendGrad: "pipe_send_s",
    schedule.RecvActivation: "pipe_recv_s",
    schedule.RecvGrad: "pipe_recv_s",
    schedule.ReduceGrads: "allreduce_s",
    schedule.ReduceTiedGrads: "allreduce_s",
    schedule.OptimizerStep: "optimizer_s",
}


def timed_instructions(instruction_map: dict, timer: PhaseTimer) -> dict:
    """DeepSpeed's instruction map (schedule instruction -> method) with each method timed.

    DeepSpeed's own pipeline timers ("wall_clock_breakdown") fail in 0.19 ("timer has already been
    started"), and they synchronise the device at every start and stop."""

    def timed(fn, phase):
        def run(engine, **kwargs):
            timer.start()
            fn(engine, **kwargs)
            timer.lap(phase)

        return run

    return {instr: timed(fn, PHASES.get(instr, "other_s")) for instr, fn in instruction_map.items()}


class PlannedPipeline(PipelineModule):
    """A PipelineModule whose stage boundaries are given (--partition balanced) instead of
    computed."""

    def __init__(self, parts: list[int] | None, **kwargs):
        object.__setattr__(self, "planned_parts", parts)  # before nn.Module's own __init__
        super().__init__(**kwargs)

    def _partition_layers(self, method="uniform"):
        if method != "balanced":
            return super()._partition_layers(method)
        self.parts = list(self.planned_parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


class PipelineEngine(StagedEngine, DeepSpeedEngine):
    def __init__(self, ctx: EngineContext):
        deepspeed_comm()
        module = PlannedPipeline(
            ctx.parts,
            layers=ctx.layers,
            num_stages=ctx.pipeline_stages,
            loss_fn=Loss(ctx.smoothing),
            partition_method=ctx.partition,
        )
        opt = make_optimizer(module, ctx.optim, num_layers=len(ctx.layers), device=ctx.device)
        self.initialize(ctx, module, opt)
        grid = self.ds_engine.grid
        self.dp_rank, self.dp_size = grid.data_parallel_id, grid.data_parallel_size
        # Only the first stage reads images and only the last reads labels; the middle reads
        # nothing.
        self.reads_data = self.ds_engine.is_first_stage() or self.ds_engine.is_last_stage()
        self.reads_images, self.reads_labels = (
            self.ds_engine.is_first_stage(),
            self.ds_engine.is_last_stage(),
        )
        self.timer = PhaseTimer(self.device)
        self.grad_accum = self.ds_engine.gradient_accumulation_steps()
        # DeepSpeed's own partition methods give numpy integers: plain ones for the freeze records
        # and checkpoints.
        # --freeze-replan
        self.layout = Layout(ctx.pipeline_stages, [int(p) for p in module.parts], self.grad_accum)
        self.ds_engine._INSTRUCTION_MAP = timed_instructions(
            type(self.ds_engine)._INSTRUCTION_MAP, self.timer
        )
        self.groups = pipeline_groups(module)

    def close(self):
        # The last stage keeps its last forward's outputs and loss; their autograd hooks hold
        # DeepSpeed's engine in a cycle through autograd that gc cannot see.
        for buffers in self.ds_engine.pipe_buffers.values():
            buffers.clear()
        self.ds_engine.loss = self.ds_engine.total_loss = None
        super().close()
        destroy_groups(self.groups)
        self.groups = []

    def train_step(self, batches):
        # Already the mean over micro-batches and data-parallel copies, broadcast to every stage.
        return self.ds_engine.train_batch(
            data_iter=map(self.on_device, batches) if self.reads_data else None
        )

    def on_device(self, batch):
        """What this stage reads, copied without waiting (pinned memory on a GPU): DeepSpeed's own
        copy of each micro-batch is a blocking one, a host sync per micro-batch, and on tensors
        already there it copies nothing."""
        x, y = batch
        return (
            x.to(self.device, non_blocking=True) if self.reads_images else x,
            y.to(self.device, non_blocking=True) if self.reads_labels else y,
        )

    def mean_loss(self, loss):
        return loss

    def live_module(self):
        return self.ds_engine.module

    def whole_weights(self):
        return all_stages(self.live_module().state_dict(), self.layout.stages, self.dp_rank)

    def handover(self):
        state = super().handover()
        return {**state, "adam": all_stages(state["adam"], self.layout.stages, self.dp_rank)}

    def eval_logits(self, x, y):
        # eval_batch keeps only the last micro-batch's logits, so it runs one micro-batch per call.
        _, logits = self.ds_engine.eval_batch(
            iter([(x, y)]) if self.reads_data else None,
            return_logits=True,
            bcast_loss=False,
            num_micro_batches=1,
        )
        return logits if self.ds_engine.is_last_stage() else None


def pipeline_groups(module: PipelineModule) -> list:
    """The process groups that DeepSpeed's PipelineModule and its grid (over the ProcessTopology)
    created for this rank, in the order they were created. DeepSpeed never destroys them: without
    close() every pipeline rebuilt at a freeze point would add its own."""
    grid = module._grid  # noqa: SLF001
    groups = [
        module.world_group,
        grid.ds_model_proc_group,
        grid.dp_proc_group,
        grid.pp_proc_group,
        grid.slice_proc_group,
        *(comm["group"] for comm in module.tied_comms.values()),
    ]
    return list({id(g): g for g in groups}.values())


def all_stages(local: dict, stages: int, dp_rank: int) -> dict:
    """Every stage's entries (tensors, or dicts of them, by layer key) merged on every rank, copied
    to the host: a collective in which the first data-parallel copy of each stage sends its own,
    unless one stage holds them all (the data-parallel copies of one stage are alike; pickling them
    for every rank took 11 s a freeze point for vit_tiny_patch16_224 on 2 CPU ranks)."""

    def cpu(v):
        return (
            {k: cpu(t) for k, t in v.items()}
            if isinstance(v, dict)
            else v.detach().to("cpu", copy=True)
        )

    if stages == 1:
        return cpu(local)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, cpu(local) if dp_rank == 0 else {})
    return {k: v for part in parts for k, v in part.items()}


def build(ctx: EngineContext):
    return PipelineEngine(ctx)
