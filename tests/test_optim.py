"""The LR schedule."""

import pytest

from vit.optim import warmup_cosine


def test_warmup_then_cosine():
    lr = [warmup_cosine(s, total=100, warmup=10, min_ratio=0.01) for s in range(100)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lr[9:], lr[10:])) and lr[-1] == pytest.approx(0.01, abs=1e-3)


def test_layer_decay_scales_each_layer_of_the_list_as_timm_does():
    from timm.optim import param_groups_layer_decay
    from torch import nn

    from vit.model import create_vit, to_layers
    from vit.optim import param_groups

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
    assert sorted({g["lr"] for g in ours}) == [0.5 ** k for k in range(5, -1, -1)]
