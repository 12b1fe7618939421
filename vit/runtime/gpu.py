"""GPUs, decided before the process group starts: every rank reports its CUDA device through the
launcher's store, and every rank reads all reports and reaches the same verdict: one backend for the
job, one GPU per rank (the one at LOCAL_RANK, as DeepSpeed picks), one torch build with kernels for
every card, and a precision every card runs (vit.runtime.precision). Also TF32, and two habits for
code that runs beside NCCL: fork the random state of this rank's GPU only, and wait for this rank's
queued work only."""

import json
import os
import re
import socket
import subprocess
from datetime import timedelta

import torch

from vit.core.errors import ConfigError
from vit.core.spec import EngineSpec
from vit.runtime import precision

# CUDA major version of a torch build -> the oldest Linux driver that runs it (NVIDIA's
# minor-version compatibility; the same numbers as BUILDS in scripts/bootstrap.sh).
MIN_DRIVER = {"13": "580.65.06", "12": "525.60.13", "11": "450.80.02"}
TF32_FROM = (8, 0)


def nvidia_smi() -> dict | None:
    """What the NVIDIA driver sees (driver version, the CUDA version it supports, GPU names), or
    None."""

    def ask(*args):
        try:
            p = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout if p.returncode == 0 else None

    listed = ask("--query-gpu=driver_version,name", "--format=csv,noheader")
    rows = [line.split(",", 1) for line in (listed or "").splitlines() if "," in line]
    if not rows:
        return None
    cuda = re.search(r"CUDA Version:\s*([0-9.]+)", ask() or "")
    return {
        "driver": rows[0][0].strip(),
        "cuda": cuda.group(1) if cuda else None,
        "gpus": [name.strip() for _, name in rows],
    }


def local_report(wanted: str, rank: int, local_rank: int) -> dict:
    """This rank's CUDA device as torch (and, where torch sees none, the driver) sees it."""
    report = {
        "rank": rank,
        "local_rank": local_rank,
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda": wanted != "cpu" and torch.cuda.is_available(),
    }
    if report["cuda"]:
        report.update(gpus=torch.cuda.device_count(), arch_list=torch.cuda.get_arch_list())
        if local_rank < report["gpus"]:
            props = torch.cuda.get_device_properties(local_rank)
            report.update(
                name=props.name,
                capability=[props.major, props.minor],
                ds_fp16=precision.deepspeed_fp16(local_rank),
            )
    elif wanted != "cpu":
        report["smi"] = nvidia_smi()
    return report


def exchange(store, world_size: int, report: dict, timeout_s: float) -> list[dict]:
    """Every rank's report, through the store the process group will use (so under any launcher)."""
    store.set(f"vit/device/{report['rank']}", json.dumps(report))
    keys = [f"vit/device/{r}" for r in range(world_size)]
    store.wait(keys, timedelta(seconds=timeout_s))
    reports = [json.loads(store.get(k)) for k in keys]
    # Rank 0 holds the store: it leaves (perhaps to stop on the verdict) only once every rank has
    # read.
    store.set(f"vit/device_read/{report['rank']}", "1")
    if report["rank"] == 0:
        store.wait(
            [f"vit/device_read/{r}" for r in range(world_size)], timedelta(seconds=timeout_s)
        )
    return reports


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def _ranks(reports: list[dict]) -> str:
    rs = [r["rank"] for r in reports]
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"


def _by_host(reports: list[dict]) -> dict[str, list[dict]]:
    hosts: dict[str, list[dict]] = {}
    for r in reports:
        hosts.setdefault(r["host"], []).append(r)
    return hosts


def why_no_cuda(report: dict) -> str:
    """Why torch sees no GPU on this host, in the words that say what to do."""
    smi, build = report.get("smi"), report["torch_cuda"]
    if not smi:
        return "no NVIDIA GPU or driver (nvidia-smi finds none)"
    seen = f"nvidia-smi sees {len(smi['gpus'])} GPU(s) ({smi['gpus'][0]})"
    if build is None:
        return (
            f"{seen} but this torch ({report['torch']}) is a CPU-only build: run "
            f"scripts/bootstrap.sh there"
        )
    need = MIN_DRIVER.get(build.split(".")[0])
    tag = "cu" + build.replace(".", "")
    if need and _version(smi["driver"]) < _version(need):
        supports = f" supports CUDA {smi['cuda']}" if smi["cuda"] else ""
        return (
            f"driver {smi['driver']}{supports}; this torch ({tag}) needs driver >= "
            f"{need}: update the driver, or run scripts/bootstrap.sh there (--print-torch "
            "names the build this driver runs)"
        )
    return (
        f"{seen} but torch.cuda.is_available() is False (torch {tag}, driver {smi['driver']}, "
        f"CUDA_VISIBLE_DEVICES={report['visible']})"
    )


def choose_device(reports: list[dict], wanted: str) -> str:
    """'cuda' or 'cpu' for the whole job (--device auto|cuda|cpu); a mix, or a GPU torch cannot use,
    is one ConfigError naming the hosts and why: the job never falls back to the CPU on its own."""
    if wanted == "cpu":
        return "cpu"
    lacking = [r for r in reports if not r["cuda"]]
    if not lacking:
        return "cuda"
    if wanted == "auto" and len(lacking) == len(reports) and not any(r.get("smi") for r in reports):
        return "cpu"
    having = _by_host([r for r in reports if r["cuda"]])
    reasons: dict[tuple[str, str], list[dict]] = {}
    for r in lacking:
        reasons.setdefault((r["host"], why_no_cuda(r)), []).append(r)
    why = "; ".join(f"{host} ({_ranks(rs)}): {reason}" for (host, reason), rs in reasons.items())
    if having:
        lead = f"CUDA on {', '.join(having)} but not on "
    else:
        lead = "--device cuda, but no CUDA on " if wanted == "cuda" else "no usable CUDA on "
    raise ConfigError(
        f"{lead}{why}; every rank must run on the same backend (--device cpu trains on the CPUs)"
    )


def check_one_gpu_per_rank(reports: list[dict]) -> None:
    """Rank r uses GPU LOCAL_RANK of its host, as DeepSpeed does: a host needs a visible GPU per
    rank."""
    bad = []
    for host, rs in _by_host(reports).items():
        gpus = min(r["gpus"] for r in rs)
        if any(r["local_rank"] >= gpus for r in rs):
            visible = "unset" if rs[0]["visible"] is None else rs[0]["visible"]
            bad.append(
                f"{host} runs {_ranks(rs)} (local ranks "
                f"{', '.join(str(r['local_rank']) for r in rs)}) but {gpus} GPU(s) "
                f"are visible (CUDA_VISIBLE_DEVICES={visible})"
            )
    if bad:
        raise ConfigError(
            f"one GPU per rank: {'; '.join(bad)}; give each host at most as many slots as GPUs "
            "(setup/make_hostfile.sh), and let every rank see all its host's GPUs"
        )


def runs_on(capability: list[int], arch_list: list[str]) -> bool:
    """A card runs kernels built for its own major version and an equal or lower minor (sm_XY), or
    PTX (compute_XY) for an equal or lower capability."""
    major, minor = capability
    for arch in arch_list:
        kind, _, num = arch.partition("_")
        num = re.sub(r"\D", "", num)  # sm_90a
        if not num:
            continue
        v = int(num[:-1] or 0), int(num[-1])
        if (kind == "sm" and v[0] == major and v[1] <= minor) or (
            kind == "compute" and v <= (major, minor)
        ):
            return True
    return False


def check_arch(reports: list[dict]) -> None:
    """Refuse, before training, a card this torch build has no kernels for."""
    bad = [
        f"{r['host']} (rank {r['rank']}): {r['name']}, compute capability {r['capability'][0]}."
        f"{r['capability'][1]}"
        for r in reports
        if not runs_on(r["capability"], r["arch_list"])
    ]
    if bad:
        build = "cu" + reports[0]["torch_cuda"].replace(".", "")
        raise ConfigError(
            f"this torch ({build}) has no kernels for {'; '.join(bad)} (it has "
            f"{' '.join(reports[0]['arch_list'])}): run scripts/bootstrap.sh there, which picks a "
            "build for these cards (cu126 for cards older than Turing)"
        )


def check_one_torch(reports: list[dict]) -> None:
    """One torch build on every host: builds for different CUDA versions bring different NCCL
    versions, and NCCL refuses a mix when the process group starts (a DistBackendError before any
    preflight). The fix names the build here with kernels for every card and the oldest CUDA (the
    oldest driver): cu126 where it is one."""
    builds: dict[str, list[dict]] = {}
    for r in reports:
        builds.setdefault(r["torch"], []).append(r)
    if len(builds) < 2:
        return
    which = "; ".join(f"{build} on {', '.join(_by_host(rs))}" for build, rs in builds.items())
    fits = sorted(
        (_version(rs[0]["torch_cuda"]), "cu" + rs[0]["torch_cuda"].replace(".", ""))
        for rs in builds.values()
        if all(runs_on(r["capability"], rs[0]["arch_list"]) for r in reports)
    )
    fix = (
        f"run TORCH_CUDA={fits[0][1]} scripts/bootstrap.sh on every host (it has "
        "kernels for every card here)"
        if fits
        else "none of these builds has kernels for every card here: "
        "leave out the hosts one build cannot run"
    )
    raise ConfigError(
        f"torch differs between hosts: {which}; NCCL refuses ranks whose torch builds bring "
        f"different NCCL versions: {fix}"
    )


def decide(
    reports: list[dict],
    wanted: str,
    requested_precision: str | None = None,
    engine: EngineSpec | None = None,
) -> str:
    """The job's device type from every rank's report, or the ConfigError every rank raises alike;
    with an engine, also a --precision (or the JSON's) that some GPU cannot train in under it
    (vit.runtime.precision)."""
    kind = choose_device(reports, wanted)
    if kind == "cuda":
        check_one_gpu_per_rank(reports)
        check_arch(reports)
        check_one_torch(reports)
        if engine is not None:
            precision.choose(
                requested_precision,
                engine,
                [
                    {
                        "host": r["host"],
                        "device": r["name"],
                        "capability": "{}.{}".format(*r["capability"]),
                        **precision.gpu_precisions(r["capability"], engine, r["ds_fp16"]),
                    }
                    for r in reports
                ],
            )
    return kind


def set_tf32(device: torch.device, on: bool) -> str | None:
    """TF32 for fp32 matmuls and convolutions on Ampere and newer (--tf32); what was done, for the
    log."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < TF32_FROM:
        return None
    mode = "tf32" if on else "ieee"
    torch.backends.cuda.matmul.fp32_precision = mode
    torch.backends.cudnn.conv.fp32_precision = mode
    return f"fp32 matmuls and convolutions in {mode} (--tf32 {'on' if on else 'off'})"


def fork_rng(device: torch.device):
    """torch.random.fork_rng for this rank's device alone: without `devices` it saves and restores
    the state of every visible GPU, creating a context on each (memory on GPUs other ranks train
    on)."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def wait_for_queued(device: torch.device) -> None:
    """The host waits for the work queued so far on this device's current stream (nothing to wait
    for on a CPU). Not device-wide: torch.cuda.synchronize() would also wait for NCCL receives
    posted ahead on their own streams, which may need this very rank to send first (a deadlock)."""
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        event.synchronize()
