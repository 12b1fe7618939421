"""DeepSpeed ZeRO (stage 0-3, optional CPU offload), all from the JSON config."""
import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from vit.engines import (
    DeepSpeedEngine,
    EngineContext,
    deepspeed_comm,
    eval_totals,
    make_optimizer,
    make_scheduler,
    mean_over_ranks,
    sum_over_ranks,
)
from vit.metrics import PhaseTimer
from vit.model import loss_fn


class ZeroEngine(DeepSpeedEngine):
    reads_data = True

    def __init__(self, ctx: EngineContext):
        deepspeed_comm()
        model = nn.Sequential(*ctx.layers)
        offload = ctx.ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
        opt = make_optimizer(model, ctx.args, cpu_offload=offload == "cpu")
        sched = make_scheduler(opt, ctx.args, ctx.total_steps)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=sched, config=ctx.ds_config, dist_init_required=False)
        self.grad_accum, self.loss_weight = ctx.batch.grad_accum, ctx.loss_weight
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        self.timer = PhaseTimer(self.engine.device)

    def _to_device(self, x, y):
        dev = self.engine.device
        return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

    def train_step(self, batches):
        total, t = 0.0, self.timer
        t.start()
        for _ in range(self.grad_accum):
            x, y = self._to_device(*next(batches))
            t.lap("data_s")
            # Weighted by this rank's share, so the average over ranks is the global batch's mean loss.
            loss = loss_fn(self.engine(x), y) * self.loss_weight
            t.lap("forward_s")
            self.engine.backward(loss)
            t.lap("backward_s")
            self.engine.step()  # steps the optimizer only at the accumulation boundary
            t.lap("optimizer_s")
            total = total + loss.detach()
        return total / self.grad_accum

    def mean_loss(self, loss):
        return mean_over_ranks(loss)

    @torch.no_grad()
    def evaluate(self, batches):
        self.engine.eval()
        totals = torch.zeros(3, device=self.engine.device)
        for x, y in batches:
            x, y = self._to_device(x, y)
            totals += eval_totals(self.engine(x), y)
        self.engine.train()
        return sum_over_ranks(totals)


def build(ctx: EngineContext):
    return ZeroEngine(ctx)
