"""DeepSpeed ZeRO (stage 0-3, optional CPU offload), all from the JSON config."""

from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import (
    OPTIMIZER_STATE_DICT,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
)
from deepspeed.checkpoint.constants import (
    UNIVERSAL_CHECKPOINT_VERSION_VALUE as UNIVERSAL_VERSION,
)
from torch import nn

from vit.engines.base import EngineContext
from vit.engines.deepspeed.engine import DeepSpeedEngine, deepspeed_comm
from vit.loop.optim import make_optimizer, make_scheduler
from vit.loop.stats import PhaseTimer
from vit.model.layers import Loss


class ZeroEngine(DeepSpeedEngine):
    def __init__(self, ctx: EngineContext):
        deepspeed_comm()
        model = nn.Sequential(*ctx.layers)
        offload = (
            ctx.ds_config.get("zero_optimization", {})
            .get("offload_optimizer", {})
            .get("device", "none")
        )
        opt = make_optimizer(
            model,
            ctx.optim,
            cpu_offload=offload == "cpu",
            num_layers=len(ctx.layers),
            device=ctx.device,
        )
        sched = make_scheduler(opt, ctx.optim, ctx.total_steps)
        # what DeepSpeed's ds_to_universal needs in a checkpoint to convert it to another number of
        # ranks (saved by save_checkpoint from this module attribute)
        model.universal_checkpoint_info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_VERSION}
        self.ds_engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=opt,
            lr_scheduler=sched,
            config=ctx.ds_config,
            dist_init_required=False,
        )
        if ctx.compile:
            self.ds_engine.compile()
        self.device = self.ds_engine.device
        self.grad_accum, self.loss_weight = ctx.batch.grad_accum, ctx.loss_weight
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        self.timer = PhaseTimer(self.device)
        self.loss = Loss(ctx.smoothing)

    def train_step(self, batches):
        total, t = 0.0, self.timer
        t.start()
        for _ in range(self.grad_accum):
            x, y = next(batches)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            t.lap("data_s")
            # Weighted by this rank's share, so the average over ranks is the global batch's mean
            # loss.
            loss = self.loss(self.ds_engine(x), y) * self.loss_weight
            t.lap("forward_s")
            self.ds_engine.backward(loss)
            t.lap("backward_s")
            self.ds_engine.step()  # steps the optimizer only at the accumulation boundary
            t.lap("optimizer_s")
            total = total + loss.detach()
        return total / self.grad_accum

    def eval_logits(self, x, y):
        return self.ds_engine(x.to(self.device, non_blocking=True))

    def load(self, load_dir, tag):
        client_state = super().load(load_dir, tag)
        universal = Path(load_dir) / tag / "zero" / "optimizer_state.pt"
        if self.ds_engine.zero_optimization_partition_weights() and universal.is_file():
            mend_stage3_universal_load(self.ds_engine.optimizer.optimizer, universal)
        return client_state

    def train_mode(self, training):
        self.ds_engine.train(training)

    def live_module(self):
        return self.ds_engine.module

    def gathered(self, modifier_rank=None):
        if not self.ds_engine.zero_optimization_partition_weights():
            return super().gathered(modifier_rank)
        return deepspeed.zero.GatheredParameters(
            list(self.live_module().parameters()), modifier_rank=modifier_rank
        )

    def layer_state(self, state=None):
        # ZeRO-3: gathered onto rank 0 layer by layer (an EMA's state is whole on every rank)
        if state is None and self.ds_engine.zero_optimization_partition_weights():
            return self.ds_engine._zero3_consolidated_16bit_state_dict()
        return super().layer_state(state)


def mend_stage3_universal_load(optimizer, universal: Path) -> None:
    """What DeepSpeed's ZeRO-3 universal-checkpoint load (0.19, stage3.py
    load_hp_checkpoint_state_from_checkpoint_dir_stage3) gets wrong, measured on a 2-rank ZeRO-3
    checkpoint resumed on 1 rank: it gives every parameter group the first group's
    hyperparameters (the no-decay group decayed, --layer-decay's LR scales lost), and one step
    tensor to every partition, which AdamW then advances once per partition per step (9 instead of
    6 after 3 steps: the bias correction off). Each group gets its own saved ones back, each
    partition a step of its own."""
    saved = torch.load(universal, map_location="cpu", weights_only=False)
    for group, was in zip(optimizer.param_groups, saved[OPTIMIZER_STATE_DICT]["param_groups"]):
        group.update({k: v for k, v in was.items() if k != "params"})
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def build(ctx: EngineContext):
    return ZeroEngine(ctx)
