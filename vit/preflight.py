"""Checks that run once the process group is up and before any engine is built, so that a mismatched
cluster fails with one message listing every problem, instead of deep inside DeepSpeed.

(Rank 0's address was already agreed before the process group started, and the group's start proves
that every rank reaches it; setup/doctor.sh runs the same checks by hand, over ssh.)
"""
import importlib.metadata
import os
import platform
import socket
from pathlib import Path

import torch.distributed as dist

from vit.dist_env import rank0_decides
from vit.errors import ConfigError

PACKAGES = ("torch", "deepspeed", "timm")
IFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def local_report() -> dict:
    report = {"host": socket.gethostname(), "python": platform.python_version()}
    for name in PACKAGES:
        report[name] = importlib.metadata.version(name)
    for var in IFACE_VARS:
        report[var] = os.environ.get(var, "")
    return report


def hostfile_slots(path: str) -> int:
    """Total slots of an Open MPI / DeepSpeed hostfile (`host slots=N`; a host without slots= counts 1)."""
    total = 0
    for line in Path(path).read_text().splitlines():
        words = line.split("#")[0].split()
        if words:
            slots = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
            total += int(slots[0]) if slots else 1
    return total


def problems(reports: list[dict], world_size: int, slots: int | None) -> list[str]:
    """Everything wrong with the ranks' reports, rank 0's values being the reference."""
    found = []
    if slots is not None and world_size > slots:
        found.append(f"world size {world_size} is more than the hostfile's {slots} slots")
    first = reports[0]
    for key in ("python", *PACKAGES, *IFACE_VARS):
        # Interface names may differ between hosts; set on some ranks and not on others is the mistake.
        differs = (lambda a, b: bool(a) != bool(b)) if key in IFACE_VARS else (lambda a, b: a != b)
        odd = [f"rank {r} ({rep['host']}) has {rep[key] or 'none'}" for r, rep in enumerate(reports)
               if differs(rep[key], first[key])]
        if odd:
            found.append(f"{key}: rank 0 ({first['host']}) has {first[key] or 'none'}, but " + ", ".join(odd))
    return found


def check(world_size: int, hostfile: str | None) -> None:
    """Collective: every rank calls it; raises ConfigError on every rank when rank 0 finds problems."""
    reports = [None] * world_size
    dist.all_gather_object(reports, local_report())

    def verdict():
        found = problems(reports, world_size, hostfile_slots(hostfile) if hostfile else None)
        if found:
            raise ConfigError(f"preflight: {'; '.join(found)}")

    rank0_decides(verdict)
