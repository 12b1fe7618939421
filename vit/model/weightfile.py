"""What a --pretrained-path file is when this run cannot load it: a damaged or foreign file, or the
weights of another kind of network, each said in a few words with the closest fix."""

import json
import re
import zipfile
from pathlib import Path

# A key that gives a file away: (its pattern, what the file is, the closest fix).
VIT_FIX = (
    "pass a ViT's weights under timm's names (cls_token, patch_embed.proj.weight, "
    "blocks.0.attn.qkv.weight, ...)"
)
FOLDER_FIX = "pass the checkpoint folder that holds it (.../stepN)"
FAMILIES = (
    (r"^layer\d\.\d+\.conv\d\.weight$", "a ResNet state dict: no ViT keys", VIT_FIX),
    (r"^stages\.\d+\.blocks\.\d+\.conv_dw\.", "a ConvNeXt state dict: no ViT keys", VIT_FIX),
    (r"^layers\.\d+\.blocks\.\d+\.", "a Swin Transformer state dict, not a plain ViT's", VIT_FIX),
    (
        r"^(vit\.)?(encoder\.layer\.\d+|embeddings)\.",
        "a Hugging Face transformers ViT (vit.encoder.layer.*), not timm's names",
        "use timm's copy of these weights (the hub's timm/*, --pretrained) or rename its keys",
    ),
    (
        r"^(norm1|attn|ls1|mlp|norm2|ls2)\.",
        "one transformer block (a pipeline checkpoint's layer file?)",
        FOLDER_FIX,
    ),
    (r"^optimizer_state_dict$", "a DeepSpeed optimizer state file", FOLDER_FIX),
    (
        r"^(torch|numpy|python|cuda)$",
        "a checkpoint's random-number state (rng_rank*.pt)",
        FOLDER_FIX,
    ),
)


def describe(keys) -> tuple[str, str]:
    """(what a state dict with these keys is, the closest fix)."""
    keys = list(keys)
    for pattern, what, fix in FAMILIES:
        if any(re.match(pattern, str(k)) for k in keys):
            return what, fix
    first = ", ".join(str(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")
    return f"not a ViT's weights under timm's names (its first keys: {first})", VIT_FIX


def _size(path: Path) -> str:
    return f"{path.stat().st_size:,} bytes"


def safetensors_problem(path: Path, error: Exception) -> str:
    """Why safetensors could not read `path`: truncated (the file is shorter than its header says),
    or not a safetensors file at all; else safetensors' own words."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
        start = f.read(1)
        if len(head) < 8 or start != b"{":  # an 8-byte header length, then the JSON header
            return f"not a safetensors file ({_size(path)}, without a safetensors header)"
        if 8 + header_len > size:
            return (
                f"truncated: {_size(path)}, shorter than its own header ({8 + header_len:,} bytes)"
            )
        try:
            header = json.loads(start + f.read(header_len - 1))
            end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        except (ValueError, KeyError, TypeError, AttributeError):
            first = str(error).splitlines()[0]
            return f"not a safetensors file (its header is not safetensors' JSON: {first})"
    if 8 + header_len + end > size:
        return f"truncated: {_size(path)} of the {8 + header_len + end:,} its header describes"
    return f"not a readable safetensors file ({str(error).splitlines()[0]})"


def torch_problem(path: Path, error: Exception) -> str:
    """Why torch.load could not read `path`: torch.save writes a zip archive (a legacy one, a
    pickle)."""
    with open(path, "rb") as f:
        head = f.read(4)
    reason = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
    if not head:
        return "an empty file"
    if head.startswith(b"PK") and not zipfile.is_zipfile(path):
        return (
            f"truncated or damaged: {_size(path)}, a zip archive "
            "(torch.save's format) without its end"
        )
    # a zip archive or a pickle, that torch cannot read
    if head.startswith(b"PK") or head.startswith(b"\x80"):
        return f"truncated or damaged ({_size(path)}: {reason[:160]})"
    return (
        f"not a weights file: neither torch.save's format nor safetensors (it starts with {head!r})"
    )
