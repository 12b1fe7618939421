"""The network as a flat list of layers: the timm model's own forward, fused attention."""

import pytest
import torch
from torch import nn

from vit.model import create_vit, to_layers


@pytest.mark.parametrize("name,in_chans,img", [("vit_digits", 1, 8), ("vit_tiny_cifar", 3, 32)])
def test_layer_list_is_the_timm_model(name, in_chans, img):
    vit = create_vit(name, num_classes=10, in_chans=in_chans, seed=3).eval()
    x = torch.randn(4, in_chans, img, img)
    assert torch.allclose(nn.Sequential(*to_layers(vit))(x), vit(x), atol=1e-6)
    a, b = create_vit(name, 10, in_chans, seed=3), create_vit(name, 10, in_chans, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # same seed, same weights


@pytest.mark.parametrize("name", ["vit_digits", "vit_base_patch16_224"])
def test_attention_runs_through_fused_scaled_dot_product_attention(name):
    from vit.model import create_vit

    vit = create_vit(name, num_classes=10, in_chans=3)
    assert all(block.attn.fused_attn for block in vit.blocks)  # F.scaled_dot_product_attention, not q @ k.T
