"""The command line as typed settings: one dataclass per concern, each field declared once with its help and its
check, the parser generated from them, and every value validated before any process group starts.

`Settings()` is the defaults; `parse(argv)` the command line. Code reads the group it needs (`settings.optim`,
`settings.data`, ...), never an argparse Namespace.
"""
import argparse
import importlib.util
import math
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from vit.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("zero", "pipeline", "ddp")
DEFAULT_DS_CONFIG = {"zero": "zero2.json", "pipeline": "pipeline.json", "ddp": "zero0.json"}
PRECISIONS = ("auto", "fp32", "fp16", "bf16")
DATASETS = ("digits", "cifar10", "cifar100", "imagefolder", "synthetic")
DEFAULT_EPOCHS = 40.0
TRACKERS = ("tensorboard", "wandb", "csv")


def option(default, help: str, check: str | None = None, **cli):
    """A settings field: its default, its --help text, `check` ('positive' or 'non_negative'; every float must
    also be finite) and extra argparse arguments (choices, metavar, flag, ...)."""
    return field(default=default, metadata={"help": help, "check": check, "cli": cli})


@dataclass(frozen=True)
class ModelSettings:
    model: str = option("vit_digits", "model preset (see vit/model.py)")
    img_size: int | None = option(None, "image side for imagefolder/synthetic (default: the model's)", "positive")


@dataclass(frozen=True)
class DataSettings:
    dataset: str | None = option(None, "data set (default: the one --data-path holds, else digits)",
                                 choices=DATASETS)
    data_path: str | None = option(None, "folder of cifar10/cifar100 batches or of an imagefolder tree")
    download: bool = option(False, "download CIFAR into --data-path if missing")
    synthetic_size: int = option(2048, "synthetic: number of training samples", "positive")
    workers: int | None = option(None, "DataLoader worker processes (default: 0 on CPU; on GPU up to 4 per rank, "
                                 "one core left to the training loop)", "non_negative")


@dataclass(frozen=True)
class ParallelSettings:
    engine: str = option("zero", "training engine", choices=ENGINES)
    ds_config: str | None = option(None, "DeepSpeed JSON (batch, precision, ZeRO); default deepspeed_configs/"
                                   + ", ".join(f"{v} for {k}" for k, v in DEFAULT_DS_CONFIG.items()))
    pipeline_stages: int = option(2, "pipeline engine: number of stages", "positive")
    partition: str = option("parameters", "pipeline engine: how layers are cut into stages: uniform, parameters, "
                            "type:REGEX, or balanced (by the census: each rank's measured speed and free memory, "
                            "and each layer's FLOPs)")
    batch_split: str = option("equal", "zero and ddp engines: every rank the same micro-batch, or micro-batches in "
                              "proportion to each rank's measured speed (within its memory), gradients weighted so "
                              "the update is the same", choices=("equal", "proportional"))
    simulate_slowdown: str | None = option(None, "make these ranks' compute FACTOR times slower (each layer's "
                                           "forward and backward is followed by a wait of FACTOR-1 times its time), "
                                           "to try mixed-GPU settings on identical hardware",
                                           metavar="RANK=FACTOR[,...]")
    micro_batch_size: int | str | None = option(
        None, "override train_micro_batch_size_per_gpu of the JSON; auto: the largest whose forward and backward fit "
        "every rank's free memory with headroom (zero, ddp; with --batch-split proportional, one per rank)",
        type=lambda v: v if v == "auto" else _positive_int(v), metavar="N|auto")
    grad_accum: int | None = option(None, "override gradient_accumulation_steps of the JSON", "positive")
    precision: str | None = option(None, "override the JSON's fp16/bf16 setting; auto: bf16 if every rank supports "
                                   "it, else fp16 if every rank does, else fp32 (the default on GPUs when neither "
                                   "this nor the JSON names one)", choices=PRECISIONS)
    tf32: str = option("on", "fp32 matmuls and convolutions in TF32 on Ampere and newer GPUs (no effect elsewhere)",
                       choices=("on", "off"))
    loss_scale: str = option("config", "fp16: the JSON's initial_scale_power, or auto: a short fp32 probe of the "
                             "gradients picks it", choices=("config", "auto"))


@dataclass(frozen=True)
class OptimSettings:
    lr: float = option(2e-3, "peak learning rate (AdamW)", "positive")
    min_lr: float = option(1e-5, "learning rate at the end of the cosine", "non_negative")
    weight_decay: float = option(0.05, "AdamW weight decay (not on biases, norms and embeddings)", "non_negative")
    warmup_steps: int | None = option(None, "linear warm-up steps (default 5%% of the steps)", "non_negative")
    fused_adam: bool = option(False, "torch's fused AdamW kernel (one kernel for all parameters)")


@dataclass(frozen=True)
class TrainSettings:
    steps: int | None = option(None, "optimizer steps to train", "positive", exclusive="length")
    epochs: float | None = option(None, f"epochs to train (default {DEFAULT_EPOCHS:g} when --steps is not given)",
                                  "positive", exclusive="length")
    seed: int = option(0, "model initialisation and data order")
    eval_interval: int = option(0, "steps between evaluations (0: only at the end)", "non_negative")
    max_skipped_steps: int = option(20, "fp16: stop after this many overflow-skipped steps in a row", "positive")


@dataclass(frozen=True)
class CheckpointSettings:
    save_interval: int = option(0, "steps between checkpoints (0: only at the end)", "non_negative")
    save_dir: str | None = option(None, "checkpoint folder (default <log-dir>/checkpoints)")
    no_save: bool = option(False, "write no checkpoints")
    keep_checkpoints: int = option(3, "complete checkpoints to keep", "positive")
    resume: str | None = option(None, "continue from the newest checkpoint of --save-dir, or of PATH",
                                nargs="?", const="auto", metavar="PATH")


@dataclass(frozen=True)
class LogSettings:
    log_dir: str | None = option(None, "run output folder (default logs/<engine>-<time>)")
    log_interval: int = option(10, "steps between log lines and metric records", "positive")
    monitor_interval: float = option(1.0, "seconds between GPU/CPU monitor samples (0: off)", "non_negative")
    monitor_backend: str = option("auto", "GPU monitor: NVML in-process, GPUtil (nvidia-smi), or none (CPU and "
                                  "memory only)", choices=("auto", "nvml", "gputil", "none"))
    report_to: str = option("none", "rank 0 also sends the metrics to these trackers, comma-separated: none, "
                            "tensorboard (<log-dir>/tensorboard), wandb (WANDB_MODE=offline: no network), csv "
                            "(<log-dir>/tracking.csv)", metavar="LIST")
    verbose: bool = option(False, "print the libraries' notes and warnings (DeepSpeed, torch, timm) and every rank's "
                           "notes instead of keeping them in <log-dir>/warnings_rank<R>.log")


@dataclass(frozen=True)
class ClusterSettings:
    hostfile: str | None = option(None, "the launch's hostfile: the preflight checks the world size against its "
                                  "slots")
    device: str = option("auto", "cuda: every rank on its GPU (nccl), cpu: on the CPU (gloo); auto: cuda when every "
                         "rank has a usable GPU, cpu when none has one; any mix is an error",
                         choices=("auto", "cuda", "cpu"))
    dist_timeout: float = option(300.0, "seconds before a process-group start or a collective fails, and before "
                                 "the watchdog ends a job in which no step finished", "positive")
    # The DeepSpeed launcher passes --local_rank=N; LOCAL_RANK in the environment says the same.
    local_rank: int | None = option(None, argparse.SUPPRESS, flag=("--local_rank", "--local-rank"))


GROUPS = {  # attribute of Settings -> (class, --help section title)
    "model": (ModelSettings, "model"), "data": (DataSettings, "data"),
    "parallel": (ParallelSettings, "engine, parallelism and precision"), "optim": (OptimSettings, "optimizer"),
    "train": (TrainSettings, "training length and evaluation"), "checkpoint": (CheckpointSettings, "checkpoints"),
    "log": (LogSettings, "logs and monitoring"), "cluster": (ClusterSettings, "cluster"),
}


@dataclass(frozen=True)
class Settings:
    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    log: LogSettings = field(default_factory=LogSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)

    def flat(self) -> dict:
        """Every option by its name, as config.json records them."""
        return {k: v for group in asdict(self).values() for k, v in group.items()}

    def with_(self, **changes) -> "Settings":
        """A copy with options changed by name, whatever their group (for tests, benchmarks and tools)."""
        groups = {}
        for name, (cls, _) in GROUPS.items():
            mine = {k: v for k, v in changes.items() if k in {f.name for f in fields(cls)}}
            if mine:
                groups[name] = replace(getattr(self, name), **mine)
        unknown = set(changes) - {k for g in groups.values() for k in asdict(g)}
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
        return replace(self, **groups)


def flag(f) -> tuple[str, ...]:
    given = f.metadata["cli"].get("flag")
    if given:
        return given if isinstance(given, tuple) else (given,)
    return ("--" + f.name.replace("_", "-"),)


def _base_type(f):
    args = [t for t in typing.get_args(f.type) if t is not type(None)]
    return args[0] if args else f.type


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except where there is none to show."""

    def _get_help_string(self, action):
        if action.default in (None, False, ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + error
        raise ConfigError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="entry_cn.sh", description="Train a Vision Transformer with DeepSpeed ZeRO, a DeepSpeed "
                "pipeline, or plain PyTorch DDP. With no options: the tiny ViT on the embedded digits data set.",
                formatter_class=HelpFormatter)
    for cls, title in GROUPS.values():
        group, exclusive = p.add_argument_group(title), {}
        for f in fields(cls):
            cli = {k: v for k, v in f.metadata["cli"].items() if k not in ("flag", "exclusive")}
            if "exclusive" in f.metadata["cli"]:
                name = f.metadata["cli"]["exclusive"]
                if name not in exclusive:
                    exclusive[name] = group.add_mutually_exclusive_group()
                target = exclusive[name]
            else:
                target = group
            if f.type is bool:
                cli.setdefault("action", "store_true")
            elif "const" not in cli:
                cli.setdefault("type", _base_type(f))
            target.add_argument(*flag(f), dest=f.name, default=f.default, help=f.metadata["help"], **cli)
    return p


def _check(f, value) -> None:
    if value is None or isinstance(value, bool):
        return
    name = flag(f)[0]
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value}")
    check = f.metadata["check"]
    if check == "positive" and value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    if check == "non_negative" and value < 0:
        raise ConfigError(f"{name} must not be negative, got {value}")


def from_namespace(ns: argparse.Namespace) -> Settings:
    groups = {}
    for name, (cls, _) in GROUPS.items():
        values = {f.name: getattr(ns, f.name) for f in fields(cls)}
        for f in fields(cls):
            _check(f, values[f.name])
        groups[name] = cls(**values)
    return Settings(**groups)


def _positive_int(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {v!r}")
    return n


def validate(s: Settings) -> Settings:
    """Checks between options, and the defaults that depend on others filled in."""
    par, opt = s.parallel, s.optim
    if opt.min_lr > opt.lr:
        raise ConfigError(f"--min-lr {opt.min_lr:g} is above --lr {opt.lr:g}")
    if par.partition not in ("uniform", "parameters", "balanced") and not par.partition.startswith("type:"):
        raise ConfigError(f"--partition must be uniform, parameters, balanced or type:REGEX, got '{par.partition}'")
    if par.micro_batch_size == "auto" and (par.engine == "pipeline" or s.checkpoint.resume):
        raise ConfigError("--micro-batch-size auto applies to --engine zero or ddp, and not to --resume (pass the "
                          "micro-batch the run chose: its config.json says)")
    if par.partition == "balanced" and par.engine != "pipeline":
        raise ConfigError("--partition balanced applies to --engine pipeline")
    if par.batch_split == "proportional" and par.engine == "pipeline":
        raise ConfigError("--batch-split proportional applies to --engine zero or ddp (a pipeline balances its "
                          "stages with --partition balanced)")
    if s.cluster.hostfile and not Path(s.cluster.hostfile).is_file():
        raise ConfigError(f"--hostfile {s.cluster.hostfile}: no such file")
    if s.checkpoint.resume == "auto" and not (s.checkpoint.save_dir or s.log.log_dir):
        raise ConfigError("--resume needs the run's --log-dir (or --save-dir), or --resume PATH")
    report_to = report_trackers(s.log.report_to)
    ds_config = par.ds_config or str(ROOT / "deepspeed_configs" / DEFAULT_DS_CONFIG[par.engine])
    epochs = DEFAULT_EPOCHS if s.train.epochs is None and s.train.steps is None else s.train.epochs
    return replace(s, parallel=replace(par, ds_config=ds_config), train=replace(s.train, epochs=epochs),
                   log=replace(s.log, report_to=",".join(report_to) or "none"))


def report_trackers(value: str) -> tuple[str, ...]:
    """--report-to as the trackers it names, in order ('none' alone: none)."""
    names = [n.strip() for n in value.split(",")]
    if names == ["none"]:
        return ()
    for n in names:
        if n == "none":
            raise ConfigError(f"--report-to {value}: 'none' cannot be combined with trackers")
        if n not in TRACKERS:
            raise ConfigError(f"--report-to: unknown tracker '{n}'; choose none or from {', '.join(TRACKERS)}")
        if importlib.util.find_spec(n) is None:
            raise ConfigError(f"--report-to {n}: the {n} package is not installed (scripts/bootstrap.sh installs it)")
    return tuple(dict.fromkeys(names))


def parse(argv=None) -> Settings:
    return validate(from_namespace(parser().parse_args(argv)))


def defaults() -> Settings:
    """The settings of a run with no options (its defaults filled in), for tools and tests."""
    return validate(Settings())

