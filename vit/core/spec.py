"""What an engine declares about itself: the options it takes, what it trains in, what a rank holds
per parameter, what its step costs on the cluster's links, and its names in tables and calibrations.
Each engine's folder under vit/engines/ subclasses EngineSpec and answers for itself;
vit.engines.registry holds one row per engine. The command line, the precision rules, the memory
model, the planner, the reports and the benchmarks ask the spec, never an engine's name. Pure: no
torch."""

from dataclasses import dataclass
from typing import ClassVar

from vit.core.costs import (
    CUBLAS_BYTES,
    ELEMENT_BYTES,
    NCCL_BYTES,
    TORCH_GRAD_BYTES,
    Calibration,
    Candidate,
    Layer,
    Network,
    Prediction,
    Rank,
    Workload,
)
from vit.core.errors import ConfigError

PRECISIONS_WITH_FP16 = ("bf16", "fp16", "fp32")
# Ampere: sm_70/75 emulate bf16, which torch.cuda.is_bf16_supported() also calls supported
BF16_NATIVE = (8, 0)
FP16_FAST = (7, 0)  # Volta: tensor cores; older cards run fp16 far slower than fp32
HALF_WIRES = ("fp16", "bf16", "comm-bf16")  # compressions that send gradients in 2 bytes an element


@dataclass(frozen=True)
class EngineSpec:
    name: str  # --engine
    module: str  # the module whose build(ctx) makes it (torch is imported there, not here)
    # JSON zero_optimization.stage values it runs with; another is refused by a pipeline, ignored
    # with a warning by an engine without ZeRO
    zero_stages: tuple[int, ...]
    default_ds_config: str  # under deepspeed_configs/, when no --ds-config is given
    fp16: bool = False  # has an fp16 loss scaler (else it trains in bf16 or fp32)
    freeze: bool = False  # --freeze can rebuild it on a longer frozen prefix
    # --comm-hook: torch's DDP communication hooks compress its gradient all-reduce
    comm_hooks: bool = False
    # workers take local steps between syncs: --sync-every and the --outer-* options apply
    local_steps: bool = False

    # Its own options: Settings attribute -> (a dataclass of vit.core.settings.option fields,
    # declared in its folder's options.py; its --help section title); vit.engines.registry adds
    # them to the settings every run has.
    option_groups: ClassVar[dict[str, tuple[type, str]]] = {}

    # What its family answers for it, so that no engine declares a flag against its shape: the
    # step's (vit.engines.step_cost: DataParallelSpec, PipelinedSpec) and DeepSpeed's
    # (vit.engines.deepspeed: DeepSpeedSpec).
    #
    # cuts the layer list into --pipeline-stages stages, each rank holding one
    pipeline: ClassVar[bool]
    # --micro-batch-size auto can measure it (every rank holding the whole model)
    micro_batch_auto: ClassVar[bool]
    # 1F1B without a flush: --async-update-interval, --weight-stashing, --weight-prediction and
    # --pipe-wire-dtype apply
    async_schedule: ClassVar[bool] = False
    # a DeepSpeed engine: its JSON's ZeRO and communication_data_type sections apply
    deepspeed: ClassVar[bool] = False
    # the ZeRO stage it always runs at (0: no ZeRO sharding); None: the DeepSpeed JSON's
    zero_stage: ClassVar[int | None] = 0
    # trains fp32 weights under torch.autocast (else the model is cast to the half dtype)
    autocast: ClassVar[bool] = True

    # --- the options and precisions it takes

    @property
    def precisions(self) -> tuple[str, ...]:
        """What it can train in, best first (the order --precision auto tries)."""
        return PRECISIONS_WITH_FP16 if self.fp16 else ("bf16", "fp32")

    def check_options(self, settings) -> None:
        """Its own options among themselves and against the run's others (vit.run.cli.validate,
        before any process group); a ConfigError names the problem."""

    def check_layout(self, settings, world_size: int, grad_accum: int) -> None:
        """Its options against the ranks and the batch (vit.run.plan, before any process
        group); a ConfigError names the problem."""

    def resolved_options(self, settings, precision: str) -> dict:
        """What config.json and summary.json record of its options as the run resolved them at
        `precision` ({}: nothing beyond the options themselves)."""
        return {}

    def census_asks(self, settings) -> dict:
        """What it asks the census to decide from its options (vit.planner.survey.Ask's fields; {}:
        nothing)."""
        return {}

    def stashed_weights(self, settings) -> int:
        """Copies of the weights its options keep for micro-batches in flight, as state_bytes'
        stashed_copies for the run's memory (0: none)."""
        return 0

    def zero_stage_of(self, ds_config: dict) -> int:
        """The ZeRO stage a run with this resolved DeepSpeed JSON trains at (0 for an engine without
        ZeRO)."""
        if self.zero_stage is not None:
            return self.zero_stage
        return ds_config.get("zero_optimization", {}).get("stage", 0)

    def check_precision(self, requested: str | None) -> None:
        """Before the process group: a precision it cannot train in at all is one ConfigError."""
        if requested == "fp16" and not self.fp16:
            raise ConfigError(
                f"--engine {self.name} trains in fp32 or bf16 (it has no fp16 loss scaler); "
                "pass --precision bf16 or fp32 (or a --ds-config without fp16); "
                "cards without bf16 (before Ampere: RTX 20, GTX 10) train it in fp32, or in "
                "fp16 under --engine ddp or zero"
            )

    def fp16_on_gpu(self, deepspeed_allows: bool) -> bool:
        """Whether fp16 runs under it on a CUDA card whose fp16 DeepSpeed's accelerator allows or
        not (torch's autocast: on every card; whether it trains in it is `precisions`)."""
        return True

    def fp16_hint(self, capabilities: list[tuple[int, int]]) -> str:
        """Why fp16 is refused on cards of these compute capabilities, and what runs it ('' :
        nothing to add)."""
        return ""

    # --- its names

    def key(self, zero_stage: int) -> str:
        """Its name in a calibration and a comparison table ('zero2' where the stage is the
        JSON's)."""
        return self.name

    def label(self, zero_stage: int) -> str:
        """Its name in the planner's table ('zero2', 'pipeline zero1')."""
        return self.name

    def calibration_key(self, c: Candidate) -> str:
        """key() with the candidate's compression ('ddp bf16', 'zero1 comm-bf16')."""
        return self.key(c.zero_stage) + ("" if c.compression == "none" else f" {c.compression}")

    def keyed_zero_stages(self) -> tuple[int, ...]:
        """The ZeRO stages its key() tells apart."""
        return (0,)

    def runs(self) -> dict[str, str]:
        """The benchmarks' runs of it: run name -> its DeepSpeed JSON under deepspeed_configs/."""
        return {self.name: self.default_ds_config}

    # --- its DeepSpeed JSON

    def default_config(self, zero_stage: int) -> dict:
        """Its default DeepSpeed JSON at `zero_stage`, for the memory and cost rules ({}: it reads
        none of it)."""
        return {}

    def config_for(self, zero_stage: int, stages: int, world_size: int) -> str | None:
        """The JSON (under deepspeed_configs/) that runs it at this ZeRO stage; None: none does."""
        return self.default_ds_config

    # --- compression

    def compressions(self, precision: str) -> tuple[str, ...]:
        """What it can compress its communication with; an option that changes nothing at this
        precision is left out."""
        return ("none",)

    def compression_of(self, settings, ds_config: dict) -> str:
        """The compression a run's settings (vit.core.settings.Settings) and JSON ask for."""
        return "none"

    def compression_options(self, compression: str) -> tuple[dict, dict]:
        """(the settings, the DeepSpeed JSON keys) that ask for `compression`, as a command line
        would."""
        return {}, {}

    # --- memory

    def state_bytes(
        self,
        precision: str,
        ds_config: dict,
        dp_size: int = 1,
        stashed_copies: int = 0,
        compression: str = "none",
    ) -> dict[str, float]:
        """Bytes per parameter one rank holds for the model's state (not activations), by what holds
        them. `stashed_copies`: weight copies kept for micro-batches in flight."""
        raise NotImplementedError

    def bucket_bytes(self, ds_config: dict, precision: str) -> float:
        """Bytes of the engine's own communication buffers on a GPU (ZeRO's buckets)."""
        return 0.0

    def handover_bytes(self) -> float:
        """--freeze: what a freeze point allocates on a GPU beside the live engine to move its state
        to the rebuilt one."""
        return 0.0

    def reserved_bytes(self, ds_config: dict, precision: str) -> float:
        """What a GPU rank keeps free beside a plan: NCCL's buffers, cuBLAS's workspaces and
        bucket_bytes."""
        return NCCL_BYTES + CUBLAS_BYTES + self.bucket_bytes(ds_config, precision)

    def capacity(self, rank: Rank, zero_stage: int, precision: str) -> float:
        """What a candidate may fill on `rank`: its usable memory less a GPU's reserved_bytes."""
        reserved = (
            self.reserved_bytes(self.default_config(zero_stage), precision) if rank.gpu else 0.0
        )
        return rank.capacity_bytes - reserved

    def per_param_bytes(
        self, c: Candidate, work: Workload, dp_size: int, stashed_copies: int = 0
    ) -> float:
        return sum(
            self.state_bytes(
                work.precision,
                self.default_config(c.zero_stage),
                dp_size,
                stashed_copies=stashed_copies,
            ).values()
        )

    # --- communication

    def grad_bytes(self, work: Workload, layers: tuple[Layer, ...], compression: str) -> float:
        """Bytes of `layers`' gradients one all-reduce sends (before the ring's 2(n-1)/n): an engine
        that autocasts keeps fp32 gradients, the others the precision's; fp16/bf16 halve fp32."""
        per = TORCH_GRAD_BYTES if self.autocast else ELEMENT_BYTES[work.precision]
        if compression in HALF_WIRES:
            per = min(per, 2)
        return sum(layer.params for layer in layers) * per

    def bubble_slots(self, stages: int) -> int:
        """Slots a step of `stages` stages spends filling and draining (0: no pipeline, or none)."""
        return 0

    def changes_learning(self, c: Candidate) -> str | None:
        """Why the candidate learns otherwise than the plain step (None: it learns the same),
        which --engine auto leaves to the user to choose."""
        return None

    def planner_input(self, args: dict) -> object | None:
        """What its price reads of a run's options besides the Workload's layers, batch and
        precision, from the options by their config.json names (a missing one at its default);
        None: nothing. The planner and --engine auto carry it in Workload.inputs unread."""
        return None

    def work_input(self, work: Workload):
        """Its planner_input in `work`, or the defaults' where the planner was given none."""
        given = work.inputs.get(self.name)
        return given if given is not None else self.planner_input({})

    def predict(
        self, c: Candidate, ranks: list[Rank], net: Network, work: Workload, calib: Calibration
    ) -> Prediction:
        """The candidate's step on these ranks and links: compute, link, bubble, fixed costs and
        memory."""
        raise NotImplementedError

    # --- its resume rules (vit.checkpoints.checkpoint.check_shape reads them; `saved`: a
    # checkpoint's manifest: engine, zero_stage, pipeline_stages, data_parallel_size)

    def resumes(self, saved: dict, where: str) -> str | None:
        """How it takes the checkpoint `where`: "own" (written by this engine), "universal"
        (another engine's ZeRO state, through DeepSpeed's universal checkpoint), None: it does not
        (a ConfigError where it has more to say than that)."""
        return "own" if saved["engine"] == self.name else None

    def restages(self, saved: dict) -> bool:
        """Whether it resumes its own checkpoint with another number of pipeline stages (and data-
        parallel ranks)."""
        return False

    # --- its runs' logs

    def sync_steps(self, args: dict, total_steps: int) -> list[int]:
        """The steps at which a run's workers synced, from its config.json options (plot_logs.py
        marks them); [] for an engine whose ranks meet every step."""
        return []
