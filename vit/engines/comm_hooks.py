"""--comm-hook: torch's DDP communication hooks on the DDP engine's gradient all-reduce, and PowerSGD's state in its
checkpoint (torch's PowerSGDState.__getstate__/__setstate__: error feedback, warm-start P and Q, its step counter)."""
import logging
import sys

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd

from vit.config.settings import CommSettings

HALF_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


class CommHook:
    """The hook registered on one DistributedDataParallel module (none: nothing registered)."""

    def __init__(self, model, comm: CommSettings):
        self.comm, self.state = comm, None
        self.unprimed = self.priming = False  # see prime()
        if comm.comm_hook in HALF_HOOKS:
            model.register_comm_hook(None, HALF_HOOKS[comm.comm_hook])  # no state: the process group's default
        elif comm.comm_hook == "powersgd":
            with _quiet():
                self.state = psgd.PowerSGDState(None, matrix_approximation_rank=comm.powersgd_rank,
                                                start_powerSGD_iter=comm.powersgd_start_step)
            model.register_comm_hook(self.state, self._powersgd)

    def _powersgd(self, state, bucket):
        """torch's powerSGD_hook; while priming, a plain all-reduce that leaves the state as it is."""
        if self.priming:
            return default_hooks.allreduce_hook(None, bucket)
        return psgd.powerSGD_hook(state, bucket)

    def prime(self, model, x) -> None:
        """A restored PowerSGD state is keyed by DDP's buckets as laid out after its first step (in gradient-ready
        order), but a fresh DDP starts with one bucket in parameter order: one forward and backward on `x`, plain
        all-reduce, gradients dropped and the random state kept, makes DDP lay them out again before the step that
        compresses with that state."""
        self.unprimed, self.priming = False, True
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            model(x).float().sum().backward()
        model.zero_grad(set_to_none=True)
        self.priming = False

    def _key(self) -> str:
        return "--comm-hook " + self.comm.comm_hook + (f" --powersgd-rank {self.comm.powersgd_rank}"
                                                         if self.state is not None else "")

    def state_dict(self) -> dict:
        """What the checkpoint keeps: the hook, its rank and PowerSGD's state (None for a hook without state)."""
        with _quiet():
            return {"key": self._key(), "state": self.state.__getstate__() if self.state is not None else None}

    def load_state_dict(self, saved: dict | None) -> None:
        """PowerSGD's state from a checkpoint of the same hook and rank; after another: one warning, a fresh state."""
        was = saved["key"] if saved else "--comm-hook none"  # a checkpoint from before --comm-hook: no hook
        if was != self._key():
            print(f"warning: the checkpoint was trained with {was}; this run's {self._key()} starts without its "
                  "state", file=sys.stderr)
        elif self.state is not None:
            with _quiet():
                self.state.__setstate__(saved["state"])  # the default process group, as DDP's
            self.state.start_powerSGD_iter = self.comm.powersgd_start_step  # this run's warm-up, if it changed
            self.unprimed = self.state.iter >= self.state.start_powerSGD_iter  # its next step compresses


class _quiet:
    """PowerSGD logs its config and a note on the process group at every save and load: kept off the console."""

    def __enter__(self):
        self.level = psgd.logger.level
        psgd.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        psgd.logger.setLevel(self.level)
