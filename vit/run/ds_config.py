"""The DeepSpeed JSON: read, checked against what DeepSpeed reads (vit.run.ds_schema),
command-line overrides applied and the batch arithmetic checked, before any process group starts.
Functions return new dicts; nothing here edits a config in place."""

import copy
import json
from pathlib import Path

from vit.core.batch import Batch
from vit.core.errors import ConfigError
from vit.core.onebit import check_json_optimizer
from vit.core.settings import DEFAULT_FP16_SCALE_POWER, ParallelSettings
from vit.engines.registry import spec
from vit.run.compat import check_comm_dtype, check_zero_stage
from vit.run.ds_schema import deepspeed_parses
from vit.run.ds_schema import validate as validate_ds_schema


def load_json(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"DeepSpeed config {path}: no such file")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {path}: invalid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(
            f"DeepSpeed config {path}: expected a JSON object, got {type(cfg).__name__}"
        )
    return cfg


def zero_stage(cfg: dict) -> int:
    return cfg.get("zero_optimization", {}).get("stage", 0)


def precision_of(cfg: dict) -> str:
    fp16, bf16 = (
        cfg.get("fp16", {}).get("enabled", False),
        cfg.get("bf16", {}).get("enabled", False),
    )
    if fp16 and bf16:
        raise ConfigError("DeepSpeed config enables both fp16 and bf16")
    return "fp16" if fp16 else "bf16" if bf16 else "fp32"


def with_precision(cfg: dict, precision: str, scale_power: int | None = None) -> dict:
    """A copy of cfg that trains in `precision`; fp16 gets `scale_power` (or the JSON's, or ours) as
    its initial loss scale power."""
    out = copy.deepcopy(cfg)
    out.setdefault("fp16", {})["enabled"] = precision == "fp16"
    out.setdefault("bf16", {})["enabled"] = precision == "bf16"
    if precision == "fp16":
        out["fp16"].setdefault("initial_scale_power", DEFAULT_FP16_SCALE_POWER)
        if scale_power is not None:
            out["fp16"]["initial_scale_power"] = scale_power
    return out


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _batch(cfg: dict, name: str, dp_size: int, world_size: int, stages: int) -> Batch:
    for key in BATCH_KEYS:
        v = cfg.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ConfigError(
                f"DeepSpeed config {name}: {key} must be a positive integer, got {v!r}"
            )
    grad_accum = cfg.get("gradient_accumulation_steps", 1)
    micro = cfg.get("train_micro_batch_size_per_gpu")
    total = cfg.get("train_batch_size")
    if micro is None:
        if total is None:
            raise ConfigError(
                f"DeepSpeed config {name}: set train_micro_batch_size_per_gpu (or train_batch_size)"
            )
        if total % (grad_accum * dp_size):
            raise ConfigError(
                f"batch arithmetic: train_batch_size {total} is not divisible by "
                f"gradient_accumulation_steps {grad_accum} x data-parallel size {dp_size}"
            )
        micro = total // (grad_accum * dp_size)
    batch = Batch(micro, grad_accum, dp_size)
    if total is not None and total != batch.global_size:
        raise ConfigError(
            f"batch arithmetic: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} "
            f"x gradient_accumulation_steps {grad_accum} x data-parallel size {dp_size} (= "
            f"{batch.global_size}; world size {world_size}, pipeline stages {stages})"
        )
    return batch


def resolve(par: ParallelSettings, world_size: int) -> tuple[dict, Batch]:
    """The DeepSpeed JSON with command-line overrides applied and the batch arithmetic checked."""
    name = par.ds_config
    cfg = copy.deepcopy(load_json(name))
    validate_ds_schema(cfg, name)
    check_json_optimizer(cfg, name)  # a 1-bit optimizer: its own reason
    for key in ("optimizer", "scheduler"):
        if key in cfg:
            raise ConfigError(
                f"DeepSpeed config {name}: remove '{key}'; the optimizer (AdamW) "
                "and the LR schedule come from --lr/--min-lr/--weight-decay/--warmup-steps, so "
                "every engine, ddp included, trains the same way"
            )
    stage = zero_stage(cfg)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(
            f"DeepSpeed config {name}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}"
        )
    check_zero_stage(par.engine, stage, name)
    check_comm_dtype(par.engine, cfg, name)

    stages = par.pipeline_stages if spec(par.engine).pipeline else 1
    if world_size % stages:
        raise ConfigError(f"--pipeline-stages {stages} does not divide the world size {world_size}")
    if par.micro_batch_size or par.grad_accum:
        cfg.pop("train_batch_size", None)  # recomputed from the overrides
    # auto: the JSON's until vit.planner.fit measures
    if par.micro_batch_size and par.micro_batch_size != "auto":
        cfg["train_micro_batch_size_per_gpu"] = par.micro_batch_size
    if par.grad_accum:
        cfg["gradient_accumulation_steps"] = par.grad_accum
    batch = _batch(cfg, name, world_size // stages, world_size, stages)
    cfg.update(
        train_batch_size=batch.global_size,
        train_micro_batch_size_per_gpu=batch.micro_batch,
        gradient_accumulation_steps=batch.grad_accum,
    )

    if par.precision and par.precision != "auto":
        cfg = with_precision(cfg, par.precision)
    precision = precision_of(cfg)  # both enabled is an error
    if par.loss_scale == "auto" and par.precision != "auto" and precision != "fp16":
        raise ConfigError(f"--loss-scale auto tunes fp16, but the precision is {precision}")
    deepspeed_parses(cfg, name)
    return cfg, batch
