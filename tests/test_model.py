"""The network as a flat list of layers: the timm model's own forward, fused attention; --model
names."""

import pytest
import timm
import torch
from torch import nn

from vit.core.errors import ConfigError
from vit.model.layers import (
    check_model,
    create_vit,
    layer_state_dict,
    model_shape,
    timm_state_dict,
    to_layers,
)


@pytest.mark.parametrize(
    "name,in_chans,img",
    [("vit_digits", 1, 8), ("vit_tiny_cifar", 3, 32), ("vit_tiny_patch16_224", 3, 32)],
)
def test_layer_list_is_the_timm_model(name, in_chans, img):
    vit = create_vit(name, num_classes=10, in_chans=in_chans, img_size=img, seed=3).eval()
    x = torch.randn(4, in_chans, img, img)
    assert torch.allclose(nn.Sequential(*to_layers(vit))(x), vit(x), atol=1e-6)
    a, b = create_vit(name, 10, in_chans, img, seed=3), create_vit(name, 10, in_chans, img, seed=3)
    # same seed, same weights
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# Each a different way of building the token sequence or the head: class token (vit, deit), no class
# pos-embed with layer scale (deit3), register tokens with average pooling and fc_norm (reg4_gap),
# attention pooling (map), a ResNet stem (hybrid).
TIMM_NAMES = [
    "vit_small_patch16_224",
    "deit_tiny_patch16_224",
    "deit3_small_patch16_224",
    "vit_little_patch16_reg4_gap_256",
    "vit_so150m_patch16_reg4_map_256",
    "vit_tiny_r_s16_p8_224",
]


@pytest.mark.parametrize("name", TIMM_NAMES)
def test_layer_list_equals_timm_forward_for_timm_names(name):
    torch.manual_seed(0)
    vit = timm.create_model(name, pretrained=False, img_size=32, num_classes=7, depth=2).eval()
    x = torch.randn(3, 3, 32, 32)
    layers = to_layers(vit)
    assert len(layers) == 4
    assert torch.allclose(nn.Sequential(*layers)(x), vit(x), atol=1e-5)
    # Every parameter and buffer belongs to exactly one layer, under timm's own name.
    ours = timm_state_dict(nn.Sequential(*layers).state_dict(), depth=2)
    assert ours.keys() == vit.state_dict().keys()
    assert layer_state_dict(ours, 2).keys() == nn.Sequential(*layers).state_dict().keys()


def test_timm_name_with_tag_and_drop_path():
    vit = create_vit(
        "vit_small_patch16_224.augreg_in21k", num_classes=3, in_chans=3, img_size=32, drop_path=0.1
    )
    assert vit.patch_embed.img_size == (32, 32) and vit.head.out_features == 3
    assert vit.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)
    assert model_shape("deit3_small_patch16_224", img_size=48).img_size == 48


@pytest.mark.parametrize(
    "name,message",
    [
        (
            "vit_smal_patch16_224",
            "unknown model 'vit_smal_patch16_224'; nearest: vit_small_patch16_224",
        ),
        (
            "resnet50",
            "model 'resnet50' is a timm resnet model, not a VisionTransformer; supported: the "
            "presets",
        ),
        ("deit_tiny_distilled_patch16_224", "use its plain form, deit_tiny_patch16_224"),
    ],
)
def test_bad_model_names(name, message):
    with pytest.raises(ConfigError) as e:
        check_model(name)
    assert message in str(e.value)


@pytest.mark.parametrize("name", ["vit_digits", "vit_base_patch16_224"])
def test_attention_runs_through_fused_scaled_dot_product_attention(name):
    vit = create_vit(name, num_classes=10, in_chans=3)
    # F.scaled_dot_product_attention, not q @ k.T
    assert all(block.attn.fused_attn for block in vit.blocks)
