"""Training engines, one module each, behind one small interface:

    engine = build(name, ctx)          # ctx: EngineContext
    loss = engine.train_step(batches)  # one optimizer step over grad_accum micro-batches; returns
                                       # this rank's share of the loss (a tensor, no host sync)
    engine.mean_loss(loss)             # the mean loss over the global batch (a collective; on logging steps)
    loss_sum, correct, count = engine.evaluate(batches)   # totals over every rank
    engine.save(save_dir, tag, client_state); client_state = engine.load(load_dir, tag)
    engine.breakdown(steps)            # mean seconds per step of each phase since the last call
    engine.lr, engine.skipped_steps, engine.dp_rank, engine.dp_size, engine.reads_data

Nothing outside this package knows which engine runs.
"""
import importlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from vit.config import Batch
from vit.data import PAD_LABEL


@dataclass
class EngineContext:
    args: object  # the parsed command line
    layers: list[nn.Module]
    ds_config: dict
    batch: Batch
    device: torch.device
    total_steps: int
    precision: str
    loss_weight: float = 1.0  # this rank's micro-batch x data-parallel size / the micro-step's samples
    parts: list[int] | None = None  # pipeline stage boundaries for --partition balanced


def build(name: str, ctx: EngineContext):
    return importlib.import_module(f"vit.engines.{name}").build(ctx)


def deepspeed_comm():
    """DeepSpeed's comm layer over the torch.distributed group that is already running."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())


class DeepSpeedEngine:
    """What the DeepSpeed engines share; a subclass sets self.engine, self.optimizer and self.timer."""

    @property
    def skipped_steps(self) -> int:
        """fp16 steps DeepSpeed skipped because the gradients overflowed."""
        return self.engine.skipped_steps

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def breakdown(self, steps: int) -> dict[str, float]:
        return self.timer.read(steps)

    def save(self, save_dir, tag, client_state):
        # No 'latest' from DeepSpeed: vit.checkpoint points at a checkpoint once it is complete.
        self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)

    def load(self, load_dir, tag):
        path, client_state = self.engine.load_checkpoint(load_dir, tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {load_dir}")
        return client_state


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only, not on biases, norms, class token or position embedding."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 and "token" not in name and "pos_embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, args, cpu_offload: bool = False) -> torch.optim.Optimizer:
    groups = param_groups(model, args.weight_decay)
    if cpu_offload:  # DeepSpeed wants its own CPU Adam next to ZeRO-Offload
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=args.lr, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=args.lr, fused=True if args.fused_adam else None)


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """LR multiplier for optimizer step `step` (0-based): linear warm-up, then cosine down to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(opt: torch.optim.Optimizer, args, total_steps: int):
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, total_steps // 20)
    min_ratio = args.min_lr / args.lr
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, total_steps, warmup, min_ratio))


def mean_over_ranks(t: torch.Tensor, group=None) -> torch.Tensor:
    """Mean of a tensor over the ranks of `group` (gloo has no ReduceOp.AVG)."""
    t = t.detach().float().clone()
    dist.all_reduce(t, group=group)
    return t / dist.get_world_size(group)


def eval_totals(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[loss sum, correct, count] of one micro-batch; padding (PAD_LABEL) counts nowhere."""
    labels = labels.to(logits.device)
    real = labels != PAD_LABEL
    loss_sum = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=PAD_LABEL, reduction="sum")
    correct = ((logits.argmax(-1) == labels) & real).sum()
    return torch.stack([loss_sum, correct.float(), real.sum().float()])


def sum_over_ranks(totals: torch.Tensor) -> tuple[float, int, int]:
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum, int(correct), int(count)
