"""--engine diloco: every worker (one rank, or the ranks of a host training as DDP among themselves)
takes the command line's optimizer's steps on its own shard of each global batch, with no
communication between workers; every --sync-every steps, and at the run's last step, the
pseudo-gradient (global weights minus the worker's) is averaged over the workers (wire.py) and the
outer optimizer (SGD, --outer-lr, Nesterov --outer-momentum) moves the global weights, which every
worker then takes. Each worker keeps its inner optimizer's state across syncs (DiLoCo's).
--local-start-step N: the first N steps are DDP's (every rank's gradients averaged over all ranks,
so every worker takes the same step: post-local SGD's warm-up), and the windows count from there.

The global weights are what is evaluated, averaged by --model-ema and exported: live_module() is
the global model. A checkpoint holds every rank's worker state (weights, inner optimizer and
schedule), the global weights and the outer optimizer, so a resume between syncs goes on exactly.

--local-steps proportional (ctx.local_steps, from the census): a worker takes its first h of every H
steps (h in proportion to its speed), draws and drops the batches of the others, and waits at the
sync; the average weighs each worker's pseudo-gradient by h (the samples it trained on). The end of
every window sets the next one's h from each worker's seconds per trained step in it (Async
Local-SGD's dynamic local updates): the census's one timing is noisy where ranks share cores, and a
GPU's speed can change during a run. Only the steps' own work is timed, on the training stream, not
the waits for a fragment or for the other workers.

--fragments F > 1 (Streaming DiLoCo): the parameters in F contiguous fragments of about equal size;
fragment f goes on the wire after step (f + 1) H / F of each window, in a thread on a process group
of its own, and is applied H / F steps later, when the next one goes: the outer step on the
fragment, and the worker's fragment set to the new global weights plus what the worker learned
since it went. At the last step every fragment syncs at once."""

import contextlib
import copy
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vit.core.errors import ConfigError
from vit.core.speeds import local_steps as steps_by_speed
from vit.engines.base import Engine, EngineContext, save_atomic
from vit.engines.base import mean_over_ranks as rank_mean
from vit.engines.diloco.wire import mean_over_ranks, padded_length
from vit.model.layers import Loss
from vit.runtime.precision import DTYPES
from vit.training.optim import make_optimizer, make_scheduler
from vit.training.stats import PhaseTimer


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


def worker_weight(steps: list[int], rank: int, weighting: str) -> float:
    """--outer-weighting: the factor on rank `rank`'s pseudo-gradient before the mean over the
    ranks, from every rank's inner steps in the window: steps weighs a worker by the steps it
    trained (FedAvg), uniform not at all, fednova divides by them and scales the mean by the
    workers' mean steps (FedNova, Wang et al. 2020)."""
    mean = sum(steps) / len(steps)
    return {"steps": steps[rank] / mean, "uniform": 1.0, "fednova": mean / steps[rank]}[weighting]


def fragment_bounds(sizes: list[int], fragments: int) -> list[int]:
    """Where each of `fragments` contiguous groups of tensors (of `sizes` elements) ends: a group
    closes where the running count is nearest to its share of the elements, each at least one
    tensor."""
    if fragments > len(sizes):
        raise ConfigError(f"--fragments {fragments} exceeds the model's {len(sizes)} tensors")
    total, ends, seen = sum(sizes), [], 0
    for i, n in enumerate(sizes[:-1]):
        seen += n
        target = total * (len(ends) + 1) / fragments
        must = len(sizes) - i - 1 == fragments - len(ends) - 1  # one tensor for each left
        if len(ends) < fragments - 1 and (seen + sizes[i + 1] / 2 >= target or must):
            ends.append(i + 1)
    return [*ends, len(sizes)]


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
        # gradients as views of the all-reduce buckets (ddp's): no second gradient-sized buffer
        self.model = (
            DistributedDataParallel(model, ids, process_group=group, gradient_as_bucket_view=True)
            if group
            else model
        )
        self.worker_group = group
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
        self.sync_every, self.wire = local.sync_every, local.outer_wire
        self.weighting = local.outer_weighting
        self.start = local.local_start_step  # steps trained as DDP before the local ones
        self.total_steps = ctx.total_steps
        self.loss = Loss(ctx.smoothing)
        self.dtype = DTYPES.get(ctx.precision) if ctx.precision != "fp32" else None
        self.clip = ctx.ds_config.get("gradient_clipping", 0.0)
        self.grad_accum, self.loss_weight = ctx.batch.grad_accum, ctx.loss_weight
        self.timer = PhaseTimer(self.device)
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        self.step = 0  # steps taken, those a worker waited through included
        # --local-steps: each rank's worker's inner steps in a window (its slowest rank's)
        self.workers = workers
        self.local_steps = self.by_worker(ctx.local_steps or [self.sync_every] * self.dp_size)
        self.window = self.local_steps  # the window in progress keeps the steps it began with
        # each window's end measures it for the next one's local steps
        self.mode = local.local_steps
        self.spans = None  # this window's trained steps (start, end), if it began in this run
        self.trained = True  # whether this rank trained in its last step
        self.met = False  # whether every rank met in a sync at the end of the last step
        self.last_loss = torch.zeros((), device=self.device)  # the worker's last trained loss
        ends = fragment_bounds([p.numel() for p in model.parameters()], local.fragment_count)
        self.fragments = [range(a, b) for a, b in zip([0, *ends[:-1]], ends)]
        self.in_flight = None  # (parameters, their mean pseudo-gradient when ready, weights sent)
        if len(self.fragments) > 1:
            self.outer_group = dist.new_group(list(range(self.dp_size)))
            self.sender = ThreadPoolExecutor(max_workers=1)
            # on GPUs the sender's collectives wait on a stream of their own, not on training's
            self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def trained_share(self) -> tuple[float, float]:
        """Of the global batch and of this rank's batch, the shares trained on, over the window of
        the step just taken (all of both in a DDP step)."""
        if self.step <= self.start:
            return 1.0, 1.0
        h, mine = self.window, self.window[self.dp_rank]
        return sum(h) / (len(h) * self.sync_every), mine / self.sync_every

    def train_step(self, batches):
        total, t = 0.0, self.timer
        t.start()
        as_ddp = self.step < self.start
        into = self.step - self.start  # steps into the local phase
        if into >= 0 and into % self.sync_every == 0:
            self.window, self.spans = self.local_steps, []
        self.trained = as_ddp or into % self.sync_every < self.window[self.dp_rank]
        measured = self.trained and self.mode != "equal" and self.spans is not None
        began = self.clock() if measured else None
        for j in range(self.grad_accum):
            x, y = next(batches)  # drawn where the worker waits too: the data order stays
            if not self.trained:
                t.lap("data_s")
                continue
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            t.lap("data_s")
            # a worker's DDP all-reduces once, on the last; not at all in a DDP step, whose
            # all-reduce over every rank (average_gradients) covers the worker's ranks too
            local = j < self.grad_accum - 1 or as_ddp
            no_sync = self.model.no_sync() if local and self.model is not self.module else None
            with no_sync or contextlib.nullcontext():
                with self.autocast():
                    logits = self.model(x)
                loss = self.loss(logits, y) * self.loss_weight
                t.lap("forward_s")
                (loss / self.grad_accum).backward()
            t.lap("backward_s")
            total = total + loss.detach()
        if as_ddp:
            self.average_gradients()
        if self.trained:
            if self.clip:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            t.lap("optimizer_s")
        # every step, trained or not: a worker with fewer local steps follows the run's schedule
        # (else, at 23 of 50 steps, it would end the run near 0.6 of the peak LR)
        self.scheduler.step()
        if measured:
            self.spans.append((began, self.clock()))
        self.step += 1
        self.communicate()
        if self.trained:
            self.last_loss = total / self.grad_accum
        return self.last_loss

    def communicate(self) -> None:
        """After a step: the DDP steps' global weights, the last step's sync of every parameter,
        a window's sync, or a fragment's turn on the wire."""
        into = self.step - self.start
        self.met = (
            into <= 0
            or self.step == self.total_steps
            or (len(self.fragments) == 1 and into % self.sync_every == 0)
        )
        if into <= 0:
            self.follow()
        elif self.step == self.total_steps:
            self.finish_in_flight()
            self.sync(range(self.fragments[-1].stop))  # every parameter
            self.timer.lap("allreduce_s")
        elif (fragment := self.due(self.step)) is not None:
            if into % self.sync_every == 0:
                self.measure_window()
            if len(self.fragments) == 1:
                self.sync(self.fragments[0])
            else:
                self.finish_in_flight()
                self.launch(fragment)
            self.timer.lap("allreduce_s")

    def by_worker(self, each: list[int]) -> list[int]:
        """Every rank's local steps: its worker's slowest rank's (the fewest) of `each`."""
        fewest = {r: min(each[q] for q in ranks) for ranks in self.workers for r in ranks}
        return [fewest[r] for r in range(self.dp_size)]

    def measure_window(self) -> None:
        """Collective, at a sync of every rank: the next windows' local steps from each rank's
        seconds per trained step in the window that ends (--local-steps' rule, as from the
        census); rank 0 prints them when they change."""
        if self.mode == "equal" or self.spans is None:  # alike on every rank
            return
        per_step = self.busy_s() / self.window[self.dp_rank]
        # on the engine's device: NCCL, the only backend on GPUs, takes no host tensors
        mine = torch.tensor([per_step], dtype=torch.float64, device=self.device)
        times = [torch.zeros_like(mine) for _ in range(self.dp_size)]
        dist.all_gather(times, mine)
        each = steps_by_speed(self.sync_every, torch.cat(times).tolist(), self.mode)
        steps = self.by_worker(each or [self.sync_every] * self.dp_size)
        if steps != self.local_steps and self.dp_rank == 0:
            print(
                f"step {self.step}: inner steps in each window of {self.sync_every}, by rank: "
                f"{steps} (from each worker's time per step in the last window)",
                flush=True,
            )
        self.local_steps = steps

    def clock(self):
        """Now on the training stream: a CUDA event (read at the window's end, so timing adds no
        host sync to the steps), the wall clock on a CPU."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def busy_s(self) -> float:
        """Seconds of this window's trained steps: their own work, without the waits between
        them (a fragment's mean, the other workers) that a window's wall time would count."""
        if self.device.type != "cuda":
            return sum(end - start for start, end in self.spans)
        self.spans[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self.spans) / 1000

    def due(self, step: int) -> int | None:
        """The fragment that goes on the wire after `step`: fragment f at (f + 1) H / F in every
        window."""
        every = self.sync_every // len(self.fragments)
        if step <= self.start:
            return None
        offset = (step - self.start) % self.sync_every or self.sync_every
        return offset // every - 1 if offset % every == 0 else None

    @torch.no_grad()
    def average_gradients(self) -> None:
        """Before --local-start-step: every rank's gradients averaged over all ranks (DDP's)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        flat /= self.dp_size
        for g, mean in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(mean.view_as(g))

    @torch.no_grad()
    def follow(self) -> None:
        """Before --local-start-step the global weights are every worker's (all alike)."""
        for g, p in zip(self.global_model.parameters(), self.module.parameters()):
            g.copy_(p)

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Where every rank just met in a sync: the mean over the ranks that trained in the step.
        Between syncs this worker's own last loss (the mean over its ranks): a collective of all
        there would hold every worker to the slowest one's pace at each logging step."""
        if not self.met:
            return rank_mean(loss, self.worker_group) if self.worker_group else loss
        trained = float(self.trained)
        both = torch.stack([loss.detach().float() * trained, loss.new_tensor(trained).float()])
        dist.all_reduce(both)
        return both[0] / both[1]

    def pseudo_gradient(self, indices) -> torch.Tensor:
        """This worker's global-minus-own weights of the parameters `indices`, flat, scaled so that
        the mean over the ranks weighs each worker as --outer-weighting says."""
        local, global_ = list(self.module.parameters()), list(self.global_model.parameters())
        sizes = [global_[i].numel() for i in indices]
        used = sum(sizes)
        # one buffer, which the wire averages in place (padded to its shares)
        length = padded_length(used, self.wire, self.dp_size)
        delta = torch.empty(length, dtype=torch.float32, device=self.device)
        delta[used:].zero_()
        for i, part in zip(indices, delta[:used].split(sizes)):
            part.copy_(global_[i].detach().flatten()).sub_(local[i].detach().flatten())
        weight = worker_weight(self.window, self.dp_rank, self.weighting)
        return delta if weight == 1 else delta.mul_(weight)

    @torch.no_grad()
    def sync(self, indices) -> None:
        """The outer step on the parameters `indices`: the pseudo-gradients averaged over the
        workers (every rank of a worker holds the same, so the mean over the ranks weighs each
        worker by its ranks, as DDP weighs them), the outer optimizer's step on the global weights,
        every worker from there."""
        self.apply(indices, mean_over_ranks(self.pseudo_gradient(indices), self.wire), None)

    @torch.no_grad()
    def launch(self, fragment: int) -> None:
        indices = self.fragments[fragment]
        delta = self.pseudo_gradient(indices)
        local = list(self.module.parameters())
        sent = [local[i].detach().clone() for i in indices]
        if self.side is None:
            mean = self.sender.submit(mean_over_ranks, delta, self.wire, self.outer_group).result
        else:
            mean = self.send_on_side(delta)
        self.in_flight = (indices, mean, sent)

    def send_on_side(self, delta: torch.Tensor):
        """On GPUs: the sender thread averages `delta` on the side stream, after the training
        stream has made it; the returned function gives the mean, the training stream waiting for
        it there and not before. A blocking collective holds its caller's current stream: on
        training's, the fragment would not overlap the steps."""
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(self.device))  # the training stream's

        def send():
            with torch.cuda.stream(self.side):
                self.side.wait_event(made)
                delta.record_stream(self.side)  # made on training's stream, freed after this use
                out = mean_over_ranks(delta, self.wire, self.outer_group)
                done = torch.cuda.Event()
                done.record(self.side)
            return out, done

        future = self.sender.submit(send)

        def mean() -> torch.Tensor:
            out, done = future.result()
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done)
            out.record_stream(stream)  # made on the side stream, used and freed on this one
            return out

        return mean

    @torch.no_grad()
    def finish_in_flight(self) -> None:
        if self.in_flight is not None:
            indices, mean, sent = self.in_flight
            self.in_flight = None
            self.apply(indices, mean(), sent)

    def apply(self, indices, mean: torch.Tensor, sent: list | None) -> None:
        """The outer step on `indices` from the mean pseudo-gradient; each worker's weights set to
        the new global ones, plus what it learned since `sent` (its weights when they went)."""
        local, global_ = list(self.module.parameters()), list(self.global_model.parameters())
        chosen = [global_[i] for i in indices]
        sizes = [g.numel() for g in chosen]
        for g, d in zip(chosen, mean[: sum(sizes)].split(sizes)):  # the wire's padding left
            g.grad = d.view_as(g)
        self.outer.step()
        for k, i in enumerate(indices):
            global_[i].grad = None
            p = local[i]
            if sent is None:
                p.copy_(global_[i])
            else:
                p.copy_(global_[i] + (p - sent[k]))

    def eval_logits(self, x, y):
        with self.autocast():
            return self.global_model(x.to(self.device, non_blocking=True))

    def train_mode(self, training):
        self.model.train(training)
        self.global_model.train(training)

    def live_module(self):
        return self.global_model

    def _state(self) -> dict:
        in_flight = None
        if self.in_flight is not None:  # waited for, not applied: the resumed run applies it
            indices, mean, sent = self.in_flight
            in_flight = {"indices": indices, "mean": mean(), "sent": sent}
            self.in_flight = (indices, lambda: in_flight["mean"], sent)
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "global": self.global_model.state_dict(),
            "outer": self.outer.state_dict(),
            "step": self.step,
            "sync_every": self.sync_every,
            "window": self.window,
            "local_steps": self.local_steps,
            "local_start_step": self.start,
            "in_flight": in_flight,
        }

    def save(self, save_dir, tag, client_state):
        # every worker's inner state is its own: each rank writes its file
        path = os.path.join(save_dir, tag, f"diloco_rank{dist.get_rank()}.pt")
        save_atomic({**self._state(), "client_state": client_state}, path)
        dist.barrier()

    def load(self, load_dir, tag):
        """This rank's state; on another number of ranks than saved, the global weights and outer
        optimizer (every rank's alike), the inner optimizer of rank (this one mod the saved count),
        and every worker from the global weights: what the workers learned since the last sync is
        dropped (rank 0 says so)."""
        folder = os.path.join(load_dir, tag)
        saved = len([f for f in os.listdir(folder) if f.startswith("diloco_rank")])
        rank = dist.get_rank()
        path = os.path.join(folder, f"diloco_rank{rank % max(1, saved)}.pt")
        if not os.path.isfile(path):
            raise RuntimeError(f"{path}: no diloco checkpoint of this rank")
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.global_model.load_state_dict(state["global"])
        self.outer.load_state_dict(state["outer"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        if self.step < self.start and self.step > state.get("local_start_step", 0):
            raise ConfigError(
                f"--local-start-step {self.start}: the checkpoint of step {self.step} is past its "
                f"DDP steps (--local-start-step {state.get('local_start_step', 0)}), and workers "
                f"that trained alone cannot go back to DDP; give at most {self.step}"
            )
        if saved != self.dp_size:
            self.module.load_state_dict(state["global"])
            if rank == 0:
                print(
                    f"--resume of --engine diloco saved by {saved} ranks on {self.dp_size}: every "
                    f"worker goes on from the global weights of the last sync before step "
                    f"{self.step} (what the workers learned since is dropped), with the inner "
                    f"optimizer of rank (its rank mod {saved})",
                    flush=True,
                )
            return state["client_state"]
        self.module.load_state_dict(state["model"])
        saved_steps = state.get("local_steps", self.local_steps)
        # the fastest worker trains every step of a window: H where the checkpoint predates the key
        saved_every = state.get("sync_every", max(saved_steps))
        if saved_every != self.sync_every:
            # the checkpoint's steps count windows of another length (a window of H could train
            # none of its steps): this run's own until the next sync measures them
            self.window = self.local_steps
            if rank == 0:
                print(
                    f"--resume with --sync-every {self.sync_every} (the checkpoint's: "
                    f"{saved_every}): inner steps by rank {self.local_steps} until a sync "
                    f"measures them",
                    flush=True,
                )
        else:
            self.window = state.get("window", self.local_steps)
            if saved_steps != self.local_steps and rank == 0:
                print(
                    f"--resume: inner steps in each window of {self.sync_every}, by rank: "
                    f"{saved_steps} (the checkpoint's, until a sync measures them again)",
                    flush=True,
                )
            self.local_steps = saved_steps
        if (in_flight := state.get("in_flight")) is not None:
            mean = in_flight["mean"]
            self.in_flight = (in_flight["indices"], lambda: mean, in_flight["sent"])
            if len(self.fragments) == 1:
                # no fragment turn comes to apply it (--fragments 1 now): the outer step on it
                # now, each worker keeping what it learned since it went
                self.finish_in_flight()
        return state["client_state"]

    def close(self):
        if self.in_flight is not None:
            self.in_flight[1]()  # no collective left running in the thread
        if len(self.fragments) > 1:
            self.sender.shutdown()
        self.model = self.module = self.global_model = self.optimizer = self.outer = None


def build(ctx: EngineContext):
    return DiLoCoEngine(ctx)
