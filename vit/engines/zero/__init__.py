"""DeepSpeed ZeRO, stage 0-3 (optional CPU offload), all from the DeepSpeed JSON: the engine
(engine.py) and what it declares (SPEC): its stage is the JSON's, so its names carry it ('zero2'),
and its gradients are reduced in ZeRO's buckets, not overlapped with backward, at every micro-batch
from stage 2 on."""

import math

from vit.core.costs import ring_allreduce_s
from vit.engines.deepspeed import ZERO_BUCKET_DEFAULT, DeepSpeedSpec
from vit.engines.step_cost import DataParallelSpec


class ZeroSpec(DeepSpeedSpec, DataParallelSpec):
    def key(self, zero_stage):
        return f"{self.name}{zero_stage}"

    label = key

    def keyed_zero_stages(self):
        return self.zero_stages

    def runs(self):
        return {self.key(n): f"zero{n}.json" for n in self.zero_stages}

    def other_stage_config(self, zero_stage):
        return f"zero{zero_stage}.json"

    def link_s(self, c, hosts, net, work, calib, backward_s):
        """C x the stage's measured factor (the gradients' reduction in the communication dtype, the
        rest of ZeRO's traffic, gathering the updated parameters, in the model's), at every
        micro-batch from stage 2 on; C: a ring all-reduce of the gradients in ZeRO's buckets."""
        bucket = self.default_config(c.zero_stage)["zero_optimization"].get(
            "reduce_bucket_size", ZERO_BUCKET_DEFAULT
        )
        buckets = max(1, math.ceil(work.params / bucket))
        # deepspeed/runtime/engine.py allreduce_gradients: "ZeRO stage >= 2 communicates during non
        # gradient accumulation boundaries as well": every micro-batch reduces its gradients
        reductions = c.grad_accum if c.zero_stage >= 2 else 1
        gather = (calib.zero_comm_factor[c.zero_stage] - 1) * ring_allreduce_s(
            self.grad_bytes(work, work.layers, "none"), hosts, net, calib, buckets
        )
        wire = self.grad_bytes(work, work.layers, c.compression)
        return reductions * ring_allreduce_s(wire, hosts, net, calib, buckets) + gather


SPEC = ZeroSpec(
    "zero",
    "vit.engines.zero.engine",
    zero_stages=(0, 1, 2, 3),
    fp16=True,
    freeze=True,
    default_ds_config="zero2.json",
)
