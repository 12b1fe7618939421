"""The LR schedule."""

import pytest

from vit.training.optim import warmup_cosine


def test_warmup_then_cosine():
    lr = [warmup_cosine(s, total=100, warmup=10, min_ratio=0.01) for s in range(100)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lr[9:], lr[10:])) and lr[-1] == pytest.approx(0.01, abs=1e-3)


def test_layer_decay_scales_each_layer_of_the_list_as_timm_does():
    from timm.optim import param_groups_layer_decay
    from torch import nn

    from vit.model.layers import create_vit, to_layers
    from vit.training.optim import param_groups

    vit = create_vit("vit_digits", num_classes=10, in_chans=1)
    ours = param_groups(nn.Sequential(*to_layers(vit)), 0.05, lr=1.0, layer_decay=0.5, num_layers=6)
    scale = {id(p): g["lr"] for g in ours for p in g["params"]}
    # timm on the timm model: the same scale for every parameter (lr_scale), by its own layer ids.
    for g in param_groups_layer_decay(vit, weight_decay=0.05, layer_decay=0.5):
        for p in g["params"]:
            assert scale[id(p)] == pytest.approx(g["lr_scale"])
    # A pipeline stage holding layers 3..5 of the list scales them as the whole list does.
    stage = nn.Module()
    for i, layer in list(enumerate(to_layers(vit)))[3:]:
        stage.add_module(str(i), layer)
    for g in param_groups(stage, 0.05, lr=1.0, layer_decay=0.5, num_layers=6):
        assert all(scale[id(p)] == g["lr"] for p in g["params"])
    assert sorted({g["lr"] for g in ours}) == [0.5**k for k in range(5, -1, -1)]


def test_fused_adamw_is_the_default_on_cuda_only():
    import torch

    from vit.core.settings import OptimSettings
    from vit.training.optim import make_optimizer, use_fused

    assert use_fused(OptimSettings(), "cuda") and not use_fused(OptimSettings(), "cpu")
    assert use_fused(OptimSettings(fused_adam=True), "cpu")
    # CPU unchanged
    assert not make_optimizer(torch.nn.Linear(3, 3), OptimSettings()).defaults["fused"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fused", [False, True])
def test_ddp_fp16_skips_an_overflowed_step_without_advancing_the_lr(tmp_path, fused):
    """A real fp16 DDP engine on CPU (torch's "cpu" GradScaler): an inf batch overflows the
    gradients, the step is skipped, the LR holds still (as DeepSpeed's schedule does) and the count
    is read only when asked for."""
    import torch
    import torch.distributed as dist

    from vit.core.batch import Batch
    from vit.core.settings import OptimSettings
    from vit.engines.base import EngineContext, ScalerStats
    from vit.engines.ddp.engine import DDPEngine

    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)]
    optim = OptimSettings(lr=1e-2, warmup_steps=4, fused_adam=fused)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        engine = DDPEngine(
            EngineContext(
                layers=layers,
                ds_config={"fp16": {"initial_scale_power": 8}},
                batch=Batch(4, 1, 1),
                device=torch.device("cpu"),
                optim=optim,
                total_steps=20,
                precision="fp16",
            )
        )
        # the gradients are views of DDP's buckets: no second gradient-sized buffer, no copy a step
        assert engine.model.gradient_as_bucket_view
        good = (torch.randn(4, 6), torch.randint(0, 3, (4,)))
        bad = (torch.full((4, 6), float("inf")), good[1])
        lrs = [float(engine.lr)]
        for batch in (good, bad, bad, good):
            weights = engine.model.module[0].weight.detach().clone()
            engine.train_step(iter([batch]))
            changed = not torch.equal(weights, engine.model.module[0].weight)
            assert changed == (batch is good)
            lrs.append(float(engine.lr))
        # counted on the device: nothing to say but on logging steps (no host sync a step)
        assert engine.scaler(logging=False) is None
        # 2 skipped, none now, a run of 2 since the last statistic; the scale halved twice
        assert engine.scaler(logging=True) == ScalerStats(2, 0, 2, 2.0**6)
        assert engine.scaler(logging=True) == ScalerStats(2, 0, 0, 2.0**6)
    finally:
        dist.destroy_process_group()
    step = [1e-2 * (s + 1) / 4 for s in range(3)]  # warm-up LR after 0, 1 and 2 applied steps
    assert lrs == pytest.approx([step[0], step[1], step[1], step[1], step[2]])
