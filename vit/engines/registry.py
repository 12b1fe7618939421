"""Every engine and what it supports, in one table. A new engine registers here (and its module in vit/engines/); the
checks between engines and options (vit.config.compat) and every other module read these specs, never an engine's name.
Importable without torch: the command line and the plan read it before anything heavy is imported."""
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSpec:
    name: str  # --engine
    module: str  # the module whose build(ctx) makes it
    pipeline: bool  # cuts the layer list into --pipeline-stages stages, each rank holding one
    deepspeed: bool  # a DeepSpeed engine: fp16 only where DeepSpeed's accelerator allows it
    zero_stage: int | None  # the ZeRO stage it always runs at (0: no ZeRO sharding); None: the DeepSpeed JSON's
    zero_stages: tuple[int, ...]  # JSON zero_optimization.stage values it runs with; another is refused by a
    #                               pipeline, ignored with a warning by an engine without ZeRO
    fp16: bool  # has an fp16 loss scaler (else it trains in bf16 or fp32)
    freeze: bool  # --freeze can rebuild it on a longer frozen prefix
    async_options: bool  # --async-update-interval, --weight-stashing and --weight-prediction apply
    micro_batch_auto: bool  # --micro-batch-size auto can measure it (every rank holding the whole model)
    default_ds_config: str  # under deepspeed_configs/, when no --ds-config is given
    comm_hooks: bool  # --comm-hook: torch's DDP communication hooks compress its gradient all-reduce

    @property
    def precisions(self) -> tuple[str, ...]:
        """What it can train in, best first (the order --precision auto tries)."""
        return ("bf16", "fp16", "fp32") if self.fp16 else ("bf16", "fp32")

    def zero_stage_of(self, ds_config: dict) -> int:
        """The ZeRO stage a run with this resolved DeepSpeed JSON trains at (0 for an engine without ZeRO)."""
        if self.zero_stage is not None:
            return self.zero_stage
        return ds_config.get("zero_optimization", {}).get("stage", 0)


ZERO_STAGES = (0, 1, 2, 3)
SPECS = {spec.name: spec for spec in (
    EngineSpec("zero", "vit.engines.zero.engine", pipeline=False, deepspeed=True, zero_stage=None, zero_stages=ZERO_STAGES,
               fp16=True, freeze=True, async_options=False, micro_batch_auto=True, default_ds_config="zero2.json",
               comm_hooks=False),
    EngineSpec("pipeline", "vit.engines.pipeline.engine", pipeline=True, deepspeed=True, zero_stage=None,
               zero_stages=(0, 1), fp16=True, freeze=True, async_options=False, micro_batch_auto=False,
               default_ds_config="pipeline.json", comm_hooks=False),
    EngineSpec("async-pipeline", "vit.engines.async_pipeline.engine", pipeline=True, deepspeed=False, zero_stage=0,
               zero_stages=(0, 1), fp16=False, freeze=False, async_options=True, micro_batch_auto=False,
               default_ds_config="pipeline.json", comm_hooks=False),
    EngineSpec("ddp", "vit.engines.ddp.engine", pipeline=False, deepspeed=False, zero_stage=0, zero_stages=(0,),
               fp16=True, freeze=True, async_options=False, micro_batch_auto=True, default_ds_config="zero0.json",
               comm_hooks=True),
)}
NAMES = tuple(SPECS)
AUTO = "auto"  # --engine auto: vit.planner.auto picks one of NAMES and its settings once the process group runs


def spec(name: str) -> EngineSpec:
    """The spec of --engine `name` (the command line allows only NAMES)."""
    return SPECS[name]


def build(name: str, ctx):
    """The engine `name`, built from a vit.engines.base.EngineContext."""
    return importlib.import_module(SPECS[name].module).build(ctx)
