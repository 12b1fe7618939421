"""The command line as typed settings: one dataclass per concern, each field declared once with its
help and its check; vit/run/cli.py generates the parser from them and validates every value
before any process group starts. The groups every run has are here; an engine's own groups are
declared in its folder (vit/engines/<engine>/options.py) and vit.engines.registry.Settings adds
them to these.

`vit.engines.registry.Settings()` is the defaults; `vit.run.cli.parse(argv)` the command line.
Code reads the group it needs (`settings.optim`, `settings.data`, ...), never an argparse Namespace.
"""

import argparse
from dataclasses import asdict, dataclass, field, fields, replace
from typing import ClassVar

from vit.core.onebit import check_opt_name

PRECISIONS = ("auto", "fp32", "fp16", "bf16")
DATASETS = ("digits", "glyphs", "glyphs-small", "cifar10", "cifar100", "imagefolder", "synthetic")
DEFAULT_EPOCHS = 40.0
DEFAULT_SAVE_INTERVAL = 1000  # --save-interval: a long run stopped loses at most this many steps
# fp16's initial loss scale 2^12 (DeepSpeed's 2^16 overflowed on every step in users' ViT runs),
# unless the JSON or --loss-scale auto sets one
DEFAULT_FP16_SCALE_POWER = 12
TRACKERS = ("tensorboard", "wandb", "csv")


def positive_int(text: str) -> int:
    """argparse type: a whole number above zero."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def option(default, help: str, check: str | None = None, needs: str | None = None, **cli):
    """A settings field: its default, its --help text, `check` ('positive', 'non_negative',
    'probability': 0 to 1, or 'below_one': 0 up to 1; every float must also be finite), `needs`:
    what it has no effect without (a key of vit.run.compat.NEEDS, or "engine": the engines
    that declare its group; changed from its default without that, it is refused) and extra
    argparse arguments (choices, metavar, flag, ...)."""
    return field(
        default=default, metadata={"help": help, "check": check, "needs": needs, "cli": cli}
    )


@dataclass(frozen=True)
class ModelSettings:
    model: str = option("vit_digits", "model preset (see vit/model/layers.py)")
    img_size: int | None = option(
        None, "image side for imagefolder/synthetic (default: the model's)", "positive"
    )
    pretrained: bool = option(
        False,
        "start from timm's hub weights for --model (needs network; offline, use --pretrained-path)",
    )
    pretrained_path: str | None = option(
        None,
        "start from these weights: .safetensors, .pth or .bin (timm, Hugging Face), an --export or "
        "a checkpoint folder of this project; the head is reset for another class count, the "
        "position embedding resampled for another image size",
        metavar="PATH",
    )
    drop_path: float = option(0.0, "stochastic depth rate (timm's drop_path_rate)", "below_one")
    export: str | None = option(
        None,
        "write the final weights (the EMA's with --model-ema) as a timm-loadable .safetensors, "
        "with its pretrained config beside it as PATH.json; with --resume of a complete run, from "
        "its last checkpoint, without training",
        metavar="PATH",
    )


@dataclass(frozen=True)
class DataSettings:
    dataset: str | None = option(
        None, "data set (default: the one --data-path holds, else digits)", choices=DATASETS
    )
    data_path: str | None = option(
        None,
        "folder of cifar10/cifar100 batches or of an imagefolder tree (each image's header is read "
        "first: a file that is not an image refuses the run)",
    )
    download: bool = option(False, "download CIFAR into --data-path if missing")
    synthetic_size: int = option(2048, "synthetic: number of training samples", "positive")
    workers: int | None = option(
        None,
        "DataLoader worker processes (default: 0 on CPU; on GPU up to 4 per rank, one "
        "core left to the training loop)",
        "non_negative",
    )


@dataclass(frozen=True)
class ParallelSettings:
    # --engine's choices and --ds-config's defaults come from the engine registry (vit.run.cli
    # adds them)
    engine: str = option("zero", "training engine (auto: the planner's, docs/planner.md)")
    ds_config: str | None = option(
        None, "DeepSpeed JSON (batch, precision, ZeRO); default deepspeed_configs/"
    )
    auto_allow: str = option(
        "",
        "engine auto: what it may choose though it changes what is learned, comma-separated: "
        "async-pipeline (no flush: updates one step stale), diloco (local steps, an outer "
        "optimizer), powersgd (low-rank gradients); by default auto ranks them and leaves them "
        "to you",
        needs="auto",
        metavar="NAMES",
    )
    pipeline_stages: int = option(2, "pipeline engines: number of stages", "positive")
    partition: str = option(
        "parameters",
        "pipeline engines: how layers are cut into stages: uniform, parameters, type:REGEX, or "
        "balanced (by the census: each layer's forward and backward time measured on each rank, "
        "and each rank's free memory)",
    )
    batch_split: str = option(
        "equal",
        "zero and ddp engines: every rank the same micro-batch, or micro-batches in "
        "proportion to each rank's measured speed (within its memory), gradients "
        "weighted so the update is the same",
        choices=("equal", "proportional"),
    )
    simulate_slowdown: str | None = option(
        None,
        "make these ranks' compute FACTOR times slower (each layer's forward and "
        "backward is followed by a wait of FACTOR-1 times its time), to try mixed-GPU "
        "settings on identical hardware",
        metavar="RANK=FACTOR[,...]",
    )
    micro_batch_size: int | str | None = option(
        None,
        "override train_micro_batch_size_per_gpu of the JSON; auto: the largest whose forward "
        "and backward fit every rank's free memory with headroom (zero, ddp; "
        "with --batch-split proportional, one per rank)",
        type=lambda v: v if v == "auto" else positive_int(v),
        metavar="N|auto",
    )
    grad_accum: int | None = option(
        None, "override gradient_accumulation_steps of the JSON", "positive"
    )
    precision: str | None = option(
        None,
        "override the JSON's fp16/bf16 setting; auto: bf16 if every rank supports it, else fp16 if "
        "every rank does under the engine (never async-pipeline), else fp32 (the default on GPUs "
        "when neither this nor the JSON names one)",
        choices=PRECISIONS,
    )
    tf32: str = option(
        "on",
        "fp32 matmuls and convolutions in TF32 on Ampere and newer GPUs (no effect elsewhere)",
        choices=("on", "off"),
    )
    compile: bool = option(
        False,
        "compile the model with torch.compile (inductor; timm's --torchcompile): "
        "DeepSpeed's engine.compile() for zero and pipeline, the DDP module, each async-pipeline "
        "stage. The first steps are slower while it compiles",
    )
    loss_scale: str = option(
        "config",
        "fp16: the JSON's initial_scale_power, or auto: a short fp32 "
        "probe of the gradients picks it",
        choices=("config", "auto"),
    )


@dataclass(frozen=True)
class OptimSettings:
    opt: str = option(
        "adamw",
        "optimizer (timm's names): adamw, or sgd with --momentum (and --nesterov). "
        "DeepSpeed's 1-bit optimizers (onebitadam, zerooneadam, onebitlamb) are refused: "
        "DeepSpeed 0.19.8 no longer has them (docs/ethernet.md)",
        choices=("adamw", "sgd"),
        type=check_opt_name,
    )
    momentum: float = option(0.9, "sgd: momentum", "below_one")
    nesterov: bool = option(False, "sgd: Nesterov momentum")
    lr: float = option(2e-3, "peak learning rate", "positive")
    min_lr: float = option(1e-5, "learning rate at the end of the cosine", "non_negative")
    weight_decay: float = option(
        0.05, "weight decay (not on biases, norms and embeddings)", "non_negative"
    )
    warmup_steps: int | None = option(
        None, "linear warm-up steps (default 5%% of the steps)", "non_negative"
    )
    fused_adam: bool = option(False, "torch's fused AdamW kernel (one kernel for all parameters)")
    layer_decay: float | None = option(
        None,
        "layer-wise LR decay: layer i of the list gets lr x decay^(last - i) "
        "(timm's param_groups_layer_decay)",
        "positive",
    )
    clip_grad: float | None = option(
        None,
        "clip the gradient norm to this (overrides the JSON's gradient_clipping)",
        "non_negative",
    )


@dataclass(frozen=True)
class RecipeSettings:
    """timm train.py's augmentation and regularisation options, under their names there."""

    smoothing: float = option(
        0.1,
        "label smoothing (timm train.py's default; on the digits it raised top-1 on "
        "every seed: docs/benchmarks.md)",
        "below_one",
    )
    mixup: float = option(0.0, "mixup alpha (on when > 0)", "non_negative")
    cutmix: float = option(0.0, "cutmix alpha (on when > 0)", "non_negative")
    mixup_prob: float = option(1.0, "probability of mixup or cutmix per batch", "probability")
    mixup_switch_prob: float = option(
        0.5, "probability of cutmix instead of mixup when both are on", "probability"
    )
    aa: str | None = option(
        None,
        "AutoAugment policy, e.g. rand-m9-mstd0.5 or original (timm's auto_augment; "
        "its -inc1 policies fail on Pillow 11)",
    )
    reprob: float = option(0.0, "random erasing probability", "probability")
    color_jitter: float = option(0.0, "colour jitter factor", "non_negative")
    hflip: float = option(0.0, "horizontal flip probability", "probability")
    scale: tuple | None = option(
        None,
        "random-resized-crop scale range (default: the data set's, 0.95 1.0 on digits, where it "
        "raised top-1 (docs/benchmarks.md); off elsewhere)",
        nargs=2,
        type=float,
        metavar=("MIN", "MAX"),
    )
    no_aug: bool = option(
        False,
        "no training augmentation: overrides --scale, --aa, --reprob, --color-jitter, --hflip and "
        "the data set's default crop (mixup and cutmix stay, as in timm's train.py)",
    )
    model_ema: bool = option(
        False,
        "keep an exponential moving average of the weights (timm's "
        "ModelEmaV3), evaluated beside the model",
    )
    model_ema_decay: float = option(0.9998, "EMA decay", "below_one")

    @property
    def augments(self) -> bool:
        return bool(self.aa or self.reprob or self.color_jitter or self.hflip or self.scale)

    @property
    def mixes(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0


@dataclass(frozen=True)
class FreezeSettings:
    """Freeze training (PipeTransformer's AutoFreeze): a growing prefix of the layers stops training
    (vit/freeze)."""

    freeze: str = option(
        "none",
        "freeze a prefix of the layers as training goes: schedule (frozen(e) = ceil(L(1-(1-A)^e)) "
        "after e intervals, L the embedding and blocks), settled (recommended: "
        "the layers whose weights settled) or grad (whose gradient norms did); "
        "these two never pass the schedule",
        choices=("none", "schedule", "settled", "grad"),
    )
    freeze_alpha: float = option(
        1 / 3,
        "the schedule's A; settled, grad: at most this share of the active layers freezes at once",
        "positive",
        needs="freeze",
    )
    freeze_threshold: float | None = option(
        None,
        "over an interval, settled: a layer's weights moved less than this share of "
        "their largest move (default 0.65); grad: its gradient norm changed by less "
        "than this share (default 0.1)",
        "positive",
        needs="freeze",
    )
    freeze_interval_epochs: float = option(
        1.0, "epochs between decisions (fractions ok)", "positive", needs="freeze"
    )
    freeze_replan: str = option(
        "on",
        "pipeline engine: at a freeze point plan the stages again (frozen layers hold weights "
        "only) and halve them when the active layers fit, the freed ranks becoming data-parallel "
        "copies; off: keep the layout",
        choices=("on", "off"),
        needs="pipeline freeze",
    )
    freeze_cache: str = option(
        "auto",
        "keep each training sample's output of the frozen layers and train from it instead of "
        "running them; auto: on when the data has no random augmentation or mixup",
        choices=("auto", "on", "off"),
        needs="freeze",
    )
    freeze_cache_gib: float = option(
        4.0,
        "host memory for --freeze-cache per rank; past it, files in the log dir",
        "positive",
        needs="freeze",
    )


@dataclass(frozen=True)
class TrainSettings:
    steps: int | None = option(None, "optimizer steps to train", "positive", exclusive="length")
    epochs: float | None = option(
        None,
        f"epochs to train (default {DEFAULT_EPOCHS:g} when --steps is not given; with --resume, "
        "the resumed run's own length)",
        "positive",
        exclusive="length",
    )
    seed: int = option(0, "model initialisation and data order")
    eval_interval: int = option(0, "steps between evaluations (0: only at the end)", "non_negative")
    max_skipped_steps: int = option(
        20, "fp16: stop after this many overflow-skipped steps in a row", "positive"
    )


@dataclass(frozen=True)
class CheckpointSettings:
    save_interval: int = option(
        DEFAULT_SAVE_INTERVAL,
        "steps between checkpoints, besides the last step's (0: only that one); a long run stopped "
        "for any reason loses at most this many; a --resume without it keeps the run's",
        "non_negative",
    )
    save_dir: str | None = option(None, "checkpoint folder (default <log-dir>/checkpoints)")
    no_save: bool = option(False, "write no checkpoints")
    keep_checkpoints: int = option(3, "complete checkpoints to keep", "positive")
    resume: str | None = option(
        None,
        "continue from the newest checkpoint of --save-dir, or of PATH",
        nargs="?",
        const="auto",
        metavar="PATH",
    )


@dataclass(frozen=True)
class LogSettings:
    log_dir: str | None = option(None, "run output folder (default logs/<engine>-<time>)")
    log_interval: int = option(10, "steps between log lines and metric records", "positive")
    monitor_interval: float = option(
        1.0, "seconds between GPU/CPU monitor samples (0: off)", "non_negative"
    )
    monitor_backend: str = option(
        "auto",
        "GPU monitor: NVML in-process, GPUtil (nvidia-smi), or none (CPU and memory only)",
        choices=("auto", "nvml", "gputil", "none"),
    )
    report_to: str = option(
        "none",
        "rank 0 also sends the metrics to these trackers, comma-separated: "
        "none, tensorboard (<log-dir>/tensorboard), wandb (WANDB_MODE=offline: "
        "no network), csv (<log-dir>/tracking.csv)",
        metavar="LIST",
    )
    verbose: bool = option(
        False,
        "print the libraries' notes and warnings (DeepSpeed, torch, timm) and every rank's notes "
        "instead of keeping them in <log-dir>/warnings_rank<R>.log",
    )


@dataclass(frozen=True)
class ClusterSettings:
    hostfile: str | None = option(
        None, "the launch's hostfile: the preflight checks the world size against its slots"
    )
    device: str = option(
        "auto",
        "cuda: every rank on its GPU (nccl), cpu: on the CPU (gloo); auto: cuda when every rank "
        "has a usable GPU, cpu when none has one; any mix is an error",
        choices=("auto", "cuda", "cpu"),
    )
    dist_timeout: float = option(
        300.0,
        "seconds before a process-group start or a collective fails, and before the watchdog ends "
        "a job in which no step finished",
        "positive",
    )
    # The DeepSpeed launcher passes --local_rank=N; LOCAL_RANK in the environment says the same.
    local_rank: int | None = option(None, argparse.SUPPRESS, flag=("--local_rank", "--local-rank"))


GROUPS = {  # attribute of Settings -> (class, --help section title)
    "model": (ModelSettings, "model"),
    "data": (DataSettings, "data"),
    "parallel": (ParallelSettings, "engine, parallelism and precision"),
    "optim": (OptimSettings, "optimizer"),
    "recipe": (RecipeSettings, "augmentation and regularisation (timm train.py's names)"),
    "freeze": (FreezeSettings, "freeze training"),
    "train": (TrainSettings, "training length and evaluation"),
    "checkpoint": (CheckpointSettings, "checkpoints"),
    "log": (LogSettings, "logs and monitoring"),
    "cluster": (ClusterSettings, "cluster"),
}


@dataclass(frozen=True)
class Settings:
    """The groups every run has; vit.engines.registry.Settings, the run's settings, adds the
    engines' own. `sections`: attribute -> (group class, --help section title), in --help's
    order."""

    sections: ClassVar[dict[str, tuple[type, str]]] = GROUPS
    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    recipe: RecipeSettings = field(default_factory=RecipeSettings)
    freeze: FreezeSettings = field(default_factory=FreezeSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    log: LogSettings = field(default_factory=LogSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)

    def flat(self) -> dict:
        """Every option by its name, as config.json records them."""
        return {k: v for name in self.sections for k, v in asdict(getattr(self, name)).items()}

    def with_(self, **changes) -> "Settings":
        """A copy with options changed by name, whatever their group (for tests, benchmarks and
        tools)."""
        groups = {}
        for name, (cls, _) in self.sections.items():
            mine = {k: v for k, v in changes.items() if k in {f.name for f in fields(cls)}}
            if mine:
                groups[name] = replace(getattr(self, name), **mine)
        unknown = set(changes) - {k for g in groups.values() for k in asdict(g)}
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
        return replace(self, **groups)
