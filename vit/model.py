"""timm VisionTransformer presets, and the same network as a flat list of layers.

Every engine trains `nn.Sequential(*layers)`; the pipeline engine hands the same list to
deepspeed.pipe.PipelineModule. So pipeline and non-pipeline runs train one network, from the
same initial weights for a given seed.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from vit.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    img_size: int
    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    mlp_ratio: float = 4.0


PRESETS = {
    # 8x8 handwritten digits, the embedded default.
    "vit_digits": Preset(img_size=8, patch_size=2, embed_dim=64, depth=4, num_heads=4),
    # CIFAR-sized (32x32, patch 4).
    "vit_tiny_cifar": Preset(32, 4, 192, 12, 3),
    "vit_small_cifar": Preset(32, 4, 384, 12, 6),
    "vit_base_cifar": Preset(32, 4, 768, 12, 12),
    # The standard ImageNet shapes.
    "vit_tiny_patch16_224": Preset(224, 16, 192, 12, 3),
    "vit_small_patch16_224": Preset(224, 16, 384, 12, 6),
    "vit_base_patch16_224": Preset(224, 16, 768, 12, 12),
    "vit_large_patch16_224": Preset(224, 16, 1024, 24, 16),
}


def check_img_size(model_name: str, img_size: int) -> None:
    patch = PRESETS[model_name].patch_size
    if img_size <= 0 or img_size % patch:
        raise ConfigError(f"image size {img_size} is not divisible by the patch size {patch} of model {model_name}")


class Embed(nn.Module):
    """Patch embedding, class token and position embedding: timm's forward_features up to the blocks."""

    def __init__(self, vit: VisionTransformer):
        super().__init__()
        self.patch_embed = vit.patch_embed
        self.cls_token = vit.cls_token
        self.pos_embed = vit.pos_embed
        self.pos_drop = vit.pos_drop
        self.patch_drop = vit.patch_drop
        self.norm_pre = vit.norm_pre

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Inputs arrive as fp32; a bf16 or fp16 engine holds its weights in half precision.
        x = self.patch_embed(x.to(self.pos_embed.dtype))
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed)
        return self.norm_pre(self.patch_drop(x))


class Head(nn.Module):
    """Final norm, class-token pooling and the classifier: timm's forward_head."""

    def __init__(self, vit: VisionTransformer):
        super().__init__()
        self.norm = vit.norm
        self.fc_norm = vit.fc_norm
        self.head_drop = vit.head_drop
        self.head = vit.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)[:, 0]
        return self.head(self.head_drop(self.fc_norm(x)))


def create_vit(model_name: str, num_classes: int, in_chans: int, img_size: int | None = None,
               seed: int = 0) -> VisionTransformer:
    """The timm model for a preset, initialised from `seed` (same weights on every rank)."""
    if model_name not in PRESETS:
        raise ConfigError(f"unknown model '{model_name}'; choose one of: {', '.join(PRESETS)}")
    p = PRESETS[model_name]
    img_size = img_size or p.img_size
    check_img_size(model_name, img_size)
    torch.manual_seed(seed)
    return VisionTransformer(
        img_size=img_size, patch_size=p.patch_size, in_chans=in_chans, num_classes=num_classes,
        embed_dim=p.embed_dim, depth=p.depth, num_heads=p.num_heads, mlp_ratio=p.mlp_ratio,
        class_token=True, global_pool="token",
    )


def to_layers(vit: VisionTransformer) -> list[nn.Module]:
    """[Embed, Block x depth, Head]: what PipelineModule partitions into stages."""
    return [Embed(vit), *vit.blocks, Head(vit)]


def build_layers(model_name: str, num_classes: int, in_chans: int, img_size: int | None = None,
                 seed: int = 0) -> list[nn.Module]:
    return to_layers(create_vit(model_name, num_classes, in_chans, img_size, seed))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32; label -100 marks evaluation padding and is ignored."""
    return F.cross_entropy(logits.float(), labels, ignore_index=-100)
