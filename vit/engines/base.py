"""The engine contract: what the training loop sees of ZeRO, the pipeline or DDP (in the manner of
Lightning's Strategy), with evaluation written once for all of them."""

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from vit.core.batch import Batch
from vit.core.settings import OptimSettings, Settings
from vit.data.sampling import PAD_LABEL
from vit.engines import registry
from vit.training.stats import PhaseTimer


@dataclass(frozen=True)
class ScalerStats:
    """fp16 steps skipped because the gradients overflowed: so far, in a row now, the longest run
    since the last statistic; and the loss scale of the next step."""

    skipped: int
    in_a_row: int
    longest: int
    scale: float


@dataclass(frozen=True)
class EngineContext:
    """What an engine is built from."""

    layers: list[nn.Module]  # the network as a flat list (vit.model.layers.build_layers)
    # the resolved DeepSpeed JSON (ddp reads its batch, precision, loss scale and clipping)
    ds_config: dict
    batch: Batch
    device: torch.device
    optim: OptimSettings
    total_steps: int  # for the LR schedule
    precision: str  # fp32, fp16 or bf16, as every rank agreed
    pipeline_stages: int = 1
    # pipeline: DeepSpeed's partition_method, or "balanced" with `parts`
    partition: str = "parameters"
    parts: list[int] | None = None  # pipeline stage boundaries for --partition balanced
    # this rank's micro-batch x data-parallel size / the micro-step's samples
    loss_weight: float = 1.0
    local_steps: list[int] | None = None  # every rank's inner steps in a window (--local-steps)
    smoothing: float = 0.0  # --smoothing, for hard labels (mixup's soft targets carry their own)
    compile: bool = False  # --compile: torch.compile the module this rank trains
    # the whole run's settings (vit.engines.registry.Settings): an engine reads its own group there
    settings: Settings = field(default_factory=lambda: registry.Settings())


class Engine(ABC):
    """One optimizer step at a time over this rank's micro-batches; nothing outside vit.engines
    knows which engine runs. A subclass sets device, dp_rank, dp_size, timer (a PhaseTimer) and
    reads_data."""

    device: torch.device
    dp_rank: int  # this rank's data-parallel index and the number of data-parallel copies
    dp_size: int
    timer: PhaseTimer
    reads_data: bool = True  # False on ranks that take no batches (a pipeline's middle stages)
    reads_images: bool = True  # False where only the labels are used (a pipeline's last stage)
    grad_accum: int  # micro-batches per step on each data-parallel copy
    optimizer: torch.optim.Optimizer
    # engines that autocast themselves (ddp, async-pipeline): the half dtype
    dtype: torch.dtype | None = None

    def autocast(self):
        """Autocast to `dtype` where the engine trains in half precision by autocast; a no-op
        elsewhere."""
        return (
            torch.autocast(self.device.type, dtype=self.dtype)
            if self.dtype
            else contextlib.nullcontext()
        )

    # a pipeline's stages (vit.core.layout.Layout), which --freeze may re-plan; None without stages
    layout = None

    @abstractmethod
    def live_module(self) -> nn.Module:
        """The module this rank trains, its state dict keyed '<layer index>.<name>' (the layers it
        holds)."""

    def gathered(self, modifier_rank: int | None = None):
        """A context in which live_module()'s parameters are whole (ZeRO-3 gathers them; elsewhere
        they are)."""
        return contextlib.nullcontext()

    def layer_state(self, state: dict | None = None) -> dict | None:
        """Collective: the whole network's state dict (layer keys) on rank 0, None elsewhere, from
        this rank's `state` (default: its live module's; the EMA's for --export)."""
        if dist.get_rank() != 0:
            return None
        return state if state is not None else self.live_module().state_dict()

    def next_on_device(self, batches: Iterator) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch on the device, copied without waiting (pinned memory on a GPU)."""
        x, y = next(batches)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    @abstractmethod
    def train_step(self, batches: Iterator) -> torch.Tensor:
        """One optimizer step over grad_accum micro-batches; this rank's share of the loss (no host
        sync)."""

    @abstractmethod
    def eval_logits(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The logits of one evaluation micro-batch, or None on ranks that compute none."""

    @abstractmethod
    def save(self, save_dir: str, tag: str, client_state: dict) -> None:
        """Collective: write this rank's part of the state into save_dir/tag."""

    @abstractmethod
    def load(self, load_dir: str, tag: str) -> dict:
        """Collective: restore from load_dir/tag; returns the client state saved with it."""

    def handover(self) -> dict:
        """Collective: what an engine rebuilt on the same weights continues from (--freeze): each
        trainable parameter's optimizer state by name, whole on every rank, the LR schedule's
        position, the loss scaler."""
        raise NotImplementedError(f"{type(self).__name__} cannot be rebuilt in place")

    def take_over(self, state: dict) -> None:
        """Continue from another engine's handover(): the parameters it no longer trains are left
        out."""
        raise NotImplementedError(f"{type(self).__name__} cannot be rebuilt in place")

    def whole_weights(self) -> dict:
        """Collective: the whole network's state dict (layer keys) on every rank, on the host, for a
        rebuilt engine."""
        return {
            k: v.detach().to("cpu", copy=True) for k, v in self.live_module().state_dict().items()
        }

    def close(self) -> None:
        """Release everything the engine holds: DeepSpeed's hooks and buffers, the process groups it
        created and every reference to its module, gradients and optimizer state (--freeze frees
        them before it builds the next engine). The engine is unusable afterwards."""

    @property
    def lr(self) -> float | torch.Tensor:
        """The learning rate of the next step: the head's under --layer-decay (the largest)."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        # device tensors updated in place (ddp's fused fp16 Adam)
        if isinstance(lrs[0], torch.Tensor):
            return torch.stack(lrs).max()
        return max(lrs)

    def scaler(self, logging: bool) -> "ScalerStats | None":
        """The fp16 loss scaler's statistic (StepStats reads it after every step, `logging` on the
        steps it logs); None when there is nothing to say at this step: no loss scaler, or one kept
        on the device, whose counts are read on logging steps only, to add no host sync a step."""
        return None

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean loss over the global batch (a collective; called on logging steps only)."""
        return mean_over_ranks(loss)

    def trained_share(self) -> tuple[float, float]:
        """The shares of the global batch and of this rank's batch that a step trains on (DiLoCo's
        proportional local steps skip some on slower workers), for images/s."""
        return 1.0, 1.0

    def train_mode(self, training: bool) -> None:
        """Switch the model between training and evaluation (dropout, drop-path)."""

    def breakdown(self, steps: int) -> dict[str, float]:
        """Mean seconds per step of each phase since the last call."""
        return self.timer.read(steps)

    @torch.no_grad()
    def evaluate(self, batches: Iterator) -> tuple[float, int, int, int]:
        """(loss sum, top-1 correct, top-5 correct, count) over every rank's batches; padding counts
        nowhere."""
        totals = torch.zeros(4, device=self.device)
        self.train_mode(False)
        with self.timer.paused():  # evaluation is no part of the training steps' breakdown
            for x, y in batches:
                logits = self.eval_logits(x, y)
                if logits is not None:
                    totals += eval_totals(logits, y)
        self.train_mode(True)
        dist.all_reduce(totals)
        loss_sum, correct, correct5, count = totals.tolist()
        return loss_sum, int(correct), int(correct5), int(count)


class StagedEngine(Engine):
    """An engine whose ranks each hold some of the layers (the pipelines): the whole state is
    gathered on rank 0."""

    def layer_state(self, state=None):
        return merged_on_rank0(state if state is not None else self.live_module().state_dict())


def save_atomic(state: dict, path: str) -> None:
    """torch.save into a temporary name, then rename: a killed save never leaves a half-written
    `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def merged_on_rank0(local: dict) -> dict | None:
    """Every rank's tensors (a pipeline stage's layers), merged on rank 0 (a collective)."""
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object({k: v.detach().cpu() for k, v in local.items()}, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts else None


def mean_over_ranks(t: torch.Tensor, group=None) -> torch.Tensor:
    """Mean of a tensor over the ranks of `group` (gloo has no ReduceOp.AVG)."""
    t = t.detach().float().clone()
    dist.all_reduce(t, group=group)
    return t / dist.get_world_size(group)


def eval_totals(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[loss sum, top-1 correct, top-5 correct, count] of one micro-batch; padding (PAD_LABEL)
    counts nowhere."""
    labels = labels.to(logits.device)
    real = labels != PAD_LABEL
    loss_sum = torch.nn.functional.cross_entropy(
        logits.float(), labels, ignore_index=PAD_LABEL, reduction="sum"
    )
    top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices == labels[:, None]
    correct, correct5 = (top[:, 0] & real).sum(), (top.any(-1) & real).sum()
    return torch.stack([loss_sum, correct.float(), correct5.float(), real.sum().float()])
