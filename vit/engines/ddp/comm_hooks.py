"""--comm-hook: torch's DDP communication hooks on the DDP engine's gradient all-reduce, and
PowerSGD's state in its checkpoint (torch's PowerSGDState.__getstate__/__setstate__: error feedback,
warm-start P and Q, its step counter)."""

import logging
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from vit.engines.base import save_atomic
from vit.engines.ddp.options import CommSettings

HALF_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def bucket_options(model, comm: CommSettings) -> dict:
    """DDP's bucket size for this hook: PowerSGD on gloo puts the whole model in one bucket.

    torch's powerSGD_hook issues a bucket's P and Q all-reduces from callbacks of its first
    all-reduce. On gloo those run on gloo's thread when that all-reduce completes, while the
    backward pass issues the next bucket's all-reduce from the main thread: the two ranks can issue
    them in different orders, and gloo pairs collectives by order (a size mismatch that aborts, or a
    hang). NCCL completes a collective's future when it is enqueued, so its callbacks run at once on
    the issuing thread, in the same order on every rank. One bucket (DDP's first is 1 MiB by
    default, 262k fp32 parameters) leaves nothing to race; its all-reduce no longer overlaps
    the backward pass."""
    if comm.comm_hook != "powersgd" or dist.get_backend() != "gloo":
        return {}
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"bucket_cap_mb": max(1, math.ceil(grad_bytes / 2**20))}


class CommHook:
    """The hook registered on one DistributedDataParallel module (none: nothing registered)."""

    def __init__(self, model, comm: CommSettings, device):
        self.comm, self.state, self.device = comm, None, device
        self.unprimed = self.priming = False  # see prime()
        if comm.comm_hook in HALF_HOOKS:
            # no state: the process group's default
            model.register_comm_hook(None, HALF_HOOKS[comm.comm_hook])
        elif comm.comm_hook == "powersgd":
            with _quiet():
                self.state = psgd.PowerSGDState(
                    None,
                    matrix_approximation_rank=comm.powersgd_rank,
                    start_powerSGD_iter=comm.powersgd_start_step,
                )
            model.register_comm_hook(self.state, self._powersgd)

    def _powersgd(self, state, bucket):
        """torch's powerSGD_hook; while priming, a plain all-reduce that leaves the state as it
        is."""
        if self.priming:
            return default_hooks.allreduce_hook(None, bucket)
        return psgd.powerSGD_hook(state, bucket)

    def prime(self, model, x) -> None:
        """A restored PowerSGD state is keyed by DDP's buckets as laid out after its first step (in
        gradient-ready order), but a fresh DDP starts with one bucket in parameter order: one
        forward and backward on `x`, plain all-reduce, gradients dropped and the random state kept,
        makes DDP lay them out again before the step that compresses with that state."""
        self.unprimed, self.priming = False, True
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            model(x).float().sum().backward()
        model.zero_grad(set_to_none=True)
        self.priming = False

    @property
    def key(self) -> str:
        """The hook as its options (ddp.pt records it, so a resume can tell whether the state still
        applies)."""
        return (
            "--comm-hook "
            + self.comm.comm_hook
            + (f" --powersgd-rank {self.comm.powersgd_rank}" if self.state is not None else "")
        )

    def save(self, folder: str, rank: int) -> None:
        """PowerSGD's state of this rank (its error feedback is its own) into the checkpoint
        folder."""
        if self.state is not None:
            with _quiet():
                save_atomic(
                    self.state.__getstate__(), os.path.join(folder, f"powersgd_rank{rank}.pt")
                )

    def load(self, folder: str, rank: int, saved_key: str | None) -> None:
        """This rank's PowerSGD state from a checkpoint of the same hook and rank; after another:
        one warning and a fresh state."""
        was = saved_key or "--comm-hook none"  # a checkpoint from before --comm-hook had none
        if was != self.key:
            if rank == 0:
                print(
                    f"warning: the checkpoint was trained with {was}; this run's "
                    f"{self.key} starts without its state",
                    file=sys.stderr,
                )
            return
        if self.state is not None:
            state = torch.load(
                os.path.join(folder, f"powersgd_rank{rank}.pt"),
                map_location=self.device,
                weights_only=False,  # numpy's RandomState besides tensors
            )
            with _quiet():
                self.state.__setstate__(state)  # the default process group, as DDP's
            # this run's warm-up, if it changed
            self.state.start_powerSGD_iter = self.comm.powersgd_start_step
            # its next step compresses
            self.unprimed = self.state.iter >= self.state.start_powerSGD_iter


class _quiet:
    """PowerSGD logs its config and a note on the process group at every save and load: kept off the
    console."""

    def __enter__(self):
        self.level = psgd.logger.level
        psgd.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        psgd.logger.setLevel(self.level)
