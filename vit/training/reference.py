"""A plain single-process PyTorch loop: no DeepSpeed, no DDP, no process group.

It trains the same network from the same seed on the same global batches, with the same optimizer
and LR schedule as the engines, so an engine's per-step losses can be compared with it. Its step is
also the benchmarks' baseline (bench/).
"""

import contextlib

import torch
from torch import nn

from vit.core.settings import Settings
from vit.data.augment import train_batches
from vit.data.datasets import load_dataset
from vit.model.layers import build_layers, loss_fn, model_shape
from vit.model.weights import pretrained_norm
from vit.training.optim import make_optimizer, make_scheduler


def train_step(
    model: nn.Module,
    optimizer,
    scheduler,
    batch,
    clip: float = 0.0,
    autocast=None,
    after_backward=None,
    smoothing: float = 0.0,
) -> torch.Tensor:
    """One optimizer step on one batch (images, labels); `after_backward()` runs between the
    backward pass and the update."""
    x, y = batch
    with autocast or contextlib.nullcontext():
        loss = loss_fn(model(x), y, smoothing)
    loss.backward()
    if after_backward:
        after_backward()
    if clip:
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss


def reference_losses(
    s: Settings,
    global_batch: int,
    steps: int,
    clip: float = 0.0,
    freeze_after: dict[int, int] | None = None,
) -> list[float]:
    """Per-step mean loss over each global batch, for settings `s` (model, data, seed, optimizer).
    freeze_after {step: n}: after that step the first n layers stop training (no gradient, so AdamW
    skips them)."""
    img_size = s.model.img_size or model_shape(s.model.model).img_size
    norm = pretrained_norm(s.model.model, s.model.pretrained, s.model.pretrained_path)
    data = load_dataset(
        s.data.dataset or "digits",
        s.data.data_path,
        img_size,
        seed=s.train.seed,
        synthetic_size=s.data.synthetic_size,
        norm=norm,
    )
    model = nn.Sequential(
        *build_layers(
            s.model.model,
            data.num_classes,
            data.in_chans,
            data.img_size,
            s.train.seed,
            s.model.drop_path,
            s.model.pretrained_path,
        )
    )
    opt = make_optimizer(model, s.optim, num_layers=len(model))
    sched = make_scheduler(opt, s.optim, steps)
    # Whole global batches, augmented and mixed as they are (the engines take them apart:
    # vit.data.augment).
    batches = train_batches(
        data,
        s.recipe,
        s.train.seed,
        partners=False,
        micro_batch=global_batch,
        grad_accum=1,
        dp_rank=0,
        dp_size=1,
        start_step=0,
        end_step=steps,
    )
    losses = []
    for step, batch in enumerate(batches, 1):
        losses.append(
            train_step(model, opt, sched, batch, clip, smoothing=s.recipe.smoothing).item()
        )
        model[: (freeze_after or {}).get(step, 0)].requires_grad_(False)
    return losses
