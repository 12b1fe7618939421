"""DeepSpeed's PipelineModule and PipelineEngine (1F1B with a flush at every step) over the same
layer list: the engine (engine.py) and what it declares (SPEC): ZeRO 0 or 1 from the JSON, a bubble
of S - 1 slots a step, its stages' all-reduce priced like ZeRO's; its ZeRO-1 checkpoints resume on
other stages and ranks through DeepSpeed's universal checkpoint."""

from vit.engines.deepspeed import DeepSpeedSpec
from vit.engines.step_cost import PipelinedSpec


class PipelineSpec(DeepSpeedSpec, PipelinedSpec):
    def label(self, zero_stage):
        return f"{self.name} zero{zero_stage}"

    def restages(self, saved):
        """Its ZeRO-1 state on other stages and ranks, through DeepSpeed's universal checkpoint;
        ZeRO-0's loads only into its own stages."""
        return saved.get("zero_stage", 0) > 0

    def reduce_factor(self, c, calib):
        return calib.zero_comm_factor[c.zero_stage]


SPEC = PipelineSpec(
    "pipeline",
    "vit.engines.pipeline.engine",
    zero_stages=(0, 1),
    fp16=True,
    freeze=True,
    default_ds_config="pipeline.json",
)
