"""The memory model (vit.planner.memory): the bytes per parameter each engine holds, term by term as
DeepSpeed's and torch's sources allocate them, and one measurement of the real thing (a DDP model
after one step)."""

import gc
import json
from pathlib import Path

import pytest
import torch

from vit.engines.registry import spec
from vit.planner import memory as footprint

CONFIGS = Path(__file__).parent.parent / "deepspeed_configs"


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def test_ddp_holds_autocasts_weight_cache_beyond_the_plain_state():
    # AdamW alone: weights, gradients, moments
    plain = footprint.bytes_per_param(spec("zero"), "fp32", config("zero0"))
    assert plain == 4 + 4 + 8
    # the gradients are DDP's buckets (gradient_as_bucket_view): nothing more
    assert footprint.bytes_per_param(spec("ddp"), "fp32", {}) == plain
    # + autocast's bf16 weight cache
    assert footprint.bytes_per_param(spec("ddp"), "bf16", {}) == plain + 2 == 18
    # + PowerSGD's error feedback
    assert footprint.bytes_per_param(spec("ddp"), "fp32", {}, compression="powersgd") == plain + 4
    # ZeRO is what DDP is not: at dp=2, zero2 holds half the gradients and half the fp32 optimizer
    # state per rank.
    zero2 = footprint.state_bytes(spec("zero"), "bf16", config("zero2"), dp_size=2)
    assert zero2 == {
        "bf16 weights": 2,
        "bf16 gradients": 1,
        "fp32 master weights": 2,
        "fp32 master gradients": 2,
        "AdamW moments": 4,
    }
    assert footprint.bytes_per_param(spec("ddp"), "bf16", {}, dp_size=2) > sum(zero2.values())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_divide_what_they_partition_by_the_data_parallel_size(stage):
    cfg = {"zero_optimization": {"stage": stage}}
    one, four = (footprint.state_bytes(spec("zero"), "fp16", cfg, dp_size=dp) for dp in (1, 4))
    partitioned = {"fp32 master weights", "fp32 master gradients", "AdamW moments"}
    partitioned |= {"fp16 gradients"} if stage >= 2 else set()
    partitioned |= {"fp16 weights"} if stage == 3 else set()
    assert {k for k in one if four[k] == one[k] / 4} == partitioned
    assert all(four[k] == one[k] for k in one.keys() - partitioned)
    # stage3.py: the fp32 partition is the master
    fp32 = footprint.state_bytes(spec("zero"), "fp32", cfg, dp_size=4)
    assert fp32["fp32 master weights"] == (0 if stage == 3 else 1)
    offload = {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    # optimizer state in CPU memory
    on_cpu = footprint.state_bytes(spec("zero"), "fp16", offload, dp_size=4)
    assert on_cpu["fp32 master weights"] == on_cpu["AdamW moments"] == 0


def test_deepspeed_optimizers_as_the_engine_picks_them():
    # zero0.json in half precision: FP16_UnfusedOptimizer (torch's AdamW is not DeepSpeed's
    # FusedAdam), fp32 masters and, at the step, fp32 copies of the gradients.
    assert footprint.state_bytes(spec("zero"), "bf16", config("zero0"), dp_size=2) == {
        "bf16 weights": 2,
        "bf16 gradients": 2,
        "fp32 master weights": 4,
        "fp32 master gradients": 4,
        "AdamW moments": 8,
    }
    # pipeline.json in bf16 (ZeRO-1, fp32 gradient accumulation): BF16_Optimizer, whose fp32
    # accumulation buffer is the whole model's, while its masters and moments are partitioned.
    bf16 = footprint.state_bytes(spec("pipeline"), "bf16", config("pipeline"), dp_size=2)
    assert bf16 == {
        "bf16 weights": 2,
        "bf16 gradients": 2,
        "gradient accumulation": 4,
        "fp32 master weights": 2,
        "AdamW moments": 4,
    }
    # A bf16 pipeline without ZeRO is BF16_Optimizer too; zero0.json in bf16 outside a pipeline is
    # not.
    assert "gradient accumulation" in footprint.state_bytes(
        spec("pipeline"), "bf16", config("zero0")
    )
    assert "gradient accumulation" not in footprint.state_bytes(
        spec("zero"), "bf16", config("zero0")
    )
    # pipeline_fp16.json: fp16 with ZeRO-1 is DeepSpeed's ZeRO optimizer, not BF16_Optimizer.
    assert "gradient accumulation" not in footprint.state_bytes(
        spec("pipeline"), "fp16", config("pipeline_fp16")
    )


def test_the_async_pipelines_stash_and_a_gpu_ema_each_add_a_copy_of_the_weights():
    bare = footprint.bytes_per_param(spec("async-pipeline"), "bf16", {})
    assert bare == 4 + 4 + 8 + 2  # fp32 weights, gradients, moments, autocast's cache
    assert (
        footprint.bytes_per_param(spec("async-pipeline"), "bf16", {}, stashed_copies=1) == bare + 4
    )
    # the gradients are views of the buffer the all-reduce sums in place (was a cat of them, + 4)
    assert footprint.bytes_per_param(spec("async-pipeline"), "bf16", {}, dp_size=2) == bare
    for engine, cfg in [
        ("ddp", {}),
        ("zero", config("zero2")),
        ("zero", config("zero3")),
        ("pipeline", {}),
    ]:
        without = footprint.bytes_per_param(spec(engine), "bf16", cfg, dp_size=4)
        assert (
            footprint.bytes_per_param(spec(engine), "bf16", cfg, dp_size=4, ema_on_gpu=True)
            == without + 4
        )


def ddp_held_bytes(precision: str) -> tuple[int, int]:
    """(bytes torch's profiler saw allocated and not freed while a DDP model was built and trained
    one step, its parameters). Without init_sync: the start-up broadcast of the weights (nothing to
    send at world size 1) flattens them into a copy that gloo's work thread frees when it likes,
    once after the profiler stopped (CI)."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    x, y = torch.randn(8, 256), torch.randint(0, 10, (8,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)
        )
        # as engines/ddp/engine.py builds it
        ddp = DistributedDataParallel(model, init_sync=False, gradient_as_bucket_view=True)
        optimizer = torch.optim.AdamW(model.parameters())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = torch.nn.functional.cross_entropy(ddp(x).float(), y)
        loss.backward()
        optimizer.step()
        del loss
    return sum(e.self_cpu_memory_usage for e in prof.key_averages()), sum(
        p.numel() for p in model.parameters()
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_estimate_covers_what_a_real_ddp_model_holds_after_one_step(tmp_path, precision):
    """torch's own accounting (the profiler's record of every CPU allocation and free) of a DDP
    model built, trained one step under autocast and its loss dropped: what stays is its weights,
    gradients (DDP's buckets) and AdamW's moments. The estimate is at least that, and not far above
    (autocast's cache is freed by then)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        held, params = ddp_held_bytes(precision)
    finally:
        dist.destroy_process_group()
    estimate = footprint.bytes_per_param(spec("ddp"), precision, {}) * params
    assert held / params < 16 + 3  # no second, bucketed copy of the gradients
    # per tensor or per model, not per parameter: AdamW's step counts, DDP's bookkeeping
    scalars = 1024
    # above it by autocast's cache alone (live during the step, freed after it)
    cache = 2 * params if precision == "bf16" else 0
    assert held - scalars <= estimate <= 1.02 * held + cache, (held / params, estimate / params)


@pytest.mark.timeout(120)
def test_powersgds_error_feedback_is_the_copy_of_the_gradients_the_estimate_counts(tmp_path):
    """The state torch's PowerSGD hook keeps once it compresses (from its third step here): the
    error feedback, a tensor per bucket as long as the bucket, is the estimate's term; P and Q,
    which it leaves out, are small."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)
        )
        ddp = DistributedDataParallel(model, init_sync=False)  # see below
        state = powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        x, y = torch.randn(8, 256), torch.randint(0, 10, (8,))
        for _ in range(3):
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        feedback = nbytes(state.error_dict.values())
        p_and_q = nbytes(state.p_memory_dict.values()) + nbytes(state.q_memory_dict.values())
        del ddp, state  # DDP's reducer and the hook's state go before their process group does
        gc.collect()
    finally:
        dist.destroy_process_group()
    params = sum(p.numel() for p in model.parameters())
    assert (
        feedback
        == footprint.state_bytes(spec("ddp"), "fp32", {}, compression="powersgd")[
            "PowerSGD error feedback"
        ]
        * params
    )
    # (n + m) x rank fp32 numbers per n x m matrix
    assert 0 < p_and_q == 4 * 4 * ((256 + 1024) + (1024 + 10))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_every_shipped_json_sizes_zeros_buckets_and_they_are_counted_by_stage():
    """DeepSpeed's default reduce_bucket_size is 5e8 elements: 1 GB a rank in bf16 on any model.
    Every shipped JSON with ZeRO sizes its buckets; ZeRO-1/2 hold reduce buckets only (two with
    overlap_comm), in the gradient accumulation dtype; ZeRO-3 its reduce buckets and prefetch."""
    for path in sorted(CONFIGS.glob("*.json")):
        zero = json.loads(path.read_text()).get("zero_optimization", {})
        if zero.get("stage", 0) >= 1:
            assert zero.get("reduce_bucket_size", 5e8) <= 5e7, path.name
    deepspeed = spec("zero")
    assert deepspeed.bucket_bytes(config("zero0"), "bf16") == 0
    assert deepspeed.bucket_bytes(config("zero1"), "bf16") == 2e7 * 2  # one bucket, no all-gather's
    assert deepspeed.bucket_bytes(config("zero2"), "bf16") == 2 * 2e7 * 2  # overlap_comm: two
    assert deepspeed.bucket_bytes(config("pipeline"), "bf16") == 2e7 * 4  # grad_accum_dtype fp32
    zero3 = config("zero3")["zero_optimization"]
    prefetch = zero3.get("stage3_prefetch_bucket_size", 5e7)
    assert deepspeed.bucket_bytes(config("zero3"), "fp32") == (2 * 2e7 + prefetch) * 4
    no_sizes = {"zero_optimization": {"stage": 1}}
    assert deepspeed.bucket_bytes(no_sizes, "fp32") == 5e8 * 4  # DeepSpeed's default: 2 GB
