"""VIT_TEST_OOM_AT=RANK:STEP (STEP >= 2): rank RANK's forward raises cuBLAS's out-of-memory error (a RuntimeError,
as torch raises it) during step STEP, so that tests reach the real handling without a GPU."""
import os

import torch

from vit import plugins


def start(rank: int, watchdog) -> None:
    oom_rank, step = (int(v) for v in os.environ["VIT_TEST_OOM_AT"].split(":"))
    if rank != oom_rank:
        return

    def hook(module, args):
        if watchdog.step >= step - 1:  # the census and step 1 have run forwards already
            handle.remove()  # once: the message's estimate runs forwards too
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)` "
                               "(injected by VIT_TEST_OOM_AT)")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)


plugins.add("start", start)
