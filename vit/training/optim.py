"""The optimizer (AdamW, or SGD with momentum), its parameter groups and the LR schedule (linear
warm-up, then cosine), shared by every engine, the single-process reference loop and the benchmarks,
so that all of them train the same way."""

import math

import torch
from torch import nn

from vit.core.errors import ConfigError
from vit.core.settings import OptimSettings


def param_groups(
    model: nn.Module,
    weight_decay: float,
    lr: float = 0.0,
    layer_decay: float | None = None,
    num_layers: int = 0,
) -> list[dict]:
    """Weight decay on matrices only, not on biases, norms, class token or position embedding. With
    layer_decay, timm's param_groups_layer_decay rule: layer i of the list (embedding 0, blocks,
    head last) learns at lr x layer_decay^(num_layers - 1 - i), except the final norm, which timm
    scales with the last block. The layer id is the index in the whole list ('3.attn.qkv.weight' is
    layer 3), so a pipeline stage holding some of the layers scales them as a single process does.
    """
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
            groups[key] = {
                "params": [],
                "weight_decay": weight_decay if decay else 0.0,
                "lr": lr * scale,
            }
        groups[key]["params"].append(p)
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0], not k[1]))]


def use_fused(opt: OptimSettings, device: torch.device | str) -> bool:
    """Fused AdamW on CUDA by default: one kernel for all parameters, and under a GradScaler it
    skips an overflowed step on the device instead of reading found_inf on the host. On CPU only
    with --fused-adam (the CPU default stays torch's for-loop AdamW, so CPU runs are unchanged)."""
    return opt.fused_adam or torch.device(device).type == "cuda"


def make_optimizer(
    model: nn.Module,
    opt: OptimSettings,
    cpu_offload: bool = False,
    num_layers: int = 0,
    device: torch.device | str | None = None,
) -> torch.optim.Optimizer:
    """device: where the parameters will train (default: where they are now)."""
    groups = param_groups(model, opt.weight_decay, opt.lr, opt.layer_decay, num_layers)
    if cpu_offload:  # DeepSpeed wants its own CPU Adam next to ZeRO-Offload
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        if opt.opt != "adamw":
            raise ConfigError(
                f"--opt {opt.opt}: ZeRO-Offload trains with DeepSpeed's CPU Adam; use --opt adamw"
            )

        return DeepSpeedCPUAdam(groups, lr=opt.lr, adamw_mode=True)
    device = device if device is not None else next(model.parameters()).device
    if opt.opt == "sgd":
        return torch.optim.SGD(groups, lr=opt.lr, momentum=opt.momentum, nesterov=opt.nesterov)
    return torch.optim.AdamW(groups, lr=opt.lr, fused=True if use_fused(opt, device) else None)


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """LR multiplier for optimizer step `step` (0-based): linear warm-up, then cosine down to
    min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_steps(opt: OptimSettings, total_steps: int) -> int:
    return opt.warmup_steps if opt.warmup_steps is not None else max(1, total_steps // 20)


def make_scheduler(optimizer: torch.optim.Optimizer, opt: OptimSettings, total_steps: int):
    warmup, min_ratio = warmup_steps(opt, total_steps), opt.min_lr / opt.lr
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, total_steps, warmup, min_ratio)
    )


class SkipAwareSchedule:
    """The same warm-up/cosine LR, advanced only by the steps the GradScaler applied (DeepSpeed's
    schedule also holds still on an overflow-skipped step). The LR and the count of applied steps
    stay on the device, so fp16 needs no host sync per step to know whether a step was skipped; the
    optimizer reads the LR as a tensor."""

    def __init__(self, optimizer: torch.optim.Optimizer, opt: OptimSettings, total_steps: int):
        device = optimizer.param_groups[0]["params"][0].device
        self.total, self.warmup, self.min_ratio = (
            total_steps,
            warmup_steps(opt, total_steps),
            opt.min_lr / opt.lr,
        )
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        # optimizer steps taken, skips excluded
        self.applied = torch.zeros((), dtype=torch.float64, device=device)
        for group in optimizer.param_groups:
            group["lr"] = torch.zeros((), dtype=torch.float32, device=device)
        self.optimizer = optimizer
        self._set_lr()

    def _set_lr(self) -> None:
        step, warmup = self.applied, self.warmup
        progress = ((step - warmup) / max(1, self.total - warmup)).clamp(max=1.0)
        cosine = self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + torch.cos(math.pi * progress))
        factor = torch.where(step < warmup, (step + 1) / warmup, cosine)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"].copy_(factor * base)

    def step(self, applied: torch.Tensor) -> None:
        """applied: a 0-d bool tensor, False when the GradScaler skipped this step."""
        self.applied += applied
        self._set_lr()

    def state_dict(self) -> dict:
        return {"applied": self.applied.item()}

    def load_state_dict(self, state: dict) -> None:
        self.applied.fill_(state["applied"])
        self._set_lr()


def schedule_position(scheduler) -> float:
    """Where an LR schedule is: optimizer steps taken (applied ones for SkipAwareSchedule)."""
    return (
        scheduler.state_dict()["applied"]
        if isinstance(scheduler, SkipAwareSchedule)
        else scheduler.last_epoch
    )


def move_schedule(scheduler, position: float) -> None:
    """Put a fresh schedule (of an optimizer with fewer parameter groups, --freeze) where another
    one was."""
    if isinstance(scheduler, SkipAwareSchedule):
        scheduler.load_state_dict({"applied": position})
        return
    scheduler.last_epoch = position
    groups = scheduler.optimizer.param_groups
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(position)
    scheduler._last_lr = [group["lr"] for group in groups]  # noqa: SLF001 (what get_last_lr() reads)


def adam_state(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict:
    """A torch optimizer's per-parameter state by parameter name, on the host (--freeze holds it
    there while the engine is rebuilt, so that the old engine's memory is free first)."""
    names = {p: n for n, p in module.named_parameters()}
    return {
        names[p]: {k: v.cpu() if torch.is_tensor(v) else v for k, v in st.items()}
        for p, st in optimizer.state.items()
    }


def put_adam_state(optimizer: torch.optim.Optimizer, module: nn.Module, state: dict) -> None:
    """adam_state()'s values into the optimizer of a module with the same names, for the parameters
    it trains."""
    groups = {p: g for g in optimizer.param_groups for p in g["params"]}
    for name, p in module.named_parameters():
        if p.requires_grad and name in state:
            # torch keeps AdamW's step on the host unless the optimizer is fused or capturable
            # (torch.optim's rule).
            step_on = p.device if groups[p].get("fused") or groups[p].get("capturable") else "cpu"
            optimizer.state[p] = {
                k: v.to(step_on if k == "step" else p.device) if torch.is_tensor(v) else v
                for k, v in state[name].items()
            }
