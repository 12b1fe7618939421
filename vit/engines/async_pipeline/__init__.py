"""The asynchronous pipeline (PipeDream-2BW's 1F1B without a flush, no DeepSpeed in its step): the
engine (engine.py), its channels (p2p.py), the weight prediction (msnag.py), and what it declares
(SPEC): no bubble, a stashed weight copy per further micro-batch in flight, fp32 under autocast, a
bf16 wire as its compression."""

from vit.core.errors import ConfigError
from vit.engines.async_pipeline.options import AsyncSettings
from vit.engines.step_cost import PipelinedSpec, autocast_state


class AsyncPipelineSpec(PipelinedSpec):
    option_groups = {
        "asynchrony": (AsyncSettings, "asynchronous pipeline (--engine async-pipeline)")
    }

    def restages(self, saved):
        """Its checkpoint holds each layer by name (no ZeRO state): any stages take it."""
        return saved.get("zero_stage", 0) == 0

    def check_layout(self, settings, world_size, grad_accum):
        interval = settings.asynchrony.async_update_interval
        if interval and grad_accum % interval:
            raise ConfigError(
                f"--async-update-interval {interval} does not divide the gradient-accumulation "
                f"count {grad_accum} (a checkpoint drains the pipeline at a step's end, where "
                "every stage's update must be complete)"
            )

    def resolved_options(self, settings, precision):
        return {"pipe_wire_dtype": settings.asynchrony.wire_dtype(precision)}

    def stashed_weights(self, settings):
        """One copy of the weights under stashing or prediction (or both)."""
        a = settings.asynchrony
        return int(a.weight_stashing == "on" or a.weight_prediction == "msnag")

    def flushes(self):
        return False

    def changes_learning(self, c):
        return (
            "the asynchronous pipeline changes what is learned (no flush: its updates apply "
            "gradients of weights one update older, PipeDream-2BW): --engine async-pipeline is "
            "yours to choose (or --auto-allow async-pipeline)"
        )

    def stashed_copies(self, inflight):
        return inflight - 1

    def compressions(self, precision):
        return "none", "wire-bf16"  # the p2p activations and gradients in bf16

    def compression_of(self, settings, ds_config):
        return "wire-bf16" if settings.asynchrony.pipe_wire_dtype == "bf16" else "none"

    def compression_options(self, compression):
        return ({"pipe_wire_dtype": "bf16"} if compression == "wire-bf16" else {}), {}

    def state_bytes(self, precision, ds_config, dp_size=1, stashed_copies=0, compression="none"):
        terms = autocast_state(precision)
        if stashed_copies:  # engine.py _weights: p.detach().clone() (or msnag's prediction)
            terms["stashed weights"] = 4 * stashed_copies
        return terms  # with dp > 1 the gradients are views of the buffer all-reduced in place


SPEC = AsyncPipelineSpec(
    "async-pipeline",
    "vit.engines.async_pipeline.engine",
    zero_stages=(0, 1),
    default_ds_config="pipeline.json",
)
