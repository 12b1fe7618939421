"""--engine async-pipeline: the layer list cut into --pipeline-stages stages as the pipeline engine
cuts it, trained 1F1B with no flush (PipeDream-2BW). Each stage applies its update after every
--async-update-interval of its backward passes, so the first stages forward some micro-batches on
weights one update older than those their gradients are applied to; weight stashing and msnag weight
prediction (vit.engines.async_pipeline.msnag) offset that. Data parallelism across copies of the
pipeline: each stage all-reduces its gradients in a group of its copies.

The schedule is a fixed function of the stage and the micro-batch counters, never of timing: stage s
keeps at most stages - s micro-batches in flight, runs a backward when it holds more than stages - s
- 1 and a forward otherwise, until the step's micro-batches are all forwarded. The micro-batches
still in flight at a step's end finish in the next step. A checkpoint drains them first (and the
last step does), so what is saved is weights, optimizer and counters, and a resumed run continues as
the uninterrupted one does.

Activations and gradients cross in --pipe-wire-dtype: cast just before the send, back to fp32 on
arrival (the tensors between a stage's layers are fp32 under bf16 autocast too: the residual stream
adds to fp32 weights).
"""

import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from vit.core.errors import ConfigError
from vit.engines.async_pipeline import p2p
from vit.engines.async_pipeline.msnag import predict
from vit.engines.base import EngineContext, StagedEngine, save_atomic
from vit.model.layers import Loss
from vit.runtime import plugins
from vit.runtime.precision import DTYPES
from vit.training.optim import make_optimizer, make_scheduler, move_schedule, put_adam_state
from vit.training.stats import PhaseTimer


def stage_parts(
    layers: list[nn.Module], stages: int, method: str, planned: list[int] | None
) -> list[int]:
    """Stage boundaries as DeepSpeed's PipelineModule cuts them, or the balanced plan's
    (vit.planner)."""
    from deepspeed.runtime import utils as ds_utils

    if method == "balanced":
        return list(planned)
    if method == "uniform":
        return ds_utils.partition_uniform(len(layers), stages)
    if method == "parameters":
        weights = [
            sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in layers
        ]
    else:  # type:REGEX, on the layers' class names
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [int(bool(pattern.search(type(layer).__name__))) for layer in layers]
        if not any(weights):
            raise ConfigError(f"--partition {method}: no layer's class name matches")
    return ds_utils.partition_balanced(weights, stages)


@dataclass
class InFlight:
    """A micro-batch this stage has forwarded and not yet backwarded."""

    # its input: the images on the first stage, the previous stage's activations elsewhere
    x: torch.Tensor
    # its output (its loss on the last stage); None: the backward runs the forward again
    out: torch.Tensor | None
    weights: dict | None  # the weights its forward used, by name
    version: int  # updates this stage had applied when it was forwarded
    staleness: int  # updates that land before its own


class AsyncPipelineEngine(StagedEngine):
    def __init__(self, ctx: EngineContext):
        if ctx.precision == "fp16":
            raise ConfigError(
                "--engine async-pipeline trains in fp32 or bf16 (it has no fp16 loss scaler); "
                "pass --precision bf16 or fp32"
            )
        stages, self.device = ctx.pipeline_stages, ctx.device
        self.stages = stages
        self.dp_size = dist.get_world_size() // stages
        self.links = p2p.Links(stages, self.dp_size, self.device)
        self.stage, self.dp_rank = self.links.stage, self.links.dp_rank
        parts = stage_parts(ctx.layers, stages, ctx.partition, ctx.parts)
        held = range(parts[self.stage], parts[self.stage + 1])
        self.module = nn.Sequential(OrderedDict((str(i), ctx.layers[i]) for i in held)).to(
            self.device
        )
        self.params = dict(self.module.named_parameters())
        self.flat_grads = None
        if self.dp_size > 1:  # the gradients are views of one buffer, all-reduced in place
            params = list(self.params.values())
            self.flat_grads = torch.zeros(sum(p.numel() for p in params), device=self.device)
            for p, view in zip(params, self.flat_grads.split([p.numel() for p in params])):
                p.grad = view.view_as(p)
        if ctx.compile:
            self.module.compile()  # in place: the names and functional_call's weights are unchanged
        self.first, self.last = self.stage == 0, self.stage == stages - 1
        # images on the first, labels on the last: never sent along
        self.reads_data = self.first or self.last
        self.reads_images = self.first
        # micro-batches in flight beyond the one 1F1B alternates on
        self.ahead = stages - 1 - self.stage
        a = ctx.settings.asynchrony
        self.grad_accum = ctx.batch.grad_accum
        self.interval = a.async_update_interval or ctx.batch.grad_accum
        self.stashing, self.prediction = a.weight_stashing == "on", a.weight_prediction == "msnag"
        self.optimizer = make_optimizer(
            self.module, ctx.optim, num_layers=len(ctx.layers), device=self.device
        )
        self.scheduler = make_scheduler(
            self.optimizer, ctx.optim, ctx.total_steps * self.grad_accum // self.interval
        )
        self.loss_fn, self.loss_weight = Loss(ctx.smoothing), ctx.loss_weight
        self.clip = ctx.ds_config.get("gradient_clipping", 0.0)
        self.dtype = torch.bfloat16 if ctx.precision == "bf16" else None
        self.wire = DTYPES[a.wire_dtype(ctx.precision)]
        self.wire_counted = 0  # links.bytes_sent() already in a breakdown (or an evaluation's)
        self.total_steps = ctx.total_steps
        self.steps = self.forwarded = self.backwarded = self.version = 0
        self.inflight: dict[int, InFlight] = {}
        # (version, staleness, weights): the stashed or predicted weights forwards share
        self.cached = None
        self.losses: list[torch.Tensor] = []
        self.timer = PhaseTimer(self.device)

    def train_step(self, batches):
        end = (self.steps + 1) * self.grad_accum
        self.timer.start()
        while True:
            if self.forwarded - self.backwarded > self.ahead:
                self._backward()
            elif self.forwarded < end:
                self._forward(batches)
            else:
                break
        self.steps += 1
        if self.steps == self.total_steps:
            self.drain()  # nothing left in flight, no send unwaited
        loss = (
            torch.stack(self.losses).mean() if self.losses else torch.zeros((), device=self.device)
        )
        self.losses = []
        return loss

    def staleness(self, k: int) -> int:
        """Updates this stage applies between micro-batch k's forward (now) and the update its
        gradient joins."""
        return k // self.interval - self.version

    def _weights(self, k: int) -> tuple[dict, bool]:
        """The weights micro-batch k's forward uses, and whether its backward must run the forward
        again."""
        d = self.staleness(k)
        if d == 0:  # no update lands before its backward: the live weights serve both passes
            return self.params, False
        if not self.stashing and not self.prediction:
            return self.params, True
        if self.cached is None or self.cached[:2] != (self.version, d):
            with torch.no_grad():
                values = (
                    predict(self.optimizer, d)
                    if self.prediction
                    else {p: p.detach().clone() for p in self.params.values()}
                )
            self.cached = (
                self.version,
                d,
                {n: values[p].requires_grad_() for n, p in self.params.items()},
            )
        return self.cached[2], not self.stashing

    def _forward(self, batches) -> None:
        k, t = self.forwarded, self.timer
        x = y = None
        if self.reads_data:
            x, y = next(batches)
            t.lap("data_s")
        if not self.first:
            x = self.links.recv_act.recv(more=k + 1 < self.total_steps * self.grad_accum)
            x = x.to(torch.float32).requires_grad_()  # a leaf: its gradient goes back
            t.lap("pipe_recv_s")
        x = x.to(self.device, non_blocking=True)
        weights, again = self._weights(k)
        with torch.set_grad_enabled(not again), self.autocast():
            out = functional_call(self.module, weights, (x,))
            if self.last:
                out = self.loss_fn(out, y.to(self.device, non_blocking=True)) * self.loss_weight
        t.lap("forward_s")
        if self.last:
            self.losses.append(out.detach())
        else:
            self.links.send_act.send(out.detach().to(self.wire))
            t.lap("pipe_send_s")
        self.inflight[k] = InFlight(
            x, None if again else out, None if again else weights, self.version, self.staleness(k)
        )
        plugins.call("async_forward", self, k, weights)  # tests: which weights each pass used
        self.forwarded += 1

    def _backward(self) -> None:
        k, t = self.backwarded, self.timer
        rec = self.inflight.pop(k)
        grad_out = None
        if not self.last:
            grad_out = self.links.recv_grad.recv(more=k + 1 < self.total_steps * self.grad_accum)
            t.lap("pipe_recv_s")
        out, weights = rec.out, rec.weights
        if out is None:  # without stashing: the forward again, on the weights of now
            weights = self.params
            with self.autocast():
                out = functional_call(self.module, weights, (rec.x,))
        if self.last:
            out = out / self.interval  # an update's gradient is the mean over its micro-batches
        inputs = [] if self.first else [rec.x]
        grads = torch.autograd.grad(
            out,
            inputs + list(weights.values()),
            None if grad_out is None else grad_out.to(out.dtype),
            allow_unused=True,
        )
        for p, g in zip(self.params.values(), grads[len(inputs) :]):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        plugins.call("async_backward", self, k, rec, weights)
        t.lap("backward_s")
        if not self.first:
            self.links.send_grad.send(grads[0].to(self.wire))
            t.lap("pipe_send_s")
        self.backwarded += 1
        if self.backwarded % self.interval == 0:
            self._update()

    def _update(self) -> None:
        params = list(self.params.values())
        if self.flat_grads is not None:
            dist.all_reduce(self.flat_grads, group=self.links.stage_group)
            self.flat_grads /= self.dp_size
            self.timer.lap("allreduce_s")
        # each stage its own norm: a norm over all stages would tie them back together
        if self.clip:
            nn.utils.clip_grad_norm_(params, self.clip)
        self.optimizer.step()
        self.scheduler.step()
        if self.flat_grads is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.flat_grads.zero_()
        self.version += 1
        self.cached = None
        self.timer.lap("optimizer_s")

    def drain(self) -> None:
        """Backward every micro-batch in flight (their update included) and wait for every send."""
        while self.backwarded < self.forwarded:
            self._backward()
        self.links.flush()

    def mean_loss(self, loss):
        t = loss.detach().float().clone()  # the last stages' losses; the others add zero
        dist.all_reduce(t)
        return t / self.dp_size

    def evaluate(self, batches):
        before = self.links.bytes_sent()
        result = super().evaluate(batches)
        self.links.flush()  # the evaluation's sends, waited on before anything else runs
        self.wire_counted += self.links.bytes_sent() - before  # no training step's
        return result

    def breakdown(self, steps):
        """The phases, and wire_bytes: the bytes this rank sent its neighbours per step."""
        sent, self.wire_counted = (
            self.links.bytes_sent() - self.wire_counted,
            self.links.bytes_sent(),
        )
        return {**self.timer.read(steps), "wire_bytes": sent / steps}

    @torch.no_grad()
    def eval_logits(self, x, y):
        if not self.first:
            x = self.links.recv_act.recv().to(torch.float32)
        with self.autocast():
            out = self.module(x.to(self.device, non_blocking=True))
        if self.last:
            return out
        self.links.send_act.send(out.to(self.wire))
        return None

    def train_mode(self, training):
        self.module.train(training)

    def live_module(self):
        return self.module

    def _path(self, folder: str, tag: str) -> str:
        return os.path.join(folder, tag, f"async_stage{self.stage}.pt")

    def save(self, save_dir, tag, client_state):
        with self.timer.paused():
            self.drain()
        if self.dp_rank == 0:  # the copies of a stage are identical
            path = self._path(save_dir, tag)
            names = {id(p): n for n, p in self.module.named_parameters()}
            state = {
                "module": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "client_state": client_state,
                "counters": [self.steps, self.forwarded, self.backwarded, self.version],
                # the optimizer state's parameter indices by name (layers keep their global index
                # as their name): another number of stages regroups them (load)
                "optimizer_names": [
                    names[id(p)] for g in self.optimizer.param_groups for p in g["params"]
                ],
            }
            save_atomic(state, path)
        dist.barrier()

    def load(self, load_dir, tag):
        saved = sorted(Path(load_dir, tag).glob("async_stage*.pt"))
        if len(saved) != self.stages:
            return self.load_restaged(saved)
        path = self._path(load_dir, tag)
        if not os.path.isfile(path):
            raise RuntimeError(f"{path}: no async-pipeline checkpoint of stage {self.stage}")
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps, self.forwarded, self.backwarded, self.version = state["counters"]
        self.inflight, self.cached = {}, None
        return state["client_state"]

    def load_restaged(self, saved: list) -> dict:
        """A checkpoint of another number of stages: every stage's file read, this stage's
        weights and AdamW state taken by parameter name, the schedule and counters of stage 0
        (a checkpoint drains the pipeline, so every stage has taken the same steps)."""
        weights, adam, first = {}, {}, None
        for path in saved:
            state = torch.load(path, map_location=self.device, weights_only=False)
            if "optimizer_names" not in state:
                raise ConfigError(
                    f"{path} was written before async-pipeline checkpoints named their optimizer "
                    f"state; resume it with --pipeline-stages {len(saved)}"
                )
            names = state["optimizer_names"]
            weights.update(state["module"])
            adam.update({names[i]: s for i, s in state["optimizer"]["state"].items()})
            first = first or state
        self.module.load_state_dict({k: weights[k] for k in self.module.state_dict()})
        put_adam_state(self.optimizer, self.module, adam)
        schedule = first["scheduler"]
        move_schedule(self.scheduler, schedule.get("applied", schedule.get("last_epoch")))
        self.steps, self.forwarded, self.backwarded, self.version = first["counters"]
        self.inflight, self.cached = {}, None
        if dist.get_rank() == 0:
            print(
                f"--resume: async-pipeline checkpoint of {len(saved)} stages on "
                f"{self.stages}: weights and AdamW state taken by parameter name",
                flush=True,
            )
        return first["client_state"]


def build(ctx: EngineContext):
    return AsyncPipelineEngine(ctx)
