"""Plain PyTorch DistributedDataParallel with torch.amp, no DeepSpeed: the baseline (engine.py),
torch's DDP communication hooks (comm_hooks.py, --comm-hook) and what it declares (SPEC): fp32
weights under autocast, its bucketed all-reduce overlapped with backward, fp16/bf16/PowerSGD
compression."""

import math
from dataclasses import dataclass

from vit.core.costs import TORCH_GRAD_BYTES, ring_allreduce_s
from vit.core.errors import ConfigError
from vit.engines.ddp.options import CommSettings
from vit.engines.step_cost import DataParallelSpec, autocast_state


@dataclass(frozen=True)
class DDPWork:
    """What its price reads of the run's options: PowerSGD's rank."""

    powersgd_rank: int = CommSettings.powersgd_rank


class DDPSpec(DataParallelSpec):
    option_groups = {"comm": (CommSettings, "gradient compression (--engine ddp)")}

    def planner_input(self, args):
        return DDPWork(args.get("powersgd_rank", CommSettings.powersgd_rank))

    def compressions(self, precision):
        return "none", "fp16", "bf16", "powersgd"

    def compression_of(self, settings, ds_config):
        return settings.comm.comm_hook

    def compression_options(self, compression):
        return ({"comm_hook": compression} if compression != "none" else {}), {}

    def check_options(self, settings):
        comm = settings.comm
        if comm.comm_hook == "powersgd" and comm.powersgd_start_step < 2:
            raise ConfigError(
                f"--powersgd-start-step must be at least 2, got {comm.powersgd_start_step} "
                "(torch's start_powerSGD_iter: DDP rebuilds its buckets after the first step)"
            )

    def resumes(self, saved, where):
        """Its own checkpoints, and --engine zero's sharded state (stages 1 to 3) through
        DeepSpeed's universal checkpoint (from_zero.py)."""
        if saved["engine"] != "zero" or saved["pipeline_stages"] != 1:
            return super().resumes(saved, where)
        if saved["zero_stage"] == 0:
            raise ConfigError(
                f"{where} was written by --engine zero at ZeRO stage 0, which --engine "
                f"{self.name} does not resume (it takes the sharded state of stages 1 to 3); "
                "resume with --engine zero"
            )
        return "universal"

    def changes_learning(self, c):
        if c.compression == "powersgd":
            return (
                "PowerSGD changes what is learned (low-rank gradients): --comm-hook powersgd is "
                "yours to choose (or --auto-allow powersgd)"
            )
        return None

    def state_bytes(self, precision, ds_config, dp_size=1, stashed_copies=0, compression="none"):
        # engine.py builds DDP with gradient_as_bucket_view: the gradients are its all-reduce
        # buckets (torch/nn/parallel/distributed.py), no second copy
        terms = autocast_state(precision)
        if compression == "powersgd":
            # torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py: error_dict holds, per
            # bucket, a tensor of the bucket's length in the gradients' dtype (fp32 here). Its P and
            # Q, (n + m) x rank numbers per n x m matrix, are left out: 0.04 bytes a parameter for
            # ViT-B/16 at rank 4
            terms["PowerSGD error feedback"] = 4
        return terms

    def grad_bytes(self, work, layers, compression):
        """PowerSGD sends (rows + columns) x rank per matrix where torch's hook compresses it (rows
        x columns > 2 x that, its min_compression_rate), every other parameter whole."""
        if compression != "powersgd":
            return super().grad_bytes(work, layers, compression)
        r, elems = self.work_input(work).powersgd_rank, 0
        for layer in layers:
            whole = layer.params - sum(n * m for n, m in layer.matrices)
            elems += whole + sum(
                (n + m) * r if n * m > 2 * (n + m) * r else n * m for n, m in layer.matrices
            )
        return elems * TORCH_GRAD_BYTES

    def link_s(self, c, hosts, net, work, calib, backward_s):
        """Its bucketed all-reduce overlaps the last micro-batch's backward on the slowest rank,
        except the last bucket: max(C_bucket, C - backward); PowerSGD costs three collectives a
        bucket (P, Q, the uncompressed tensors)."""
        rounds = 3 if c.compression == "powersgd" else 1
        wire = self.grad_bytes(work, work.layers, c.compression)
        dense = self.grad_bytes(work, work.layers, "none")  # DDP buckets the uncompressed gradients
        buckets = max(1, math.ceil(dense / calib.ddp_bucket_bytes))
        comm = ring_allreduce_s(wire, hosts, net, calib, buckets * rounds)
        tail = ring_allreduce_s(wire / buckets, hosts, net, calib, rounds)
        return max(tail, comm - backward_s) if calib.ddp_overlap else comm


SPEC = DDPSpec(
    "ddp",
    "vit.engines.ddp.engine",
    zero_stages=(0,),
    fp16=True,
    freeze=True,
    default_ds_config="zero0.json",
    comm_hooks=True,
)
