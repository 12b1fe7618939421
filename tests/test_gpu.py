"""GPU rules at the library boundary (there is no GPU here): device reports as torch.cuda and a fake
nvidia-smi would give them, and the verdicts every rank reaches from them; emulated bf16, TF32,
device_id; and real 2-rank runs whose ranks disagree about CUDA."""

import ast
import contextlib
import sys
import types

import pytest
import torch
from helpers import ROOT, launch, plugin_env, run_cmd

from vit.core.errors import ConfigError
from vit.engines.registry import spec
from vit.planner import census
from vit.run.cli import parse
from vit.run.compat import check_precision
from vit.run.plan import make_plan
from vit.runtime import dist_env, gpu
from vit.runtime.dist_env import Job
from vit.runtime.precision import choose

ARCH_CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]

# nvidia-smi of a host whose driver is $FAKE_DRIVER (CUDA $FAKE_DRIVER_CUDA) with two RTX 3070s: the
# two queries vit.runtime.gpu makes, and a failure on anything else, as the real one fails on a
# field it does not know.
FAKE_SMI = """#!/bin/sh
case "$*" in
  "--query-gpu=driver_version,name --format=csv,noheader")
    echo "$FAKE_DRIVER, NVIDIA GeForce RTX 3070"; echo "$FAKE_DRIVER, NVIDIA GeForce RTX 3070" ;;
  "") printf '| NVIDIA-SMI %s    Driver Version: %s    ' "$FAKE_DRIVER" "$FAKE_DRIVER"
      echo "CUDA Version: $FAKE_DRIVER_CUDA |" ;;
  *) echo "fake nvidia-smi: unexpected arguments: $*"; exit 2 ;;
esac
"""


@pytest.fixture
def smi_dir(tmp_path):
    d = tmp_path / "smi"
    d.mkdir()
    (d / "nvidia-smi").write_text(FAKE_SMI)
    (d / "nvidia-smi").chmod(0o755)
    return d


ARCH_CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
ARCH_LISTS = {"cu130": ARCH_CU130, "cu126": ARCH_CU126}  # torch's kernels by its CUDA build


def gpu_report(
    rank,
    host,
    local_rank=0,
    gpus=1,
    capability=(8, 6),
    name="NVIDIA GeForce RTX 3070",
    build="cu130",
    ds_fp16=True,
):
    return {
        "rank": rank,
        "local_rank": local_rank,
        "host": host,
        "torch": f"2.14.1+{build}",
        "torch_cuda": f"{build[2:-1]}.{build[-1]}",
        "visible": None,
        "cuda": True,
        "gpus": gpus,
        "arch_list": ARCH_LISTS[build],
        "name": name,
        "capability": list(capability),
        "ds_fp16": ds_fp16,
    }


def gtx_1080(rank, host, ds_fp16=False):
    return gpu_report(
        rank,
        host,
        capability=(6, 1),
        name="NVIDIA GeForce GTX 1080",
        build="cu126",
        ds_fp16=ds_fp16,
    )


def cpu_report(rank, host, smi=None, torch_cuda="13.0"):
    return {
        "rank": rank,
        "local_rank": 0,
        "host": host,
        "torch": "2.14.1+cu130",
        "torch_cuda": torch_cuda,
        "visible": None,
        "cuda": False,
        "smi": smi,
    }


OLD_DRIVER = {"driver": "550.54.15", "cuda": "12.4", "gpus": ["NVIDIA GeForce RTX 3070"]}


def test_a_driver_too_old_for_this_torch_is_named_with_what_it_supports(monkeypatch, smi_dir):
    """The report a rank makes where nvidia-smi sees GPUs but torch does not (the real torch here is
    cu130)."""
    monkeypatch.setenv("PATH", f"{smi_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_DRIVER", "550.54.15")
    monkeypatch.setenv("FAKE_DRIVER_CUDA", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    report = gpu.local_report("auto", rank=3, local_rank=0)
    assert report["cuda"] is False
    assert report["smi"] == {
        "driver": "550.54.15",
        "cuda": "12.4",
        "gpus": ["NVIDIA GeForce RTX 3070"] * 2,
    }
    report["host"] = "cn3"
    with pytest.raises(ConfigError) as e:
        gpu.decide([gpu_report(0, "cn0"), report], "auto")
    assert str(e.value).startswith(
        "CUDA on cn0 but not on cn3 (rank 3): driver 550.54.15 supports "
        "CUDA 12.4; "
        "this torch (cu130) needs driver >= 580.65.06: update the "
        "driver, or run "
        "scripts/bootstrap.sh there"
    )
    # No nvidia-smi at all: nothing to ask the driver.
    monkeypatch.setenv("PATH", "/nonexistent")
    assert gpu.local_report("auto", 0, 0)["smi"] is None
    # --device cpu asks nobody.
    assert "smi" not in gpu.local_report("cpu", 0, 0)


def test_one_backend_for_the_job():
    gpus = [gpu_report(0, "cn0"), gpu_report(1, "cn1")]
    assert gpu.decide(gpus, "auto") == "cuda" and gpu.decide(gpus, "cpu") == "cpu"
    cpus = [cpu_report(0, "cn0"), cpu_report(1, "cn1")]
    assert gpu.decide(cpus, "auto") == "cpu"
    with pytest.raises(
        ConfigError,
        match=r"^--device cuda, but no CUDA on cn0 \(rank 0\): no "
        r"NVIDIA GPU or driver",
    ):
        gpu.decide(cpus, "cuda")
    # A mix: the hosts on each side, the ranks, and why.
    mixed = [gpu_report(0, "cn0"), gpu_report(1, "cn1"), cpu_report(2, "cn2"), cpu_report(3, "cn2")]
    with pytest.raises(
        ConfigError,
        match=r"^CUDA on cn0, cn1 but not on cn2 \(ranks 2, 3\): no "
        r"NVIDIA GPU or "
        r"driver .*every rank must run on the same backend",
    ):
        gpu.decide(mixed, "auto")
    # GPUs that torch cannot use are never a silent fall back to the CPU, even on every host.
    with pytest.raises(
        ConfigError,
        match=r"^no usable CUDA on cn0 \(rank 0\): nvidia-smi sees 1 "
        r"GPU\(s\) \(NVIDIA "
        r"GeForce RTX 3070\) but this torch \(2.14.1\+cpu\) is a "
        r"CPU-only build",
    ):
        gpu.decide(
            [
                {**cpu_report(0, "cn0", OLD_DRIVER, None), "torch": "2.14.1+cpu"},
                cpu_report(1, "cn1"),
            ],
            "auto",
        )
    new_driver = {**OLD_DRIVER, "driver": "580.95.05", "cuda": "13.0"}
    with pytest.raises(
        ConfigError,
        match=r"torch.cuda.is_available\(\) is False \(torch cu130, "
        r"driver 580.95.05, "
        r"CUDA_VISIBLE_DEVICES=None\)",
    ):
        gpu.decide([cpu_report(0, "cn0", new_driver)], "auto")
    assert gpu.decide([cpu_report(0, "cn0", OLD_DRIVER)], "cpu") == "cpu"


def test_one_gpu_per_rank():
    ok = [gpu_report(0, "cn0", 0, gpus=2), gpu_report(1, "cn0", 1, gpus=2), gpu_report(2, "cn1", 0)]
    assert gpu.decide(ok, "cuda") == "cuda"
    three_on_two = [gpu_report(r, "cn1", r, gpus=2) for r in range(3)]
    with pytest.raises(
        ConfigError,
        match=r"^one GPU per rank: cn1 runs ranks 0, 1, 2 \(local "
        r"ranks 0, 1, 2\) but 2 "
        r"GPU\(s\) are visible \(CUDA_VISIBLE_DEVICES=unset\)",
    ):
        gpu.decide(three_on_two, "auto")
    # A launcher that shows each rank only its own GPU: local rank 1 has no GPU 1 (DeepSpeed would
    # pick it).
    per_rank = [{**gpu_report(r, "cn0", r, gpus=1), "visible": str(r)} for r in range(2)]
    with pytest.raises(
        ConfigError,
        match=r"cn0 runs ranks 0, 1 \(local ranks 0, 1\) but 1 "
        r"GPU\(s\) are visible "
        r"\(CUDA_VISIBLE_DEVICES=0\)",
    ):
        gpu.decide(per_rank, "auto")


def test_a_card_missing_from_the_arch_list_is_refused_naming_host_and_card():
    assert gpu.runs_on([8, 9], ARCH_CU130)  # sm_86 kernels run on 8.9 (RTX 40xx)
    assert not gpu.runs_on([8, 0], ["sm_86"])  # but not on 8.0
    assert gpu.runs_on([9, 0], ["sm_80", "compute_80"])  # PTX is compiled for newer cards
    assert gpu.runs_on([9, 0], ["sm_90a"]) and not gpu.runs_on([7, 0], ARCH_CU130)
    reports = [
        gpu_report(0, "cn0"),
        gpu_report(1, "cn4", capability=(6, 1), name="NVIDIA GeForce GTX 1080"),
    ]
    with pytest.raises(
        ConfigError,
        match=r"^this torch \(cu130\) has no kernels for cn4 \(rank "
        r"1\): NVIDIA GeForce "
        r"GTX 1080, compute capability 6.1 \(it has sm_75 .* "
        r"sm_120\)",
    ):
        gpu.decide(reports, "auto")


def fake_card(monkeypatch, name, major, minor):
    """torch.cuda as a host with this card would answer the census and DeepSpeed's accelerator (no
    GPU here)."""
    props = types.SimpleNamespace(name=name, major=major, minor=minor, total_memory=8 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ARCH_CU126)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (major, minor))
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (7 * 2**30, 8 * 2**30))
    # what it says on sm_75 too
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


CARDS = [("RTX 3070", 8, 6), ("RTX 2080 Ti", 7, 5), ("GTX 1080", 6, 1)]


def test_bf16_only_where_native_and_fp16_as_the_engine_runs_it(monkeypatch):
    """DeepSpeed's engines refuse fp16 below compute capability 7.0 unless
    DS_ALLOW_DEPRECATED_FP16=1 (its CUDA accelerator's is_fp16_supported, asked here with torch.cuda
    answering as the card would); DDP's autocast runs it on every card, with a warning before Volta.
    """
    monkeypatch.delenv("DS_ALLOW_DEPRECATED_FP16", raising=False)
    caps = {}
    for engine in ("zero", "ddp"):
        for name, major, minor in CARDS:
            fake_card(monkeypatch, name, major, minor)
            caps[engine, name] = census.capabilities(torch.device("cuda", 0), 1, spec(engine))
    assert [(c["fp16"], c["bf16"], c["capability"]) for c in caps.values()] == [
        (True, True, "8.6"),
        (True, False, "7.5"),
        (False, False, "6.1"),
        (True, True, "8.6"),
        (True, False, "7.5"),
        (True, False, "6.1"),
    ]
    assert (
        choose("auto", spec("zero"), [caps["zero", "RTX 3070"], caps["zero", "RTX 3070"]])[0]
        == "bf16"
    )
    precision, why = choose(
        "auto", spec("zero"), [caps["zero", "RTX 3070"], caps["zero", "RTX 2080 Ti"]]
    )
    assert precision == "fp16" and "no bf16 on rank 1" in why and "warning" not in why
    precision, why = choose(
        "auto", spec("zero"), [caps["zero", "RTX 3070"], caps["zero", "GTX 1080"]]
    )
    assert precision == "fp32" and "no fp16 on rank 1 (" in why
    precision, why = choose("auto", spec("ddp"), [caps["ddp", "RTX 3070"], caps["ddp", "GTX 1080"]])
    assert precision == "fp16" and "warning: rank 1 (" in why and "without tensor cores" in why
    # DeepSpeed's switch, read in the rank's own environment, and the device report made before the
    # process group.
    monkeypatch.setenv("DS_ALLOW_DEPRECATED_FP16", "1")
    assert census.capabilities(torch.device("cuda", 0), 1, spec("zero"))["fp16"] is True
    assert gpu.local_report("auto", 0, 0)["ds_fp16"] is True
    monkeypatch.setenv("DS_ALLOW_DEPRECATED_FP16", "0")
    assert gpu.local_report("auto", 0, 0)["ds_fp16"] is False
    # No precision given: auto on GPUs, fp32 on CPUs.
    precision, why = choose(
        None, spec("zero"), [caps["zero", "RTX 3070"], caps["zero", "RTX 2080 Ti"]]
    )
    assert precision == "fp16" and why.startswith("no precision given: auto on GPUs")
    cpu = {"host": "h", "device": "CPU", "capability": None, "fp16": False, "bf16": True}
    assert choose(None, spec("zero"), [cpu, cpu]) == ("fp32", "no precision given: fp32 on CPUs")


def test_the_async_pipeline_settles_on_bf16_else_fp32():
    """It has no fp16 loss scaler: auto (or none given) never picks fp16 for it, and fp16 asked for
    is refused before the process group (the JSON's too)."""

    def rep(capability, fp16, bf16):
        return {"host": "h", "device": "GPU", "capability": capability, "fp16": fp16, "bf16": bf16}

    turing, ampere = rep("7.5", True, False), rep("8.6", True, True)
    assert choose(None, spec("async-pipeline"), [ampere, ampere])[0] == "bf16"
    for requested in (None, "auto"):
        precision, why = choose(requested, spec("async-pipeline"), [ampere, turing])
        assert precision == "fp32" and why.endswith("no bf16 on rank 1 (h, GPU)"), why
    for engine in ("async-pipeline", "diloco"):
        with pytest.raises(ConfigError) as e:
            check_precision("fp16", engine)
        assert str(e.value) == (
            f"--engine {engine} trains in fp32 or bf16 (it has no fp16 loss scaler); pass "
            "--precision bf16 or fp32 (or a --ds-config without fp16); cards without bf16 (before "
            "Ampere: RTX 20, GTX 10) train it in fp32, or in fp16 under --engine ddp or zero"
        )
        precision, why = choose(None, spec(engine), [rep("7.5", True, False)])
        assert precision == "fp32", why
    with pytest.raises(ConfigError, match=r"^--engine async-pipeline trains in fp32 or bf16"):
        make_plan(
            parse(
                [
                    "--engine",
                    "async-pipeline",
                    "--pipeline-stages",
                    "2",
                    "--ds-config",
                    "deepspeed_configs/pipeline_fp16.json",
                ]
            ),
            Job(0, 2, 0, 2, "single"),
        )


def test_fp16_that_deepspeed_refuses_stops_before_the_process_group_naming_the_card_and_the_fix():
    reports = [gtx_1080(0, "cn3", ds_fp16=True), gtx_1080(1, "cn4")]
    with pytest.raises(ConfigError) as e:
        gpu.decide(reports, "auto", "fp16", spec("zero"))
    assert str(e.value) == (
        "precision fp16 is not supported by rank 1 (cn4, NVIDIA GeForce GTX 1080): DeepSpeed runs "
        "fp16 from compute "
        "capability 7.0 on (6.x with DS_ALLOW_DEPRECATED_FP16=1 set for every rank), --engine ddp "
        "on any GPU; every "
        "rank can run fp32: use --precision auto or one of those"
    )
    # torch autocast runs fp16 on Pascal
    assert gpu.decide(reports, "auto", "fp16", spec("ddp")) == "cuda"
    assert (
        gpu.decide(reports, "auto", None, spec("zero"))
        == gpu.decide(reports, "auto", "auto", spec("pipeline"))
        == "cuda"
    )
    assert gpu.decide([gtx_1080(0, "cn3", ds_fp16=True)], "auto", "fp16", spec("zero")) == "cuda"
    with pytest.raises(
        ConfigError,
        match=r"^precision bf16 is not supported by rank 0 \(cn3, "
        r"NVIDIA GeForce GTX "
        r"1080\), rank 1 .*; every rank can run fp16, fp32: use",
    ):
        gpu.decide(reports, "auto", "bf16", spec("ddp"))


def test_torch_builds_that_differ_between_hosts_stop_before_nccl_starts():
    """cu126 on the GTX 1080's host, cu130 on the others: NCCL would refuse the mix inside
    init_process_group."""
    reports = [gpu_report(0, "cn0"), gpu_report(1, "cn1"), gtx_1080(2, "cn4", ds_fp16=True)]
    with pytest.raises(ConfigError) as e:
        gpu.decide(reports, "auto")
    assert str(e.value) == (
        "torch differs between hosts: 2.14.1+cu130 on cn0, cn1; 2.14.1+cu126 on cn4; NCCL refuses "
        "ranks whose torch "
        "builds bring different NCCL versions: run TORCH_CUDA=cu126 scripts/bootstrap.sh on every "
        "host (it has "
        "kernels for every card here)"
    )
    blackwell = gpu_report(0, "cn0", capability=(12, 0), name="NVIDIA GeForce RTX 5090")
    with pytest.raises(
        ConfigError,
        match=r"; NCCL refuses .*: none of these builds has kernels "
        r"for every card",
    ):
        gpu.decide([blackwell, gtx_1080(1, "cn4", ds_fp16=True)], "auto")
    assert gpu.decide([gpu_report(0, "cn0", build="cu126"), gtx_1080(1, "cn4")], "auto")


def test_tf32_on_ampere_only(monkeypatch):
    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    try:
        assert gpu.set_tf32(torch.device("cpu"), True) is None
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (7, 5))
        assert gpu.set_tf32(torch.device("cuda", 0), True) is None
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 6))
        assert "tf32" in gpu.set_tf32(torch.device("cuda", 0), True)
        assert (
            torch.backends.cuda.matmul.fp32_precision
            == "tf32"
            == torch.backends.cudnn.conv.fp32_precision
        )
        assert "ieee" in gpu.set_tf32(torch.device("cuda", 0), False)
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


def test_rng_forks_restore_the_state_and_name_their_devices():
    before = torch.random.get_rng_state()
    with gpu.fork_rng(torch.device("cpu")):
        torch.rand(3)
    assert torch.equal(torch.random.get_rng_state(), before)
    # torch.random.fork_rng() without `devices` saves and restores every visible GPU: none in vit/
    # is left so.
    bare = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in (ROOT / "vit").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "fork_rng"
        and not any(k.arg == "devices" for k in node.keywords)
    ]
    assert bare == []


def test_the_process_group_binds_the_local_ranks_gpu(monkeypatch):
    """On CUDA: nccl, the GPU at LOCAL_RANK set and passed as device_id (torch.cuda and the process
    group start faked: there is no GPU here; the store exchange is real)."""
    props = types.SimpleNamespace(name="NVIDIA GeForce RTX 3070", major=8, minor=6)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    chosen, started = [], {}
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(
        torch.distributed, "init_process_group", lambda backend, **kw: started.update(kw, b=backend)
    )
    job = dist_env.Job(
        rank=0,
        world_size=1,
        local_rank=1,
        local_world_size=2,
        launcher="torchrun",
        master_addr="127.0.0.1",
        master_port=dist_env.free_port(),
    )
    assert dist_env.init_process_group(job, 30, "auto") == "nccl"
    assert chosen == [torch.device("cuda", 1)] and started["device_id"] == torch.device("cuda", 1)
    # NCCL's watchdog ends a rank whose collective timed out without naming anyone: it waits longer
    # than ours (vit.runtime.faults), which names the rank that stopped
    assert started["timeout"].total_seconds() == 30 + dist_env.NCCL_GRACE_S >= 30 + 10
    assert dist_env.device(job) == torch.device("cuda", 1) and job.device_type == "cuda"


def test_nccl_out_of_memory_as_the_process_group_starts_is_one_line(monkeypatch, tmp_path, capsys):
    """With device_id NCCL creates its communicators inside init_process_group: on a full GPU that
    is a DistBackendError (faked here, as torch 2.14 raises it; torch.cuda faked as in the test
    above)."""
    from vit import train

    props = types.SimpleNamespace(name="NVIDIA GeForce RTX 3070", major=8, minor=6)
    for name, value in [
        ("is_available", lambda: True),
        ("device_count", lambda: 1),
        ("set_device", lambda d: None),
        ("get_device_properties", lambda i: props),
        ("get_device_capability", lambda d=None: (8, 6)),
        ("device", lambda d: contextlib.nullcontext()),
    ]:
        monkeypatch.setattr(torch.cuda, name, value)

    def full(backend, **kw):
        raise torch.distributed.DistBackendError(
            "NCCL error in: ProcessGroupNCCL.cpp:2044, unhandled cuda error (run with "
            "NCCL_DEBUG=INFO for details), "
            "NCCL version 2.27.7\nncclUnhandledCudaError: Call to CUDA function failed.\nLast "
            "error:\nCuda failure "
            "'out of memory'"
        )

    monkeypatch.setattr(torch.distributed, "init_process_group", full)
    job = Job(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        launcher="torchrun",
        master_addr="127.0.0.1",
        master_port=dist_env.free_port(),
    )
    plan = make_plan(parse(["--log-dir", str(tmp_path / "run")]), job)
    assert train.run(plan, 0.0) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("rank 0 (")
        and ") failed at start: out of memory on cuda:0 as NCCL created its "
        "communicators: NCCL error in: ProcessGroupNCCL.cpp:2044, unhandled cuda error"
        in err
    ), err
    assert "nvidia-smi" in err and "Traceback" not in err and err.count("\n") == 1, err


COMMON = ["--steps", 1, "--no-save", "--monitor-interval", 0]


@pytest.mark.ranks
@pytest.mark.timeout(150)
def test_ranks_that_disagree_about_cuda_stop_before_the_process_group(tmp_path, smi_dir):
    """A real 2-rank run: rank 1's host has an NVIDIA driver too old for this torch (a fake
    nvidia-smi on its PATH); every rank stops with the same one-line error and exit 2, nothing
    written."""
    import os

    old = {
        "PATH": f"{smi_dir}:{os.environ['PATH']}",
        "FAKE_DRIVER": "550.54.15",
        "FAKE_DRIVER_CUDA": "12.4",
    }
    r = launch([*COMMON, "--log-dir", tmp_path / "run"], timeout=120, rank_env={1: old})
    assert r.returncodes == [2, 2], r
    for out in r.outputs:
        assert (
            "entry_cn.sh: error: no usable CUDA on " in out
            and "(rank 1): driver 550.54.15 supports CUDA 12.4; "
            "this torch (cu130) needs driver >= 580.65.06"
            in out
        ), r
    assert not (tmp_path / "run").exists()
    r = launch([*COMMON, "--device", "cuda", "--log-dir", tmp_path / "run"], timeout=120)
    assert r.returncodes == [2, 2] and "--device cuda, but no CUDA on " in r.outputs[1], r


def test_torch_threads_follow_the_cpu_affinity(monkeypatch):
    """Open MPI binds each rank to one core when np <= 2: the rank gets that core's one thread, not
    a share of the host. Unbound (every core allowed), the host's cores are split between its ranks.
    """
    monkeypatch.setattr(dist_env.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(dist_env.os, "sched_getaffinity", lambda pid: {3})
    assert dist_env.rank_cores(local_world_size=2) == 1
    # --map-by ...:pe=4
    monkeypatch.setattr(dist_env.os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    assert dist_env.rank_cores(local_world_size=4) == 4
    # --bind-to none
    monkeypatch.setattr(dist_env.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert (
        dist_env.rank_cores(local_world_size=4) == 4
        and dist_env.rank_cores(local_world_size=32) == 1
    )


def test_gpu_ranks_load_data_with_persistent_workers_and_cpu_ranks_stay_as_they_were():
    from vit.data.sampling import MAX_GPU_WORKERS, loader_workers, make_loader

    assert loader_workers(None, "cpu", cores=16) == 0  # the CPU default is unchanged
    assert loader_workers(None, "cuda", cores=16) == MAX_GPU_WORKERS == 4
    assert loader_workers(None, "cuda", cores=3) == 2 and loader_workers(None, "cuda", cores=1) == 1
    # --workers wins
    assert loader_workers(0, "cuda", cores=16) == 0 and loader_workers(2, "cpu", cores=16) == 2
    data = torch.utils.data.TensorDataset(torch.arange(8.0), torch.arange(8))
    assert make_loader(data, [[0, 1], [2, 3]], 2, False).persistent_workers
    assert not make_loader(data, [[0, 1], [2, 3]], 0, False).persistent_workers


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_the_loop_waits_for_the_device_only_where_it_evaluates_saves_or_freezes(tmp_path):
    """A wait for the device's queued work (an event synchronize on a GPU) in every step would take
    the host's run-ahead away: the loop waits only at the steps where an evaluation, a checkpoint or
    a freeze decision is due (here steps 3 and 4 of 6; the last step's are the finish's)."""
    count = tmp_path / "waits"
    args = ["--steps", 6, "--eval-interval", 3, "--save-interval", 4, "--log-interval", 6]
    r = launch(
        [*args, "--log-dir", tmp_path / "run"],
        timeout=240,
        env=plugin_env(count_waits=str(count)),
    )
    assert r.ok, r
    assert [int((tmp_path / f"waits.rank{rank}").read_text()) for rank in (0, 1)] == [2, 2]


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_bench_gpus_sync_check_counts_an_event_synchronize(tmp_path):
    """torch's sync debug mode does not warn on torch.cuda.Event.synchronize; the check's child
    makes it warn from its caller's file, which sync_sources counts. Here on a stand-in event class
    (no GPU), with the child's own code."""
    from bench.gpu import EVENT_SYNC_WARNS, sync_sources

    script = tmp_path / "child.py"
    script.write_text(
        "import types, sys\n"
        "torch = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=type('Event', (), "
        "{'synchronize': lambda self: None})))\n"
        + EVENT_SYNC_WARNS
        + "def wait():\n    torch.cuda.Event().synchronize()\n"
        + "for _ in range(3):\n    wait()\n"
    )
    r = run_cmd([sys.executable, "-W", "always", str(script)], timeout=60)
    assert r.returncode == 0, r.stderr
    assert sync_sources(r.stderr) == {"ours": 3}, r.stderr
