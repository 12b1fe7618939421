"""--engine ddp resuming a checkpoint of --engine zero (stage 1 to 3): vit.checkpoints.checkpoint
has it converted to DeepSpeed's universal checkpoint (one folder per parameter: its fp32 weights,
AdamW's exp_avg and exp_avg_sq, and its step for stages 1 and 2; stage 3 keeps the step in
zero/optimizer_state.pt), from which the weights and torch's AdamW state are set by name; the LR
schedule's position and the client state come from DeepSpeed's model-states file."""

from pathlib import Path

import torch

from vit.training.optim import move_schedule, put_adam_state

# DeepSpeed's, beside the universal zero/ folder: stages 1 and 2, then stage 3 (one per rank)
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
DEEPSPEED_KEYS = ("module", "optimizer", "lr_scheduler")


def is_universal(folder: Path) -> bool:
    return (folder / "zero").is_dir() and model_states(folder) is not None


def model_states(folder: Path) -> Path | None:
    return next((folder / n for n in MODEL_STATES if (folder / n).is_file()), None)


def load(folder: Path, module, optimizer, scheduler) -> dict:
    """The universal checkpoint in `folder` into `module`, `optimizer` (torch's AdamW, the same
    parameter groups as the ZeRO run's: vit.training.optim.make_optimizer) and `scheduler`; the
    client state the ZeRO run saved."""
    adam, step3 = {}, []  # stage 3's one step, read once
    with torch.no_grad():
        for name, p in module.named_parameters():
            part = folder / "zero" / name
            if not (part / "fp32.pt").is_file():
                raise RuntimeError(f"{folder}: no weights of parameter {name} in its zero/ folder")
            p.copy_(read(part / "fp32.pt").view_as(p))
            if (part / "exp_avg.pt").is_file():
                if (part / "step.pt").is_file():
                    step = torch.load(part / "step.pt", weights_only=False)
                else:
                    step3 = step3 or [stage3_step(folder)]
                    step = step3[0]
                adam[name] = {
                    "step": torch.tensor(float(step), dtype=torch.float32),
                    **{k: read(part / f"{k}.pt").view_as(p) for k in ("exp_avg", "exp_avg_sq")},
                }
    put_adam_state(optimizer, module, adam)
    states = torch.load(model_states(folder), map_location="cpu", weights_only=False)
    # DeepSpeed's schedule (torch's LambdaLR) steps only where the optimizer did, as ours do; the
    # LR is set now, as DeepSpeed's load did (loading LambdaLR's state alone leaves the LR at its
    # first value until its next step)
    move_schedule(scheduler, states["lr_scheduler"]["last_epoch"])
    return {k: v for k, v in states.items() if k not in DEEPSPEED_KEYS}


def stage3_step(folder: Path):
    saved = torch.load(folder / "zero" / "optimizer_state.pt", weights_only=False)
    return next(iter(saved["optimizer_state_dict"]["state"].values()))["step"]


def read(path: Path) -> torch.Tensor:
    from deepspeed.checkpoint.constants import PARAM  # a ddp run imports DeepSpeed only here

    saved = torch.load(path, map_location="cpu", weights_only=False)
    return saved[PARAM] if isinstance(saved, dict) else saved
