"""Checks that run once the process group is up and before any engine is built, so that a mismatched
cluster fails with one message listing every problem, instead of deep inside DeepSpeed.

(Rank 0's address was already agreed before the process group started, and the group's start proves
that every rank reaches it; setup/doctor.sh runs the same checks by hand, over ssh.)
"""

import importlib.metadata
import os
import platform
import re
import socket
import subprocess

import torch.distributed as dist

from vit.core.errors import ConfigError
from vit.core.hostfile import hostfile_slots
from vit.runtime.dist_env import rank0_decides

PACKAGES = ("torch", "deepspeed", "timm")
IFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def local_report() -> dict:
    report = {"host": socket.gethostname(), "python": platform.python_version()}
    for name in PACKAGES:
        report[name] = importlib.metadata.version(name)
    for var in IFACE_VARS:
        report[var] = os.environ.get(var, "")
    return report


def problems(reports: list[dict], world_size: int, slots: int | None) -> list[str]:
    """Everything wrong with the ranks' reports, rank 0's values being the reference."""
    found = []
    if slots is not None and world_size > slots:
        found.append(f"world size {world_size} is more than the hostfile's {slots} slots")
    first = reports[0]
    for key in ("python", *PACKAGES, *IFACE_VARS):
        # Interface names may differ between hosts; set on some ranks and not on others is the
        # mistake.
        differs = (lambda a, b: bool(a) != bool(b)) if key in IFACE_VARS else (lambda a, b: a != b)
        odd = [
            f"rank {r} ({rep['host']}) has {rep[key] or 'none'}"
            for r, rep in enumerate(reports)
            if differs(rep[key], first[key])
        ]
        if odd:
            found.append(
                f"{key}: rank 0 ({first['host']}) has {first[key] or 'none'}, but " + ", ".join(odd)
            )
    return found


def offloads_optimizer(ds_config: dict) -> bool:
    zero = ds_config.get("zero_optimization", {})
    return any(
        zero.get(k, {}).get("device") in ("cpu", "nvme")
        for k in ("offload_optimizer", "offload_param")
    )


def nvcc_release(cuda_home: str) -> str | None:
    """The CUDA version of the toolkit's nvcc ('13.0'), or None when it has none that runs."""
    try:
        out = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--version"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else None


def cpu_adam_problem(torch_cuda: str, cuda_home: str | None, built: bool) -> str | None:
    """Why DeepSpeedCPUAdam (ZeRO-Offload) cannot be built on this GPU host, or None: on GPUs
    DeepSpeed builds it against CUDA, with an nvcc of torch's major CUDA version (a missing toolkit
    crashes deep inside DeepSpeed)."""
    if built:
        return None
    install = (
        f"install the CUDA {torch_cuda} toolkit (NVIDIA's "
        f"cuda-toolkit-{torch_cuda.replace('.', '-')} package) and set CUDA_HOME to it (DeepSpeed "
        "then builds the op on first use, or prebuilds it with DS_BUILD_CPU_ADAM=1 pip install "
        "deepspeed); or train without offload_optimizer"
    )
    if cuda_home is None:
        return (
            f"no CUDA toolkit (CUDA_HOME unset, no nvcc on PATH or in /usr/local/cuda): {install}"
        )
    release = nvcc_release(cuda_home)
    if release is None:
        return f"CUDA_HOME={cuda_home} has no working bin/nvcc: {install}"
    if release.split(".")[0] != torch_cuda.split(".")[0]:
        return (
            f"the CUDA toolkit at {cuda_home} is {release}, this torch is built with CUDA "
            f"{torch_cuda}: {install}"
        )
    return None


def check_offload(ds_config: dict, device_type: str) -> None:
    """Collective: ZeRO-Offload on GPUs needs DeepSpeed's CPU Adam op; every rank says whether its
    host can have it, and every rank stops alike, naming the hosts, when one cannot."""
    if device_type != "cuda" or not offloads_optimizer(ds_config):
        return
    import torch
    from torch.utils import cpp_extension

    built = os.path.isfile(
        os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR", ""), "cpu_adam", "cpu_adam.so")
    )
    try:
        from deepspeed.git_version_info import installed_ops

        built = built or bool(installed_ops.get("cpu_adam"))
    except ImportError:
        pass
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(
        reports,
        (
            socket.gethostname(),
            cpu_adam_problem(torch.version.cuda, cpp_extension.CUDA_HOME, built),
        ),
    )

    def verdict():
        found = {host: why for host, why in reports if why}
        if found:
            raise ConfigError(
                "ZeRO-Offload (offload_optimizer) on GPUs needs DeepSpeed's CPU Adam op: "
                + "; ".join(f"{host}: {why}" for host, why in found.items())
            )

    rank0_decides(verdict)


def check(world_size: int, hostfile: str | None) -> None:
    """Collective: every rank calls it; raises ConfigError on every rank when rank 0 finds
    problems."""
    reports = [None] * world_size
    dist.all_gather_object(reports, local_report())

    def verdict():
        found = problems(reports, world_size, hostfile_slots(hostfile) if hostfile else None)
        if found:
            raise ConfigError(f"preflight: {'; '.join(found)}")

    rank0_decides(verdict)
