"""VIT_TEST_OOM_AT=RANK:STEP (STEP >= 2): rank RANK's forward raises cuBLAS's out-of-memory error (a
RuntimeError, as torch raises it) during step STEP, so that tests reach the real handling without a
GPU; RANK:probe makes the --loss-scale auto probe's first loss raise it (vit.planner.loss_scale)."""

import os

import torch

from vit.planner import loss_scale
from vit.runtime import plugins

INJECTED = (
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)` "
    "(injected by VIT_TEST_OOM_AT)"
)


def start(rank: int, watchdog) -> None:
    oom_rank, at = os.environ["VIT_TEST_OOM_AT"].split(":")
    if rank != int(oom_rank):
        return
    if at == "probe":

        def failing_loss(*args):
            raise RuntimeError(INJECTED)

        loss_scale.loss_fn = failing_loss
        return
    step = int(at)

    def hook(module, args):
        if watchdog.step >= step - 1:  # the census and step 1 have run forwards already
            handle.remove()  # once: the message's estimate runs forwards too
            raise RuntimeError(INJECTED)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)


plugins.add("start", start)
