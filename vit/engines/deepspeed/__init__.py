"""What DeepSpeed's two engines (zero/ and pipeline/) share: the spec rules of DeepSpeed's optimizer
wrappers (DeepSpeedSpec: memory per parameter, ZeRO's buckets, fp16 where DeepSpeed's accelerator
allows it, the JSON's communication_data_type), and in engine.py the torch side (checkpoints, the
loss scaler, --freeze's handover). Importing the package is light: no torch."""

import copy
import functools
import json

from vit.core.costs import ELEMENT_BYTES
from vit.core.paths import DS_CONFIGS
from vit.core.spec import FP16_FAST, EngineSpec

ZERO_BUCKET_DEFAULT = 500_000_000  # DeepSpeed's reduce_bucket_size, in elements
PREFETCH_DEFAULT = 50_000_000  # DeepSpeed's stage3_prefetch_bucket_size, in parameters
# Elements --freeze's handover of a partitioned optimizer sums at once (engine.whole_adam_state):
# 3 rows (weights, two moments) in fp32, 192 MiB on the device beside the live engine. The whole
# group at once took 12 bytes a parameter (1 GB for ViT-B).
HANDOVER_CHUNK = 1 << 24


@functools.lru_cache(maxsize=None)
def _json(name: str) -> str:
    return (DS_CONFIGS / name).read_text()


class DeepSpeedSpec(EngineSpec):
    deepspeed = True
    zero_stage = None  # the JSON's
    autocast = False  # DeepSpeed casts the model to the half dtype

    def default_config(self, zero_stage):
        """Its default JSON with zero_optimization.stage set (what the memory rules read: buckets,
        gradient accumulation dtype)."""
        config = copy.deepcopy(json.loads(_json(self.default_ds_config)))
        config.setdefault("zero_optimization", {})["stage"] = zero_stage
        return config

    def config_for(self, zero_stage, stages, world_size):
        """Its default JSON where that runs at the stage (or a pipeline without data parallelism,
        where the stage changes nothing), else other_stage_config."""
        if self.zero_stage_of(json.loads(_json(self.default_ds_config))) == zero_stage or (
            self.pipeline and stages == world_size
        ):
            return self.default_ds_config
        return self.other_stage_config(zero_stage)

    def other_stage_config(self, zero_stage: int) -> str | None:
        return None

    def fp16_on_gpu(self, deepspeed_allows):
        return self.fp16 and deepspeed_allows

    def fp16_hint(self, capabilities):
        allow = (
            " (6.x with DS_ALLOW_DEPRECATED_FP16=1 set for every rank)"
            if all(m == 6 for m, _ in capabilities)
            else ""
        )
        return (
            f": DeepSpeed runs fp16 from compute capability {FP16_FAST[0]}.{FP16_FAST[1]} "
            f"on{allow}, --engine ddp on any GPU"
        )

    def compressions(self, precision):
        """communication_data_type bf16 (its gradient reduction), where the gradients are wider."""
        return ("none", "comm-bf16") if ELEMENT_BYTES[precision] > 2 else ("none",)

    def compression_of(self, settings, ds_config):
        return "comm-bf16" if ds_config.get("communication_data_type") == "bf16" else "none"

    def compression_options(self, compression):
        return {}, ({"communication_data_type": "bf16"} if compression == "comm-bf16" else {})

    def handover_bytes(self):
        """--freeze: the device buffer of a freeze point's handover (engine.whole_adam_state)."""
        return 3 * HANDOVER_CHUNK * 4

    def bucket_bytes(self, ds_config, precision):
        """ZeRO-1 and -2 (zero/stage_1_and_2.py): with contiguous_gradients, DeepSpeed's default,
        its reduce buckets of reduce_bucket_size elements, two with overlap_comm (one filled while
        the other is reduced), in the gradient accumulation dtype where the JSON sets one (else the
        run's precision); the updated parameters are gathered in place (runtime/utils.py
        all_gather_dp_groups), with no bucket. ZeRO-3 (zero/stage3.py): its reduce buckets and its
        prefetch bucket of stage3_prefetch_bucket_size parameters."""
        zero = ds_config.get("zero_optimization", {})
        stage, reduce = zero.get("stage", 0), zero.get("reduce_bucket_size", ZERO_BUCKET_DEFAULT)
        buffers = 2 if zero.get("overlap_comm") else 1
        if stage == 3:
            prefetch = zero.get("stage3_prefetch_bucket_size", PREFETCH_DEFAULT)
            return (buffers * reduce + prefetch) * ELEMENT_BYTES[precision]
        if stage < 1 or not zero.get("contiguous_gradients", True):
            return 0.0
        dtype = ds_config.get("data_types", {}).get("grad_accum_dtype") or precision
        return buffers * reduce * ELEMENT_BYTES[dtype]

    def state_bytes(self, precision, ds_config, dp_size=1, stashed_copies=0, compression="none"):
        """The optimizer DeepSpeed wraps around AdamW, as deepspeed/runtime/engine.py's
        _do_optimizer_sanity_check picks it: ZeRO (zero/stage_1_and_2.py, stage3.py), BF16_Optimizer
        (bf16_optimizer.py: bf16 with ZeRO-1 and fp32 gradient accumulation, and bf16 pipelines
        without ZeRO), FP16_UnfusedOptimizer (fp16/unfused_optimizer.py: fp16 or bf16 without ZeRO;
        torch's AdamW is not DeepSpeed's FusedAdam), or AdamW alone in fp32 without ZeRO. ZeRO's
        stage, gradient accumulation dtype and optimizer offload come from the JSON; what ZeRO
        partitions is divided by `dp_size`."""
        zero = ds_config.get("zero_optimization", {})
        stage = zero.get("stage", 0)
        accum = ds_config.get("data_types", {}).get("grad_accum_dtype")
        offload = zero.get("offload_optimizer", {}).get("device", "none") in ("cpu", "nvme")
        w = ELEMENT_BYTES[precision]
        if precision == "bf16" and (
            (stage == 1 and accum == "fp32" and not offload)
            or (self.pipeline and stage == 0 and accum in (None, "bf16"))
        ):
            acc = ELEMENT_BYTES[accum or "bf16"]
            terms = {
                "bf16 weights": 2,
                "bf16 gradients": 2,
                # fp32_groups_gradients_flat: zeros_like(bf16_groups_flat)
                "gradient accumulation": acc,
                "fp32 master weights": 4 / dp_size,  # fp32_groups_flat_partition
                "AdamW moments": 8 / dp_size,
            }
            # step(): param_partition.grad = grad_partition.to(fp32), else a view of the buffer
            if acc != 4:
                terms["fp32 master gradients"] = 4 / dp_size
            return terms
        if stage == 0:
            if precision == "fp32":
                return {"fp32 weights": 4, "fp32 gradients": 4, "AdamW moments": 8}
            # fp32_groups = p.clone().float(); at step, fp32_param.grad = fp16_param.grad.to(fp32)
            return {
                f"{precision} weights": 2,
                f"{precision} gradients": 2,
                "fp32 master weights": 4,
                "fp32 master gradients": 4,
                "AdamW moments": 8,
            }
        # offload_optimizer: master weights, their gradients, moments on CPU
        optimizer = 0 if offload else 1 / dp_size
        # stage_1_and_2.py: single_partition_of_fp32_groups (a clone even in fp32) and its .grad at
        # step; stage 2 partitions the gradients (averaged_gradients), stage 3 the weights too
        # (stage3.py, whose fp32 master is the weights' own partition when they are fp32 already)
        master = 0 if stage == 3 and precision == "fp32" else 4 * optimizer
        return {
            f"{precision} weights": w / (dp_size if stage == 3 else 1),
            f"{precision} gradients": w / (dp_size if stage >= 2 else 1),
            "fp32 master weights": master,
            "fp32 master gradients": 4 * optimizer,
            "AdamW moments": 8 * optimizer,
        }
