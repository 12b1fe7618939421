"""The command line and the DeepSpeed JSON, validated once, before any process group starts."""
import argparse
import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from vit.data import DATASETS
from vit.ds_schema import deepspeed_parses
from vit.ds_schema import validate as validate_ds_schema
from vit.errors import ConfigError
from vit.model import PRESETS

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("zero", "pipeline", "ddp")
DEFAULT_DS_CONFIG = {"zero": "zero2.json", "pipeline": "pipeline.json", "ddp": "zero0.json"}
PRECISIONS = ("auto", "fp32", "fp16", "bf16")
DEFAULT_FP16_SCALE_POWER = 12  # 2^16, DeepSpeed's default, overflowed on every step in users' ViT runs


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + error
        raise ConfigError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="entry_cn.sh", description="Train a Vision Transformer with DeepSpeed ZeRO, a DeepSpeed "
                "pipeline, or plain PyTorch DDP. With no options: the tiny ViT on the embedded digits data set.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--engine", choices=ENGINES, default="zero", help="training engine")
    a("--ds-config", help="DeepSpeed JSON (batch, precision, ZeRO); default deepspeed_configs/"
      + ", ".join(f"{v} for {k}" for k, v in DEFAULT_DS_CONFIG.items()))
    a("--pipeline-stages", type=int, default=2, help="pipeline engine: number of stages")
    a("--partition", default="parameters",
      help="pipeline engine: how layers are cut into stages: uniform, parameters, type:REGEX, or balanced (by the "
           "census: each rank's measured speed and free memory, and each layer's FLOPs)")
    a("--batch-split", choices=("equal", "proportional"), default="equal",
      help="zero and ddp engines: every rank the same micro-batch, or micro-batches in proportion to each rank's "
           "measured speed (within its memory), gradients weighted so the update is the same")
    a("--simulate-slowdown", metavar="RANK=FACTOR[,...]",
      help="make these ranks' compute FACTOR times slower (each layer's forward and backward is followed by a "
           "wait of FACTOR-1 times its time), to try mixed-GPU settings on identical hardware")
    a("--model", default="vit_digits", help="one of: " + ", ".join(PRESETS))
    a("--img-size", type=int, help="image side for imagefolder/synthetic (default: the model's)")
    a("--dataset", default="digits", help="one of: " + ", ".join(DATASETS))
    a("--data-path", help="folder of cifar10/cifar100 batches or of an imagefolder tree")
    a("--download", action="store_true", help="download CIFAR into --data-path if missing")
    a("--synthetic-size", type=int, default=2048, help="synthetic: number of training samples")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, help="optimizer steps to train")
    g.add_argument("--epochs", type=float, help="epochs to train (default 40 when --steps is not given)")
    a("--micro-batch-size", type=int, help="override train_micro_batch_size_per_gpu of the JSON")
    a("--grad-accum", type=int, help="override gradient_accumulation_steps of the JSON")
    a("--precision", choices=PRECISIONS,
      help="override the JSON's fp16/bf16 setting; auto: bf16 if every rank supports it, else fp16 if every rank "
           "does, else fp32")
    a("--loss-scale", choices=("config", "auto"), default="config",
      help="fp16: the JSON's initial_scale_power, or auto: a short fp32 probe of the gradients picks it")
    a("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    a("--min-lr", type=float, default=1e-5, help="learning rate at the end of the cosine")
    a("--weight-decay", type=float, default=0.05)
    a("--fused-adam", action="store_true", help="torch's fused AdamW kernel (one kernel for all parameters)")
    a("--warmup-steps", type=int, help="linear warm-up steps (default 5%% of the steps)")
    a("--log-dir", help="run output folder (default logs/<engine>-<time>)")
    a("--log-interval", type=int, default=10, help="steps between log lines and metric records")
    a("--eval-interval", type=int, default=0, help="steps between evaluations (0: only at the end)")
    a("--save-interval", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    a("--save-dir", help="checkpoint folder (default <log-dir>/checkpoints)")
    a("--no-save", action="store_true", help="write no checkpoints")
    a("--keep-checkpoints", type=int, default=3, help="complete checkpoints to keep")
    a("--resume", nargs="?", const="auto", help="continue from the newest checkpoint of --save-dir, or of PATH")
    a("--seed", type=int, default=0, help="model initialisation and data order")
    a("--monitor-interval", type=float, default=1.0, help="seconds between GPU/CPU monitor samples (0: off)")
    a("--monitor-backend", choices=("auto", "nvml", "gputil", "none"), default="auto",
      help="GPU monitor: NVML in-process, GPUtil (nvidia-smi), or none (CPU and memory only)")
    a("--workers", type=int, default=0, help="DataLoader worker processes")
    a("--hostfile", help="the launch's hostfile: the preflight checks the world size against its slots")
    # The DeepSpeed launcher passes --local_rank=N; LOCAL_RANK in the environment says the same.
    a("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    a("--dist-timeout", type=float, default=300,
      help="seconds before a process-group start or a collective fails, and before the watchdog ends a job "
           "in which no step finished")
    a("--max-skipped-steps", type=int, default=20,
      help="fp16: stop after this many overflow-skipped steps in a row")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    positive = ["pipeline_stages", "synthetic_size", "steps", "micro_batch_size", "grad_accum", "log_interval",
                "keep_checkpoints", "max_skipped_steps"]
    for name in positive:
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {v}")
    for name in ["epochs", "lr", "dist_timeout"]:
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {v}")
    for name in ["eval_interval", "save_interval", "workers", "warmup_steps", "monitor_interval"]:
        v = getattr(args, name)
        if v is not None and v < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must not be negative, got {v}")
    if args.model not in PRESETS:
        raise ConfigError(f"unknown model '{args.model}'; choose one of: {', '.join(PRESETS)}")
    if args.dataset not in DATASETS:
        raise ConfigError(f"unknown dataset '{args.dataset}'; choose one of: {', '.join(DATASETS)}")
    if args.partition not in ("uniform", "parameters", "balanced") and not args.partition.startswith("type:"):
        raise ConfigError(f"--partition must be uniform, parameters, balanced or type:REGEX, got '{args.partition}'")
    if args.partition == "balanced" and args.engine != "pipeline":
        raise ConfigError("--partition balanced applies to --engine pipeline")
    if args.batch_split == "proportional" and args.engine == "pipeline":
        raise ConfigError("--batch-split proportional applies to --engine zero or ddp (a pipeline balances its "
                          "stages with --partition balanced)")
    if args.hostfile and not Path(args.hostfile).is_file():
        raise ConfigError(f"--hostfile {args.hostfile}: no such file")
    if args.ds_config is None:
        args.ds_config = str(ROOT / "deepspeed_configs" / DEFAULT_DS_CONFIG[args.engine])
    if args.epochs is None and args.steps is None:
        args.epochs = 40.0
    return args


def load_json(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"DeepSpeed config {path}: no such file")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {path}: invalid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"DeepSpeed config {path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


@dataclass
class Batch:
    micro: int
    grad_accum: int
    dp_size: int

    @property
    def global_size(self) -> int:
        return self.micro * self.grad_accum * self.dp_size


def zero_stage(cfg: dict) -> int:
    return cfg.get("zero_optimization", {}).get("stage", 0)


def precision_of(cfg: dict) -> str:
    fp16, bf16 = cfg.get("fp16", {}).get("enabled", False), cfg.get("bf16", {}).get("enabled", False)
    if fp16 and bf16:
        raise ConfigError("DeepSpeed config enables both fp16 and bf16")
    return "fp16" if fp16 else "bf16" if bf16 else "fp32"


def resolve_ds_config(args, world_size: int) -> tuple[dict, Batch]:
    """The DeepSpeed JSON with command-line overrides applied and the batch arithmetic checked."""
    cfg = copy.deepcopy(load_json(args.ds_config))
    name = args.ds_config
    validate_ds_schema(cfg, name)
    for key in ("optimizer", "scheduler"):
        if key in cfg:
            raise ConfigError(f"DeepSpeed config {name}: remove '{key}'; the optimizer (AdamW) and the LR schedule "
                              "come from --lr/--min-lr/--weight-decay/--warmup-steps, so every engine, ddp "
                              "included, trains the same way")
    stage = zero_stage(cfg)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"DeepSpeed config {name}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if args.engine == "pipeline" and stage > 1:
        raise ConfigError(f"DeepSpeed config {name}: ZeRO stage {stage} does not work with the pipeline engine "
                          "(DeepSpeed pipelines accept ZeRO 0 or 1)")
    if args.engine == "ddp" and stage > 0:
        print(f"warning: --engine ddp ignores zero_optimization (stage {stage}) in {name}", file=sys.stderr)

    stages = args.pipeline_stages if args.engine == "pipeline" else 1
    if world_size % stages:
        raise ConfigError(f"--pipeline-stages {stages} does not divide the world size {world_size}")
    dp_size = world_size // stages

    if args.micro_batch_size or args.grad_accum:
        cfg.pop("train_batch_size", None)  # recomputed from the overrides
    if args.micro_batch_size:
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    if args.grad_accum:
        cfg["gradient_accumulation_steps"] = args.grad_accum
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        v = cfg.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ConfigError(f"DeepSpeed config {name}: {key} must be a positive integer, got {v!r}")
    gas = cfg.get("gradient_accumulation_steps", 1)
    micro = cfg.get("train_micro_batch_size_per_gpu")
    total = cfg.get("train_batch_size")
    if micro is None:
        if total is None:
            raise ConfigError(f"DeepSpeed config {name}: set train_micro_batch_size_per_gpu (or train_batch_size)")
        if total % (gas * dp_size):
            raise ConfigError(f"batch arithmetic: train_batch_size {total} is not divisible by "
                              f"gradient_accumulation_steps {gas} x data-parallel size {dp_size}")
        micro = total // (gas * dp_size)
    batch = Batch(micro, gas, dp_size)
    if total is not None and total != batch.global_size:
        raise ConfigError(f"batch arithmetic: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} "
                          f"x gradient_accumulation_steps {gas} x data-parallel size {dp_size} "
                          f"(= {batch.global_size}; world size {world_size}, pipeline stages {stages})")
    cfg.update(train_batch_size=batch.global_size, train_micro_batch_size_per_gpu=micro,
               gradient_accumulation_steps=gas)

    if args.precision and args.precision != "auto":
        set_precision(cfg, args.precision)
    precision_of(cfg)  # both enabled is an error
    if args.loss_scale == "auto" and args.precision != "auto" and precision_of(cfg) != "fp16":
        raise ConfigError(f"--loss-scale auto tunes fp16, but the precision is {precision_of(cfg)}")
    deepspeed_parses(cfg, name)
    return cfg, batch


def set_precision(cfg: dict, precision: str) -> None:
    cfg.setdefault("fp16", {})["enabled"] = precision == "fp16"
    cfg.setdefault("bf16", {})["enabled"] = precision == "bf16"
    if precision == "fp16":
        cfg["fp16"].setdefault("initial_scale_power", DEFAULT_FP16_SCALE_POWER)
