"""What fits in memory: the out-of-memory message (device memory faked where a GPU would answer;
there is none here) and a real 2-rank run in which rank 1 runs out of memory."""

import contextlib
import types

import pytest
import torch
from helpers import launch, plugin_env

from vit.planner import fit, oom
from vit.planner import memory as footprint
from vit.run.cli import parse
from vit.run.plan import make_plan
from vit.runtime.dist_env import Job
from vit.train import out_of_memory


def test_the_estimate_leaves_headroom_for_the_model_and_its_state():
    # 8 GiB: 90% of it, less a GPU's reserved headroom and the engine's bytes per parameter, over
    # the activations of one sample (profiled in the run's precision).
    assert footprint.estimate_fit(8 * 2**30, 10**8, 2**20, 0, 16) == int(
        (0.9 * 8 * 2**30 - 16e8) // 2**20
    )
    reserved = 2**30
    assert footprint.estimate_fit(8 * 2**30, 10**8, 2**20, reserved, 22) == int(
        (0.9 * 8 * 2**30 - reserved - 22e8) // 2**20
    )
    assert footprint.estimate_fit(2**30, 10**8, 2**20, 0, 16) < 0  # the model alone does not fit


def test_out_of_memory_message_names_the_card_and_what_fits(monkeypatch, tmp_path):
    """An RTX 3070 (8 GiB) that ran out at micro-batch 256 of ViT-Small/224."""
    props = types.SimpleNamespace(name="NVIDIA GeForce RTX 3070", major=8, minor=6)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (2**28, 8 * 2**30))
    # DeepSpeed's fp16 question
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    plan = make_plan(
        parse(
            [
                "--model",
                "vit_small_patch16_224",
                "--dataset",
                "synthetic",
                "--synthetic-size",
                "1024",
                "--micro-batch-size",
                "256",
                "--grad-accum",
                "2",
                "--log-dir",
                str(tmp_path),
            ]
        ),
        Job(0, 1, 0, 1, "single"),
    )
    e = out_of_memory(
        plan,
        torch.device("cuda", 0),
        4,
        torch.cuda.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 8.00 "
            "GiB\nmore"
        ),
    )
    text = str(e)
    assert text.startswith(
        "out of memory during step 5 on cuda:0 (NVIDIA GeForce RTX 3070, 8.0 "
        "GiB) at "
        "micro-batch 256 (bf16): CUDA out of memory. Tried to allocate 1.50 "
        "GiB. GPU 0 has a total "
        "capacity of 8.00 GiB. Estimated to fit: "
    ), text
    fit = int(text.split("Estimated to fit: ")[1].split()[0])
    assert 1 <= fit < 256 and f"Try --micro-batch-size {fit}" in text
    assert "zero2_offload.json" in text and "more --pipeline-stages" in text and "\n" not in text


CUBLAS_OOM = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


def test_every_form_of_a_gpu_out_of_memory_is_one():
    """The errors torch 2.14 raises when a GPU's memory runs out: the caching allocator's, cuBLAS's
    and cuDNN's failed allocations (RuntimeError), a CUDA call's (torch.AcceleratorError), NCCL's at
    communicator creation."""
    import torch.distributed as dist

    from vit.core.errors import OutOfMemory

    ooms = [
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError(CUBLAS_OOM),
        RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
        torch.AcceleratorError("CUDA error: out of memory"),
        dist.DistBackendError(
            "NCCL error in: ProcessGroupNCCL.cpp:2044, unhandled cuda error "
            "(run with "
            "NCCL_DEBUG=INFO for details), NCCL version "
            "2.27.7\nncclUnhandledCudaError: Call to "
            "CUDA function failed.\nLast error:\nCuda failure 'out of "
            "memory'"
        ),
    ]
    assert [oom.is_oom(e) for e in ooms] == [True] * 5
    others = [
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        ValueError("out of memory"),
        dist.DistBackendError("NCCL error: remote process exited or there was a network error"),
        OutOfMemory("out of memory during step 3 on cuda:0 ..."),
    ]
    assert [oom.is_oom(e) for e in others] == [False] * 4


def test_the_micro_batch_search_counts_a_cublas_allocation_failure_as_too_big():
    from vit.model.layers import build_layers

    model = torch.nn.Sequential(*build_layers("vit_digits", 10, 1, 8, 0))

    def cublas(module, args):
        if args[0].shape[0] >= 4:
            raise RuntimeError(CUBLAS_OOM)

    model[0].register_forward_pre_hook(cublas)
    sample = torch.randn(1, 8, 8)
    assert fit.forward_backward_bytes(model, sample, 4) is None
    assert (
        fit.largest_fitting(lambda n: fit.forward_backward_bytes(model, sample, n), 1e12, 100) == 3
    )


def test_the_message_keeps_its_hints_when_its_estimate_fails(monkeypatch, tmp_path):
    """After a CUDA error the device may not even say how much memory it has: the message still says
    what to try."""

    def broken(dev=None):
        raise torch.AcceleratorError("CUDA error: out of memory")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    plan = make_plan(
        parse(
            [
                "--dataset",
                "synthetic",
                "--synthetic-size",
                "256",
                "--micro-batch-size",
                "64",
                "--log-dir",
                str(tmp_path),
            ]
        ),
        Job(0, 1, 0, 1, "single"),
    )
    text = str(out_of_memory(plan, torch.device("cuda", 0), 2, RuntimeError(CUBLAS_OOM)))
    assert text == (
        f"out of memory during step 3 on cuda:0 at micro-batch 64: {CUBLAS_OOM}. No "
        f"estimate "
        "(AcceleratorError: CUDA error: out of memory). Try --micro-batch-size 32, or "
        "--micro-batch-size "
        "auto, or deepspeed_configs/zero2_offload.json (optimizer state in CPU "
        "memory), or --engine "
        "pipeline with more --pipeline-stages (each rank holds fewer layers)"
    )


@pytest.mark.ranks
@pytest.mark.timeout(360)
def test_out_of_memory_on_rank_1_ends_every_rank_with_one_message(tmp_path):
    # 35 s alone; it failed twice in whole-file runs at load 15 on 2 cores, probably at the former
    # 200 s limit
    r = launch(
        [
            "--steps",
            6,
            "--no-save",
            "--monitor-interval",
            0,
            "--log-interval",
            1,
            "--log-dir",
            tmp_path,
        ],
        timeout=300,
        rank_env={1: plugin_env(oom_at="1:3")},
    )
    assert all(rc != 0 for rc in r.returncodes), r
    said = "out of memory during step 3 on cpu ("
    mine = [line for line in r.outputs[1].splitlines() if said in line]
    # cuBLAS's failed allocation, a RuntimeError as torch raises it (tests/plugins/oom_at.py), is
    # out of memory too
    assert (
        len(mine) == 1
        and mine[0].startswith("rank 1 (")
        and f"at micro-batch 32 (fp32): {CUBLAS_OOM} (" in mine[0]
        and "Estimated to fit: " in mine[0]
    ), r
    assert (
        "--micro-batch-size" in mine[0]
        and "zero2_offload" in mine[0]
        and "Traceback" not in r.outputs[1]
    ), r
    assert "stops" in r.outputs[0] and said in r.outputs[0], r


@pytest.mark.parametrize("seed", range(30))
def test_the_micro_batch_search_finds_the_largest_that_fits_a_fake_memory_limit(seed):
    """need(n) = static + per-sample x n (as a forward and backward's peak is), a budget, and
    sometimes an allocator that fails earlier (out of memory above `oom_from`): against every size
    tried in turn."""
    import random

    rng = random.Random(seed)
    static, per, upper = rng.uniform(0, 5e9), rng.uniform(1e5, 5e8), rng.randint(1, 3000)
    budget = rng.uniform(0.5, 2) * (static + per * rng.randint(1, 4000))
    oom_from = rng.choice([None, rng.randint(1, 4000)])
    tried = []

    def need(n):
        tried.append(n)
        return None if oom_from is not None and n >= oom_from else static + per * n

    fitting = [
        n
        for n in range(1, upper + 1)
        if (oom_from is None or n < oom_from) and static + per * n <= budget
    ]
    expected = max(fitting, default=0)
    assert fit.largest_fitting(need, budget, upper) == expected
    assert len(tried) <= 2 * upper.bit_length() + 1 and len(set(tried)) == len(tried)
    over = [n for n in tried if static + per * n > budget]
    assert len(over) <= 1  # once two sizes are measured, sizes that would not fit are never tried


def test_the_search_measures_a_real_forward_and_backward_on_the_cpu():
    from vit.model.layers import build_layers

    model = torch.nn.Sequential(*build_layers("vit_digits", 10, 1, 8, 0))
    sample = torch.randn(1, 8, 8)
    one, two, four = (fit.forward_backward_bytes(model, sample, n) for n in (1, 2, 4))
    # affine in n
    assert one < two < four and four - two == pytest.approx(2 * (two - one), rel=0.05)
    assert all(p.grad is None for p in model.parameters())
    budget = two + (four - two) / 2  # room for 3 samples
    assert (
        fit.largest_fitting(lambda n: fit.forward_backward_bytes(model, sample, n), budget, 100)
        == 3
    )


@pytest.mark.ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("split", ["equal", "proportional"])
def test_micro_batch_auto_trains_and_reports_its_choice(tmp_path, split):
    import json

    r = launch(
        [
            "--micro-batch-size",
            "auto",
            "--batch-split",
            split,
            "--steps",
            2,
            "--no-save",
            "--monitor-interval",
            0,
            "--log-dir",
            tmp_path,
        ],
        timeout=280,
    )
    assert r.ok, r
    config = json.loads((tmp_path / "config.json").read_text())
    chosen = config["micro_batch_auto"]
    # digits has 1437 training samples: on this machine's RAM the cap is one step per epoch over 2
    # ranks.
    assert chosen["per_rank"] == [718, 718] and chosen["micro_batch"] == 718, chosen
    assert (
        config["deepspeed"]["train_micro_batch_size_per_gpu"] == 718
        and config["global_batch"] == 1436
    )
    assert config["args"]["micro_batch_size"] == "auto"
    assert (
        "--micro-batch-size auto: the largest forward and backward (fp32) that fit each rank with "
        "headroom: "
        "[718, 718]" in r.outputs[0]
    )
    if split == "proportional":
        assert chosen["split"] == [718, 718]
        assert json.loads((tmp_path / "cluster.json").read_text())["batch_split"] == [718, 718]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2


def test_the_search_measures_autocast_engines_as_they_train():
    """DDP and the async pipeline keep fp32 weights and autocast: a sample's activations are not
    those of the model cast to bf16 (on an H100, ViT-B/16's auto size from the bf16 model ran out of
    memory under DDP)."""
    import copy

    from vit.model.layers import build_layers

    model = torch.nn.Sequential(*build_layers("vit_digits", 10, 1, 8, 0))
    sample = torch.randn(1, 8, 8)

    def per_sample(m, autocast=None):
        two, four = (fit.forward_backward_bytes(m, sample, n, autocast) for n in (2, 4))
        return (four - two) / 2

    fp32, autocast = per_sample(model), per_sample(model, torch.bfloat16)
    bf16 = per_sample(copy.deepcopy(model).to(torch.bfloat16))
    assert bf16 < autocast < fp32, (bf16, autocast, fp32)
