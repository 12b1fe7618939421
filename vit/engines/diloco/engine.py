"""--engine diloco: every worker (one rank, or the ranks of a host training as DDP among themselves)
takes the command line's optimizer's steps on its own shard of each global batch, with no
communication between workers; every --sync-every steps, and at the run's last step, the
pseudo-gradient (global weights minus the worker's) is averaged over the workers (wire.py) and the
outer optimizer (SGD, --outer-lr, Nesterov --outer-momentum) moves the global weights, which every
worker then takes. Each worker keeps its inner optimizer's state across syncs (DiLoCo's).

The global weights are what is evaluated, averaged by --model-ema and exported: live_module() is
the global model. A checkpoint holds every rank's worker state (weights, inner optimizer and
schedule), the global weights and the outer optimizer, so a resume between syncs goes on exactly."""

import contextlib
import copy
import os
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vit.engines.base import Engine, EngineContext, save_atomic
from vit.engines.diloco.wire import mean_over_ranks
from vit.loop.optim import make_optimizer, make_scheduler
from vit.loop.stats import PhaseTimer
from vit.model.layers import Loss
from vit.runtime.precision import DTYPES


def worker_of(ranks_per_worker: str, device: torch.device) -> tuple[int, list[list[int]]]:
    """Collective: (this rank's worker, every worker's ranks). `ranks_per_worker`: N consecutive
    ranks, host (the ranks on one host, by host name), or auto (host on GPUs, one rank on CPUs)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ranks_per_worker == "auto":
        ranks_per_worker = "host" if device.type == "cuda" else "1"
    if ranks_per_worker == "host":
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        names = list(dict.fromkeys(hosts))
        workers = [[r for r in range(world) if hosts[r] == name] for name in names]
    else:
        n = int(ranks_per_worker)
        workers = [list(range(w, w + n)) for w in range(0, world, n)]
    return next(i for i, ranks in enumerate(workers) if rank in ranks), workers


class DiLoCoEngine(Engine):
    def __init__(self, ctx: EngineContext):
        local = ctx.settings.local
        self.device = ctx.device
        model = nn.Sequential(*ctx.layers).to(self.device)
        self.worker, workers = worker_of(local.worker_ranks, self.device)
        # every rank builds every worker's group, in the same order (torch.distributed's rule)
        groups = [dist.new_group(ranks) if len(ranks) > 1 else None for ranks in workers]
        group = groups[self.worker]
        ids = [self.device] if self.device.type == "cuda" else None
        self.model = DistributedDataParallel(model, ids, process_group=group) if group else model
        self.module = model
        if ctx.compile:
            self.model.compile()
        self.global_model = copy.deepcopy(model)  # the global weights
        self.optimizer = make_optimizer(model, ctx.optim, num_layers=len(ctx.layers))
        self.scheduler = make_scheduler(self.optimizer, ctx.optim, ctx.total_steps)
        momentum = local.outer_momentum
        self.outer = torch.optim.SGD(
            self.global_model.parameters(),
            lr=local.outer_lr,
            momentum=momentum,
            nesterov=momentum > 0,
        )
        self.sync_every, self.wire, self.total_steps = (
            local.sync_every,
            local.outer_wire,
            ctx.total_steps,
        )
        self.loss = Loss(ctx.smoothing)
        self.dtype = DTYPES.get(ctx.precision) if ctx.precision != "fp32" else None
        self.clip = ctx.ds_config.get("gradient_clipping", 0.0)
        self.grad_accum, self.loss_weight = ctx.batch.grad_accum, ctx.loss_weight
        self.timer = PhaseTimer(self.device)
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        self.step = 0  # inner steps taken

    def train_step(self, batches):
        total, t = 0.0, self.timer
        t.start()
        for j in range(self.grad_accum):
            x, y = next(batches)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            t.lap("data_s")
            last = j == self.grad_accum - 1  # a worker's DDP all-reduces once, on the last
            no_sync = self.model.no_sync() if not last and self.model is not self.module else None
            with no_sync or contextlib.nullcontext():
                with self.autocast():
                    logits = self.model(x)
                loss = self.loss(logits, y) * self.loss_weight
                t.lap("forward_s")
                (loss / self.grad_accum).backward()
            t.lap("backward_s")
            total = total + loss.detach()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        t.lap("optimizer_s")
        self.step += 1
        if self.step % self.sync_every == 0 or self.step == self.total_steps:
            self.sync()
            t.lap("allreduce_s")
        return total / self.grad_accum

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step: the pseudo-gradients averaged over the workers (every rank of a worker
        holds the same, so the mean over the ranks weighs each worker by its ranks, as DDP weighs
        them), the outer optimizer's step on the global weights, every worker from there."""
        local, global_ = list(self.module.parameters()), list(self.global_model.parameters())
        delta = torch.cat([(g - p.float()).flatten() for g, p in zip(global_, local)])
        delta = mean_over_ranks(delta, self.wire)
        for g, d in zip(global_, delta.split([g.numel() for g in global_])):
            g.grad = d.view_as(g)
        self.outer.step()
        for g, p in zip(global_, local):
            g.grad = None
            p.copy_(g)

    def eval_logits(self, x, y):
        with self.autocast():
            return self.global_model(x.to(self.device, non_blocking=True))

    def train_mode(self, training):
        self.model.train(training)
        self.global_model.train(training)

    def live_module(self):
        return self.global_model

    def _state(self) -> dict:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "global": self.global_model.state_dict(),
            "outer": self.outer.state_dict(),
            "step": self.step,
        }

    def save(self, save_dir, tag, client_state):
        # every worker's inner state is its own: each rank writes its file
        path = os.path.join(save_dir, tag, f"diloco_rank{dist.get_rank()}.pt")
        save_atomic({**self._state(), "client_state": client_state}, path)
        dist.barrier()

    def load(self, load_dir, tag):
        path = os.path.join(load_dir, tag, f"diloco_rank{dist.get_rank()}.pt")
        if not os.path.isfile(path):
            raise RuntimeError(f"{path}: no diloco checkpoint of this rank")
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_model.load_state_dict(state["global"])
        self.outer.load_state_dict(state["outer"])
        self.step = state["step"]
        return state["client_state"]

    def close(self):
        self.model = self.module = self.global_model = self.optimizer = self.outer = None


def build(ctx: EngineContext):
    return DiLoCoEngine(ctx)
