"""--engine async-pipeline's options (vit.core.settings.option fields): the update interval, weight
stashing and prediction, the wire between stages. Its spec declares the group as `asynchrony`."""

from dataclasses import dataclass

from vit.core.settings import option


@dataclass(frozen=True)
class AsyncSettings:
    """--engine async-pipeline: PipeDream-2BW's 1F1B without a flush, and what offsets its
    staleness."""

    async_update_interval: int | None = option(
        None,
        "micro-batches between a stage's updates (default: the gradient-accumulation "
        "count, which it must divide)",
        "positive",
        needs="async",
    )
    weight_stashing: str = option(
        "on",
        "each backward uses the weights its forward used (off: the current ones)",
        choices=("on", "off"),
        needs="async",
    )
    weight_prediction: str = option(
        "msnag",
        "before a forward, predict the weights d updates ahead (d: the stage's staleness) "
        "from the optimizer's momentum (FTPipe's multi-step NAG), or none",
        choices=("msnag", "none"),
        needs="async",
    )
    pipe_wire_dtype: str | None = option(
        None,
        "dtype of the activations and gradients between stages (cast before the send, "
        "to fp32 on arrival; bf16, fp16: half the bytes; default: the training "
        "precision). fp16 has no loss scaler on the wire: gradients below 6e-5 lose "
        "bits, below 3e-8 arrive as zero",
        choices=("fp32", "bf16", "fp16"),
        needs="async",
    )

    def wire_dtype(self, precision: str) -> str:  # --pipe-wire-dtype, else the training precision
        return self.pipe_wire_dtype or precision
