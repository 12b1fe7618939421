"""A plain single-process PyTorch loop: no DeepSpeed, no DDP, no process group.

It trains the same network from the same seed on the same global batches, with the same optimizer and
LR schedule as the engines, so an engine's per-step losses can be compared with it.
"""
import torch
from torch import nn

from vit.data import TrainBatches, load_dataset, make_loader
from vit.engines import make_optimizer, make_scheduler
from vit.model import PRESETS, build_layers, loss_fn


def reference_losses(args, global_batch: int, steps: int, clip: float = 0.0) -> list[float]:
    """Per-step mean loss over each global batch, for parsed `args` (model, dataset, seed, lr...)."""
    data = load_dataset(args.dataset, args.data_path, args.img_size or PRESETS[args.model].img_size,
                        seed=args.seed, synthetic_size=args.synthetic_size)
    model = nn.Sequential(*build_layers(args.model, data.num_classes, data.in_chans, data.img_size, args.seed))
    opt = make_optimizer(model, args)
    sched = make_scheduler(opt, args, steps)
    batches = make_loader(data.train, TrainBatches(len(data.train), global_batch, 1, 0, 1, args.seed, 0, steps), 0,
                          False)
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
    return losses
