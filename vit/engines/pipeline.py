"""DeepSpeed pipeline parallelism: the layer list cut into --pipeline-stages stages, and data
parallelism across the copies of the pipeline when the world size is a multiple of the stages."""
import deepspeed
import torch
from deepspeed.pipe import PipelineModule

from vit.engines import EngineContext, deepspeed_comm, eval_totals, make_optimizer, make_scheduler, sum_over_ranks
from vit.model import loss_fn


class PipelineEngine:
    def __init__(self, ctx: EngineContext):
        deepspeed_comm()
        args = ctx.args
        module = PipelineModule(layers=ctx.layers, num_stages=args.pipeline_stages, loss_fn=loss_fn,
                                partition_method=args.partition)
        opt = make_optimizer(module, args)
        sched = make_scheduler(opt, args, ctx.total_steps)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module, optimizer=opt, lr_scheduler=sched, config=ctx.ds_config, dist_init_required=False)
        grid = self.engine.grid
        self.dp_rank, self.dp_size = grid.data_parallel_id, grid.data_parallel_size
        # Only the first stage reads images and only the last reads labels; the middle reads nothing.
        self.reads_data = self.engine.is_first_stage() or self.engine.is_last_stage()

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def train_step(self, batches):
        # Already the mean over micro-batches and data-parallel copies, broadcast to every stage.
        return self.engine.train_batch(data_iter=batches if self.reads_data else None)

    @torch.no_grad()
    def evaluate(self, batches):
        # eval_batch keeps only the last micro-batch's logits, so it runs one micro-batch per call.
        totals = torch.zeros(3, device=self.engine.device)
        for x, y in batches:
            _, logits = self.engine.eval_batch(iter([(x, y)]) if self.reads_data else None, return_logits=True,
                                               bcast_loss=False, num_micro_batches=1)
            if self.engine.is_last_stage():
                totals += eval_totals(logits, y)
        return sum_over_ranks(totals)

    def save(self, save_dir, tag, client_state):
        self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state)

    def load(self, load_dir, tag):
        path, client_state = self.engine.load_checkpoint(load_dir, tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {load_dir}")
        return client_state


def build(ctx: EngineContext):
    return PipelineEngine(ctx)
