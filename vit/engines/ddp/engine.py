"""Plain PyTorch DistributedDataParallel with torch.amp, no DeepSpeed: the baseline.

It reads the same DeepSpeed JSON for the batch (micro-batch, gradient accumulation), precision,
fp16 initial loss scale and gradient clipping, and ignores the ZeRO settings.
"""

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vit.engines.base import Engine, EngineContext, ScalerStats, save_atomic
from vit.engines.ddp import from_zero
from vit.engines.ddp.comm_hooks import CommHook, bucket_options
from vit.model.layers import Loss
from vit.training.optim import (
    SkipAwareSchedule,
    adam_state,
    make_optimizer,
    make_scheduler,
    move_schedule,
    put_adam_state,
    schedule_position,
)
from vit.training.stats import PhaseTimer

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class DDPEngine(Engine):
    def __init__(self, ctx: EngineContext):
        self.device = ctx.device
        model = nn.Sequential(*ctx.layers).to(self.device)
        # gradients as views of the all-reduce buckets: no second gradient-sized buffer, no copy
        self.model = DistributedDataParallel(
            model,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            **bucket_options(model, ctx.settings.comm),  # PowerSGD on gloo: one bucket (see there)
        )
        # --comm-hook none registers nothing
        self.comm_hook = CommHook(self.model, ctx.settings.comm, self.device)
        if ctx.compile:
            self.model.compile()  # the DDP module, so that dynamo splits graphs at its buckets
        self.optimizer = make_optimizer(model, ctx.optim, num_layers=len(ctx.layers))
        self.loss = Loss(ctx.smoothing)
        self.dtype = DTYPES.get(ctx.precision)
        fp16 = ctx.ds_config.get("fp16", {})
        self.grad_scaler = (
            torch.amp.GradScaler(
                self.device.type, init_scale=2.0 ** fp16.get("initial_scale_power", 16)
            )
            if ctx.precision == "fp16"
            else None
        )
        self.scheduler = (
            SkipAwareSchedule(self.optimizer, ctx.optim, ctx.total_steps)
            if self.grad_scaler
            else make_scheduler(self.optimizer, ctx.optim, ctx.total_steps)
        )
        self.clip = ctx.ds_config.get("gradient_clipping", 0.0)
        self.grad_accum, self.loss_weight = ctx.batch.grad_accum, ctx.loss_weight
        # fp16 steps the GradScaler skipped on inf/nan gradients: so far, in a row now, the longest
        # run since the last read. Kept on the device and read on logging steps only (see
        # scaler).
        self._skips = torch.zeros(3, dtype=torch.long, device=self.device)
        self.timer = PhaseTimer(self.device)
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()

    def scaler(self, logging):
        if self.grad_scaler is None or not logging:  # a host sync: on logging steps only
            return None
        skipped, in_a_row, longest = self._skips.tolist()
        self._skips[2] = self._skips[1]
        return ScalerStats(skipped, in_a_row, longest, self.grad_scaler.get_scale())

    def train_step(self, batches):
        total, t = 0.0, self.timer
        t.start()
        for j in range(self.grad_accum):
            x, y = self.next_on_device(batches)
            t.lap("data_s")
            if self.comm_hook.unprimed:  # a resumed PowerSGD state: see vit.engines.ddp.comm_hooks
                self.comm_hook.prime(self.model, x)
            sync = j == self.grad_accum - 1  # all-reduce gradients once, on the last micro-batch
            with contextlib.nullcontext() if sync else self.model.no_sync():
                with self.autocast():
                    logits = self.model(x)
                # DDP averages over ranks: see vit.engines.zero.engine
                loss = self.loss(logits, y) * self.loss_weight
                t.lap("forward_s")
                scaled = loss / self.grad_accum
                (self.grad_scaler.scale(scaled) if self.grad_scaler else scaled).backward()
            t.lap("backward_s")  # the last micro-batch's includes the gradient all-reduce
            total = total + loss.detach()
        if self.grad_scaler:
            self.grad_scaler.unscale_(self.optimizer)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if self.grad_scaler:
            self._scaler_step()
        else:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        t.lap("optimizer_s")
        return total / self.grad_accum

    def _scaler_step(self):
        """The GradScaler skips the step on inf/nan gradients (the fused AdamW on the device,
        without a host sync) and then halves the scale; a scale that went down is a skipped step,
        compared on the device."""
        scale = self.grad_scaler._get_scale_async().clone()  # noqa: SLF001 (get_scale() would sync)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        skipped = self.grad_scaler._get_scale_async() < scale  # noqa: SLF001
        self.scheduler.step(~skipped)
        in_a_row = (self._skips[1] + 1) * skipped
        self._skips += torch.stack(
            [
                skipped.long(),
                in_a_row - self._skips[1],
                torch.clamp(in_a_row - self._skips[2], min=0),
            ]
        )

    def eval_logits(self, x, y):
        with self.autocast():
            return self.model(x.to(self.device, non_blocking=True))

    def train_mode(self, training):
        self.model.train(training)

    def live_module(self):
        return self.model.module

    def handover(self):
        return {
            "adam": adam_state(self.optimizer, self.model.module),
            "schedule": schedule_position(self.scheduler),
            "skips": self._skips.clone(),
            "scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
        }

    def take_over(self, state):
        put_adam_state(self.optimizer, self.model.module, state["adam"])
        move_schedule(self.scheduler, state["schedule"])
        self._skips.copy_(state["skips"])
        if self.grad_scaler:
            self.grad_scaler.load_state_dict(state["scaler"])

    def close(self):
        # DDP's reducer and buckets go with the model
        self.model = self.optimizer = self.scheduler = None

    def _state(self):
        return {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
            "comm_hook": self.comm_hook.key,
        }

    def save(self, save_dir, tag, client_state):
        # Replicas are identical: rank 0 writes, the others wait (PowerSGD keeps an error feedback
        # per rank: each rank writes its own). vit.checkpoints.checkpoint makes it complete.
        if dist.get_rank() == 0:
            save_atomic(
                {**self._state(), "client_state": client_state},
                os.path.join(save_dir, tag, "ddp.pt"),
            )
        self.comm_hook.save(os.path.join(save_dir, tag), dist.get_rank())
        dist.barrier()

    def load(self, load_dir, tag):
        path = os.path.join(load_dir, tag, "ddp.pt")
        if from_zero.is_universal(Path(load_dir) / tag):  # --engine zero's, converted
            module = self.model.module
            return from_zero.load(Path(load_dir) / tag, module, self.optimizer, self.scheduler)
        if not os.path.isfile(path):
            raise RuntimeError(f"{path}: no ddp checkpoint (was it written by another engine?)")
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.grad_scaler and state["scaler"]:
            self.grad_scaler.load_state_dict(state["scaler"])
        self.comm_hook.load(os.path.join(load_dir, tag), dist.get_rank(), state.get("comm_hook"))
        return state["client_state"]


def build(ctx: EngineContext):
    return DDPEngine(ctx)
