"""The optimizer (AdamW), its parameter groups and the LR schedule (linear warm-up, then cosine), shared by every
engine, the single-process reference loop and the benchmarks, so that all of them train the same way."""
import math

import torch
from torch import nn

from vit.settings import OptimSettings


def param_groups(model: nn.Module, weight_decay: float, lr: float = 0.0, layer_decay: float | None = None,
                 num_layers: int = 0) -> list[dict]:
    """Weight decay on matrices only, not on biases, norms, class token or position embedding. With layer_decay,
    timm's param_groups_layer_decay rule: layer i of the list (embedding 0, blocks, head last) learns at
    lr x layer_decay^(num_layers - 1 - i), except the final norm, which timm scales with the last block. The layer
    id is the index in the whole list ('3.attn.qkv.weight' is layer 3), so a pipeline stage holding some of the
    layers scales them as a single process does."""
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.ndim >= 2 and "token" not in name and "pos_embed" not in name
        layer = int(name.split(".")[0]) if layer_decay else 0
        if layer_decay and layer == num_layers - 1 and name.split(".")[1] == "norm":
            layer -= 1
        key = (layer, decay)
        if key not in groups:
            scale = layer_decay ** (num_layers - 1 - layer) if layer_decay else 1.0
            groups[key] = {"params": [], "weight_decay": weight_decay if decay else 0.0, "lr": lr * scale}
        groups[key]["params"].append(p)
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0], not k[1]))]


def make_optimizer(model: nn.Module, opt: OptimSettings, cpu_offload: bool = False,
                   num_layers: int = 0) -> torch.optim.Optimizer:
    groups = param_groups(model, opt.weight_decay, opt.lr, opt.layer_decay, num_layers)
    if cpu_offload:  # DeepSpeed wants its own CPU Adam next to ZeRO-Offload
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=opt.lr, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=opt.lr, fused=True if opt.fused_adam else None)


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """LR multiplier for optimizer step `step` (0-based): linear warm-up, then cosine down to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_steps(opt: OptimSettings, total_steps: int) -> int:
    return opt.warmup_steps if opt.warmup_steps is not None else max(1, total_steps // 20)


def make_scheduler(optimizer: torch.optim.Optimizer, opt: OptimSettings, total_steps: int):
    warmup, min_ratio = warmup_steps(opt, total_steps), opt.min_lr / opt.lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, total_steps, warmup, min_ratio))
