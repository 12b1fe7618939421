"""What fits in a rank's memory: the message of a rank that ran out of it (with what would fit), and
--micro-batch-size auto (the largest micro-batch whose forward and backward fit every rank)."""
import os

import psutil
import torch

from vit.errors import OutOfMemory
from vit.hetero.profile import BYTES_PER_PARAM, USABLE_MEMORY, activation_factor
from vit.model import build_layers

# What an engine holds per parameter beyond the weights and gradients a forward and backward already hold:
# AdamW's two moments and, in half precision, the fp32 master weights.
OPTIMIZER_BYTES_PER_PARAM = 12


def device_memory(dev: torch.device, local_world_size: int) -> tuple[str, float, float]:
    """(device name, free bytes, total bytes); ranks on one host share its RAM."""
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return torch.cuda.get_device_properties(dev).name, free, total
    mem = psutil.virtual_memory()
    name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                "CPU")
    return name, mem.available / local_world_size, mem.total / local_world_size


def likely_precision(requested: str, dev: torch.device) -> str:
    """The precision a run will train in, before the census settles it: auto (or none given) on GPUs is half
    precision (every CUDA card runs fp16), on CPUs fp32."""
    if requested in ("fp32", "fp16", "bf16"):
        return requested
    if dev.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.get_device_capability(dev) >= (8, 0) else "fp16"


def _layers(plan) -> list:
    data, s = plan.data, plan.settings
    return build_layers(s.model.model, data.num_classes, data.in_chans, data.img_size, s.train.seed)


def estimate_fit(total_bytes: float, params: int, act_bytes_per_sample: float, precision: str) -> int:
    """Samples per micro-batch that fit: parameters, gradients and AdamW state, and activations in the run's
    precision, within USABLE_MEMORY of the device (a plan; negative when the model alone does not fit)."""
    per_sample = act_bytes_per_sample * activation_factor(precision)
    return int((USABLE_MEMORY * total_bytes - params * BYTES_PER_PARAM) // per_sample)


def out_of_memory(plan, dev: torch.device, step: int, error: Exception) -> OutOfMemory:
    """A torch.cuda.OutOfMemoryError as one message: the device and its memory, the micro-batch, what would fit."""
    from vit.hetero.profile import profile_layers

    name, _, total = device_memory(dev, plan.job.local_world_size)
    precision = likely_precision(plan.requested_precision, dev)
    profile = profile_layers(_layers(plan), plan.data.train[0][0][None])  # on the CPU: the GPU is full
    params, act = sum(p["params"] for p in profile), sum(p["act_bytes"] for p in profile)
    fit = estimate_fit(total, params, act, precision)
    micro, accum = plan.batch.micro_batch, plan.batch.grad_accum
    hints = []
    if 1 <= fit < micro:
        keep = f" --grad-accum {micro * accum // fit}" if micro * accum % fit == 0 else ""
        hints.append(f"--micro-batch-size {fit}{keep}" + (" (the same global batch)" if keep else ""))
    elif fit >= micro:
        hints.append(f"--micro-batch-size {max(1, micro // 2)} (the estimate, {fit}, says {micro} fits: other "
                     "processes may hold memory on this device)")
    hints += ["--micro-batch-size auto", "deepspeed_configs/zero2_offload.json (optimizer state in CPU memory)",
              "--engine pipeline with more --pipeline-stages (each rank holds fewer layers)"]
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return OutOfMemory(
        f"out of memory during step {step + 1} on {dev} ({name}, {total / 2**30:.1f} GiB) at micro-batch {micro} "
        f"({precision}): {first}. Estimated to fit: {max(fit, 0)} samples per micro-batch (parameters, gradients "
        f"and AdamW state {params * BYTES_PER_PARAM / 2**30:.2f} GiB + activations "
        f"{act * activation_factor(precision) / 2**20:.2f} MiB per sample, in {USABLE_MEMORY:.0%} of "
        f"{total / 2**30:.1f} GiB). Try " + ", or ".join(hints))


def inject_oom_for_tests(rank: int, watchdog) -> None:
    """VIT_TEST_OOM_AT=RANK:STEP (STEP >= 2) makes rank RANK's forward raise CUDA's out-of-memory error during
    step STEP, so that tests reach the real handling without a GPU."""
    at = os.environ.get("VIT_TEST_OOM_AT")
    if not at or int(at.split(":")[0]) != rank:
        return
    step = int(at.split(":")[1])

    def hook(module, args):
        if watchdog.step >= step - 1:  # the census and step 1 have run forwards already
            handle.remove()  # once: the message's estimate runs forwards too
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by "
                                              "VIT_TEST_OOM_AT)")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
