"""The network as a flat list of layers, from any timm model of the VisionTransformer family or a
preset.

Every engine trains `nn.Sequential(*layers)`; the pipeline engine hands the same list to
deepspeed.pipe.PipelineModule. So pipeline and non-pipeline runs train one network, from the same
initial weights for a given seed. The layers keep timm's attribute names, so a layer list's state
dict maps onto timm's by its index alone (`timm_state_dict`, `layer_state_dict`).
"""

import difflib
import re
from dataclasses import dataclass

import timm
import torch
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy
from timm.models import split_model_name_tag
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from vit.core.errors import ConfigError


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
    # the glyphs task (vit.data.glyphs: 32x32, 36 classes), sized for minutes on 2 CPU cores
    "vit_glyphs": Preset(img_size=32, patch_size=8, embed_dim=96, depth=6, num_heads=3),
    # CIFAR-sized (32x32, patch 4).
    "vit_tiny_cifar": Preset(32, 4, 192, 12, 3),
    "vit_small_cifar": Preset(32, 4, 384, 12, 6),
    "vit_base_cifar": Preset(32, 4, 768, 12, 12),
}
# timm modules whose models are VisionTransformer (DeiT's distilled models, with a second head, are
# refused).
FAMILIES = ("vision_transformer", "deit", "vision_transformer_hybrid")


def check_model(name: str) -> str:
    """The timm architecture of --model NAME (a preset is its own), or one line saying what is
    wrong."""
    if name in PRESETS:
        return name
    arch, _tag = split_model_name_tag(name)
    if not timm.is_model(arch):
        near = difflib.get_close_matches(
            name,
            [*PRESETS, *timm.list_models(pretrained=True), *timm.list_models()],
            n=5,
            cutoff=0.6,
        )
        hint = f"; nearest: {', '.join(dict.fromkeys(near))}" if near else ""
        raise ConfigError(f"unknown model '{name}'{hint}")
    module = timm.models.model_entrypoint(arch).__module__.rsplit(".", 1)[-1]
    if "distilled" in arch:
        raise ConfigError(
            f"model '{name}' is a distilled DeiT (a second head for the teacher); "
            f"use its plain form, {arch.replace('_distilled', '')}"
        )
    if module not in FAMILIES:
        raise ConfigError(
            f"model '{name}' is a timm {module} model, not a VisionTransformer; supported: "
            f"the presets ({', '.join(PRESETS)}) and timm's vit_*, deit_*, deit3_* (not "
            "distilled), vit hybrids, with pretrained tags (vit_small_patch16_224.augreg_in21k)"
        )
    return arch


@dataclass(frozen=True)
class Shape:
    """What the plan needs to know of a model before building it."""

    img_size: int  # its default image side
    patch_size: int
    depth: int


def model_shape(name: str, in_chans: int = 3, img_size: int | None = None) -> Shape:
    if name in PRESETS:
        p = PRESETS[name]
        return Shape(img_size or p.img_size, p.patch_size, p.depth)
    kwargs = {"img_size": img_size} if img_size else {}
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        vit = timm.create_model(check_model(name), pretrained=False, in_chans=in_chans, **kwargs)
    if not isinstance(vit, VisionTransformer):
        raise ConfigError(f"model '{name}' is a {type(vit).__name__}, not a timm VisionTransformer")
    return Shape(vit.patch_embed.img_size[0], vit.patch_embed.patch_size[0], len(vit.blocks))


def check_img_size(model_name: str, img_size: int) -> None:
    patch = model_shape(model_name).patch_size
    if img_size <= 0 or img_size % patch:
        raise ConfigError(
            f"image size {img_size} is not divisible by the patch size "
            f"{patch} of model {model_name}"
        )


# timm.models.vision_transformer.VisionTransformer's own pieces, run on the layer that holds their
# attributes.
EMBED_ATTRS = (
    "patch_embed",
    "cls_token",
    "reg_token",
    "pos_embed",
    "pos_drop",
    "patch_drop",
    "norm_pre",
    "no_embed_class",
    "dynamic_img_size",
    "num_prefix_tokens",
)
HEAD_ATTRS = (
    "norm",
    "attn_pool",
    "fc_norm",
    "head_drop",
    "head",
    "global_pool",
    "num_prefix_tokens",
    "pool_include_prefix",
)


def _take(layer: nn.Module, vit: VisionTransformer, attrs) -> None:
    for a in attrs:
        setattr(layer, a, getattr(vit, a))


class Embed(nn.Module):
    """Patch embedding, class and register tokens, position embedding: timm's forward_features up to
    the blocks."""

    def __init__(self, vit: VisionTransformer):
        super().__init__()
        _take(self, vit, EMBED_ATTRS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Inputs arrive as fp32; a bf16 or fp16 engine holds its weights in half precision.
        x = self.patch_embed(x.to(self.patch_embed.proj.weight.dtype))
        return self.norm_pre(self.patch_drop(VisionTransformer._pos_embed(self, x)))


class Head(nn.Module):
    """Final norm, pooling (class token, average or attention), fc_norm, pre-logits dropout and the
    classifier: the end of timm's forward_features, and its forward_head."""

    def __init__(self, vit: VisionTransformer):
        super().__init__()
        _take(self, vit, HEAD_ATTRS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = VisionTransformer.pool(self, self.norm(x))
        return self.head(self.head_drop(self.fc_norm(x)))


def create_vit(
    model_name: str,
    num_classes: int,
    in_chans: int,
    img_size: int | None = None,
    seed: int = 0,
    drop_path: float = 0.0,
) -> VisionTransformer:
    """The timm model, initialised from `seed` (same weights on every rank)."""
    arch = check_model(model_name)
    torch.manual_seed(seed)
    if arch not in PRESETS:
        kwargs = {"img_size": img_size} if img_size else {}
        vit = timm.create_model(
            arch,
            pretrained=False,
            num_classes=num_classes,
            in_chans=in_chans,
            drop_path_rate=drop_path,
            **kwargs,
        )
        check_img_size(model_name, vit.patch_embed.img_size[0])
        return vit
    p = PRESETS[model_name]
    img_size = img_size or p.img_size
    check_img_size(model_name, img_size)
    return VisionTransformer(
        img_size=img_size,
        patch_size=p.patch_size,
        in_chans=in_chans,
        num_classes=num_classes,
        embed_dim=p.embed_dim,
        depth=p.depth,
        num_heads=p.num_heads,
        mlp_ratio=p.mlp_ratio,
        class_token=True,
        global_pool="token",
        drop_path_rate=drop_path,
    )


def to_layers(vit: VisionTransformer) -> list[nn.Module]:
    """[Embed, Block x depth, Head]: what PipelineModule partitions into stages."""
    return [Embed(vit), *vit.blocks, Head(vit)]


def build_layers(
    model_name: str,
    num_classes: int,
    in_chans: int,
    img_size: int | None = None,
    seed: int = 0,
    drop_path: float = 0.0,
    state: dict | None = None,
) -> list[nn.Module]:
    """The layer list, from `seed`, with `state` (timm's keys: vit.model.weights.pretrained_state)
    loaded over it."""
    vit = create_vit(model_name, num_classes, in_chans, img_size, seed, drop_path)
    if state is not None:
        vit.load_state_dict(state, strict=False)
    return to_layers(vit)


LAYER_KEY = re.compile(r"^(\d+)\.(.*)$")


def timm_key(key: str, depth: int) -> str:
    """'3.attn.qkv.weight' of the layer list (nn.Sequential or PipelineModule) -> timm's
    'blocks.2.attn.qkv.weight'."""
    i, rest = LAYER_KEY.match(key).groups()
    i = int(i)
    return rest if i in (0, depth + 1) else f"blocks.{i - 1}.{rest}"


def timm_state_dict(layer_state: dict, depth: int) -> dict:
    return {timm_key(k, depth): v for k, v in layer_state.items()}


def layer_state_dict(timm_state: dict, depth: int) -> dict:
    """timm's keys -> the layer list's (the inverse of timm_state_dict)."""
    out = {}
    for k, v in timm_state.items():
        m = re.match(r"^blocks\.(\d+)\.(.*)$", k)
        if m:
            out[f"{int(m.group(1)) + 1}.{m.group(2)}"] = v
        else:
            out[f"{0 if k.split('.')[0] in EMBED_ATTRS else depth + 1}.{k}"] = v
    return out


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    """The training loss in fp32: soft targets (mixup, cutmix) with timm's SoftTargetCrossEntropy,
    else cross-entropy with --smoothing. Label -100 marks evaluation padding (the pipeline's
    eval_batch computes a loss too) and counts nowhere: masked, not dropped by indexing, whose
    data-dependent shape would make the host wait for the GPU."""
    if labels.ndim == 2:
        return SoftTargetCrossEntropy()(logits.float(), labels)
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, label_smoothing=smoothing)


class Loss:
    """loss_fn with this run's --smoothing, as a picklable callable for the pipeline's last
    stage."""

    def __init__(self, smoothing: float = 0.0):
        self.smoothing = smoothing

    def __call__(self, logits, labels):
        return loss_fn(logits, labels, self.smoothing)
