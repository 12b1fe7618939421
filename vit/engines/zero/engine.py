"""DeepSpeed ZeRO (stage 0-3, optional CPU offload), all from the JSON config."""

from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from vit.core.errors import ConfigError
from vit.engines.base import EngineContext
from vit.engines.deepspeed.engine import DeepSpeedEngine, deepspeed_comm
from vit.model.layers import Loss
from vit.training.optim import make_optimizer
from vit.training.stats import PhaseTimer

# DeepSpeed releases whose ZeRO-3 universal load was run here and found to need
# mend_stage3_universal_load, and mended by it (tests/test_universal.py; the upstream report:
# docs/deepspeed-universal-zero3-report.md). Another release: run those tests on it, then add it.
MENDED_DEEPSPEED = ("0.19.8",)


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
        self.initialize(ctx, model, opt)
        self.grad_accum, self.loss_weight = ctx.batch.grad_accum, ctx.loss_weight
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        self.timer = PhaseTimer(self.device)
        self.loss = Loss(ctx.smoothing)

    def train_step(self, batches):
        total, t = 0.0, self.timer
        t.start()
        for _ in range(self.grad_accum):
            x, y = self.next_on_device(batches)
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
        universal = Path(load_dir) / tag / "zero" / "optimizer_state.pt"
        if not universal.is_file():  # saved by these ranks: DeepSpeed's own load checks the groups
            return super().load(load_dir, tag)
        # DeepSpeed pairs the groups by position, unchecked (and ZeRO-3 overwrites them): compare
        # this run's, as built, with the checkpoint's before anything is loaded
        optimizer = self.ds_engine.optimizer.optimizer
        saved = torch.load(universal, map_location="cpu", weights_only=False)["param_groups"]
        check_groups(optimizer.param_groups, saved, tag)
        stage3 = self.ds_engine.zero_optimization_partition_weights()
        if stage3:
            check_mended(deepspeed.__version__, tag)
        client_state = super().load(load_dir, tag)
        if stage3:
            mend_stage3_universal_load(optimizer, saved)
        check_loaded(optimizer.param_groups, saved, tag)
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


def check_groups(groups: list[dict], saved: list[dict], tag: str) -> None:
    """This run's parameter groups are the checkpoint's, one for one: their number (--layer-decay
    makes one pair per layer), each one's base learning rate (--lr, --layer-decay) and weight decay
    (--weight-decay). DeepSpeed's universal load pairs them by position, unchecked."""
    at = f"checkpoint {tag}, loaded through DeepSpeed's universal checkpoint"
    redo = "resume with the run's --lr, --layer-decay and --weight-decay"
    if len(groups) != len(saved):
        raise ConfigError(
            f"{at}: its optimizer has {len(saved)} parameter groups, this run's {len(groups)} "
            f"(--layer-decay makes one pair per layer): {redo}"
        )
    for i, (now, was) in enumerate(zip(groups, saved)):
        if (now["initial_lr"], now["weight_decay"]) != (was["initial_lr"], was["weight_decay"]):
            raise ConfigError(
                f"{at}: parameter group {i} has learning rate {was['initial_lr']:g} and weight "
                f"decay {was['weight_decay']:g} there, {now['initial_lr']:g} and "
                f"{now['weight_decay']:g} in this run: {redo}"
            )


def check_mended(version: str, tag: str) -> None:
    """mend_stage3_universal_load fixes what the DeepSpeed releases in MENDED_DEEPSPEED get wrong;
    another one may save or load the groups otherwise."""
    if version not in MENDED_DEEPSPEED:
        raise ConfigError(
            f"checkpoint {tag}: ZeRO-3 state of another number of ranks, and DeepSpeed {version}'s "
            f"universal load is not one this project has checked (DeepSpeed "
            f"{', '.join(MENDED_DEEPSPEED)} loses each parameter group's settings: "
            f"docs/deepspeed-universal-zero3-report.md); resume on the number of ranks that "
            f"wrote it, or with deepspeed=={MENDED_DEEPSPEED[-1]}"
        )


def check_loaded(groups: list[dict], saved: list[dict], tag: str) -> None:
    """After the load (and the mend): each group holds the checkpoint's learning rate and weight
    decay. DeepSpeed's ZeRO-1 and -2 loads set them and are not mended; a release that loads them
    otherwise is caught here."""
    for i, (now, was) in enumerate(zip(groups, saved, strict=True)):
        if (now["lr"], now["weight_decay"]) != (was["lr"], was["weight_decay"]):
            raise ConfigError(
                f"checkpoint {tag}: DeepSpeed {deepspeed.__version__}'s universal load left "
                f"parameter group {i} with learning rate {now['lr']:g} and weight decay "
                f"{now['weight_decay']:g}, the checkpoint's are {was['lr']:g} and "
                f"{was['weight_decay']:g}; resume on the number of ranks that wrote it"
            )


def mend_stage3_universal_load(optimizer, saved: list[dict]) -> None:
    """What DeepSpeed's ZeRO-3 universal-checkpoint load (0.19.8, stage3.py
    load_hp_checkpoint_state_from_checkpoint_dir_stage3) gets wrong, measured on a 2-rank ZeRO-3
    checkpoint resumed on 1 rank: it gives every parameter group the first group's
    hyperparameters (the no-decay group decayed, --layer-decay's LR scales lost), and one step
    tensor to every partition, which AdamW then advances once per partition per step (9 instead of
    6 after 3 steps: the bias correction off). Each group gets its own saved ones back (paired by
    check_groups), each partition a step of its own."""
    for group, was in zip(optimizer.param_groups, saved, strict=True):
        group.update({k: v for k, v in was.items() if k != "params"})
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def build(ctx: EngineContext):
    return ZeroEngine(ctx)
