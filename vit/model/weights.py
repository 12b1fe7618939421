"""Pretrained weights in, final weights out.

In: --pretrained (timm's hub weights, fetched into the Hugging Face cache before any process group)
or --pretrained-path (a .safetensors, .pth or .bin from timm or Hugging Face, an --export of this
project, or one of its checkpoint folders), adapted the way timm adapts its own: the head is left at
its fresh initialisation when the class count differs, the position embedding is resampled (timm's
resample_abs_pos_embed) when the image size differs; any other tensor whose shape does not fit is an
error. A file that holds fewer than half of the model's tensors (another network's weights, or not
timm's names) and a damaged one are refused in one line saying what the file is
(vit.model.weightfile); missing and unexpected tensors are counted in a short note.

Out: --export writes timm-keyed weights as .safetensors and PATH.json, a timm / Hugging Face
config.json (architecture, num_classes, model_args, pretrained_cfg with input size, class count and
mean/std), so that timm.create_model(arch, pretrained=True, num_classes=N, img_size=S,
pretrained_cfg_overlay=dict(cfg["pretrained_cfg"], file=PATH)) loads it. The overlay must carry
num_classes: timm drops a file's head whose class count differs from its pretrained config's (1000
for ImageNet names).
"""

import json
import os
import pickle
import re
import zipfile
from pathlib import Path

import torch
from timm.layers import resample_abs_pos_embed
from timm.models import adapt_input_conv
from torch import nn

from vit.core.errors import ConfigError
from vit.model import weightfile
from vit.model.layers import (
    PRESETS,
    build_layers,
    check_model,
    create_vit,
    layer_state_dict,
    timm_state_dict,
)
from vit.runtime.console import library_prints

# a DeepSpeed pipeline checkpoint's per-layer files
LAYER_FILE = re.compile(r"^layer_(\d+)-model_states\.pt$")
# an async-pipeline checkpoint's stages (layer keys)
ASYNC_STAGE_FILE = re.compile(r"^async_stage\d+\.pt$")


def _torch_load(path: Path, wrapper: str | None = None) -> dict:
    """The state dict in a torch.save file: under `wrapper` if given, else under the usual
    wrappers of a training checkpoint."""
    try:  # mmap reads torch.save's zip archives only, not its legacy pickles
        state = torch.load(
            path, map_location="cpu", weights_only=False, mmap=zipfile.is_zipfile(path)
        )
    except (
        OSError,
        RuntimeError,
        ValueError,
        EOFError,
        pickle.UnpicklingError,
        ImportError,
        AttributeError,
    ) as e:
        raise ConfigError(f"--pretrained-path {path}: {weightfile.torch_problem(path, e)}")
    if isinstance(state, nn.Module):  # torch.save(model)
        state = state.state_dict()
    for key in [wrapper] if wrapper else ("state_dict", "model", "module", "model_state"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    return state


def _checkpoint_folder(d: Path, flag: str) -> dict:
    """This project's checkpoint: ddp.pt, ZeRO 0-2's mp_rank_00_model_states.pt, a pipeline's layer
    files, an async pipeline's stage files, or DiLoCo's global weights (every rank holds them)."""
    if (d / "ddp.pt").is_file():
        return _torch_load(d / "ddp.pt")
    if (d / "diloco_rank0.pt").is_file():
        return _torch_load(d / "diloco_rank0.pt", "global")
    layers = sorted(p for p in d.iterdir() if LAYER_FILE.match(p.name))
    if layers:
        return {
            f"{int(LAYER_FILE.match(p.name).group(1))}.{k}": v
            for p in layers
            for k, v in _torch_load(p).items()
        }
    stages = sorted(p for p in d.iterdir() if ASYNC_STAGE_FILE.match(p.name))
    if stages:
        return {k: v for p in stages for k, v in _torch_load(p).items()}
    states = d / "mp_rank_00_model_states.pt"
    if states.is_file():
        state = _torch_load(states)
        if any(v.numel() == 0 for v in state.values() if torch.is_tensor(v)):
            raise ConfigError(
                f"{flag} {d}: a ZeRO-3 checkpoint holds its weights partitioned; "
                "pass the run's --export file instead"
            )
        return state
    if (d / "latest").is_file():  # a --save-dir: its checkpoints are the folders inside
        raise ConfigError(
            f"{flag} {d}: a folder of checkpoints; pass one of them, such as its latest, "
            f"{d / (d / 'latest').read_text().strip()}"
        )
    raise ConfigError(
        f"{flag} {d}: a folder without ddp.pt, mp_rank_00_model_states.pt, "
        "layer files or async_stage files"
    )


def read_state(path: str, flag: str = "--pretrained-path") -> dict:
    """The tensors of a weights file or checkpoint folder, under timm's names; `flag`: the option
    that named it, for the errors."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{flag} {path}: no such file")
    if not os.access(p, os.R_OK):
        raise ConfigError(f"{flag} {path}: not readable (permission denied)")
    if p.is_dir():
        state = _checkpoint_folder(p, flag)
    elif p.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(str(p))
        except SafetensorError as e:
            raise ConfigError(f"{flag} {path}: {weightfile.safetensors_problem(p, e)}")
    else:
        state = _torch_load(p)
    if not isinstance(state, dict):
        raise ConfigError(f"{flag} {path}: holds a {type(state).__name__}, not a state dict")
    tensors = {k.removeprefix("module."): v for k, v in state.items() if torch.is_tensor(v)}
    if not tensors:
        what, fix = weightfile.describe(state)
        raise ConfigError(f"{flag} {path}: holds no tensors: {what}; {fix}")
    state = tensors
    if all(re.match(r"^\d+\.", k) for k in state):  # a layer list's keys: this project's checkpoint
        depth = max(int(k.split(".")[0]) for k in state) - 1
        state = timm_state_dict(state, depth)
    return state


def fits_input_conv(weight: torch.Tensor, want: torch.Tensor) -> bool:
    """Can input_conv turn weight into want's shape (same filters and kernel; channels 1 -> C, or 3
    -> C)?"""
    same_filters = weight.shape[:1] + weight.shape[2:] == want.shape[:1] + want.shape[2:]
    return same_filters and (weight.shape[1] in (1, 3) or want.shape[1] == 1)


def input_conv(weight: torch.Tensor, in_chans: int) -> torch.Tensor:
    """The patch embedding for in_chans input channels. From RGB, timm's adapt_input_conv; from grey
    (which that leaves as it is), the filter repeated over the channels and divided by their number,
    so that a grey image given as C equal channels gives the same embedding."""
    if weight.shape[1] == 1:
        return weight.repeat(1, in_chans, 1, 1) / in_chans
    return adapt_input_conv(in_chans, weight)


def _some(names: list[str], n: int = 3) -> str:
    """A count and the first few names: a misfit stays one short line, whatever the file."""
    return f"{len(names)} ({', '.join(names[:n])}{', ...' if len(names) > n else ''})"


def check_overlap(state: dict, model: nn.Module, path: str) -> None:
    """Refuse a file that holds fewer than half of the model's tensors (the head aside, which a new
    class count resets anyway): fine-tuning from it would mostly train from scratch, and it is most
    likely another network's weights or not timm's names."""
    body = [k for k in model.state_dict() if not k.startswith("head.")]
    shared = sum(k in state for k in body)
    if 2 * shared < len(body):
        what, fix = weightfile.describe(state)
        depth = 1 + max(
            (int(k.split(".")[1]) for k in state if re.match(r"^blocks\.\d+\.", k)), default=-1
        )
        if depth > 0:  # timm's names: a shallower ViT
            what = f"a ViT of {depth} blocks"
            fix = (
                f"the model has {len(model.blocks)}: pass the weights of as deep "
                "a ViT, or a --model that deep"
            )
        raise ConfigError(
            f"--pretrained-path {path}: {what}; it holds {shared} of the model's {len(body)} "
            f"tensors (the head aside), under half; {fix}"
        )


def adapt(state: dict, model: nn.Module, path: str) -> tuple[dict, list[str]]:
    """`state` made to fit `model` (a timm VisionTransformer): (the tensors to load, notes on what
    changed)."""
    check_overlap(state, model, path)
    want = model.state_dict()
    out, notes, misfit = {}, [], []
    for k, v in state.items():
        if k not in want or v.shape == want[k].shape:
            out[k] = v
        elif k == "pos_embed":
            prefix = 0 if model.no_embed_class else model.num_prefix_tokens
            out[k] = resample_abs_pos_embed(
                v, new_size=list(model.patch_embed.grid_size), num_prefix_tokens=prefix
            )
            notes.append(f"pos_embed resampled {tuple(v.shape)} -> {tuple(out[k].shape)}")
        elif k == "patch_embed.proj.weight" and fits_input_conv(v, want[k]):
            out[k] = input_conv(v, want[k].shape[1])
            notes.append(f"{k} adapted from {v.shape[1]} to {want[k].shape[1]} input channels")
        elif k.startswith("head."):
            notes.append(
                f"{k} reset: {tuple(v.shape)} in the file, {tuple(want[k].shape)} "
                "for this run's classes"
            )
        else:
            misfit.append(f"{k} {tuple(v.shape)} (model {tuple(want[k].shape)})")
    if misfit:
        raise ConfigError(
            f"--pretrained-path {path}: {len(misfit)} tensor(s) do not fit the model: "
            f"{', '.join(misfit[:3])}{f' and {len(misfit) - 3} more' if len(misfit) > 3 else ''}"
        )
    # in the model's order
    missing = [k for k in want if k not in out and not k.startswith("head.")]
    unexpected = [k for k in out if k not in want]
    if missing:
        notes.append(f"missing, left at initialisation: {_some(missing)}")
    if unexpected:
        notes.append(f"unexpected, ignored: {_some(unexpected)}")
    return {k: v for k, v in out.items() if k in want}, notes


def pretrained_state(
    path: str, model_name: str, num_classes: int, in_chans: int, img_size: int | None
) -> tuple:
    """(the tensors of `path` adapted to the model, notes on what was adapted): shapes only, on the
    meta device."""
    with torch.device("meta"):
        vit = create_vit(model_name, num_classes, in_chans, img_size)
    return adapt(read_state(path), vit, path)


def initial_layers(
    model_name: str,
    num_classes: int,
    in_chans: int,
    img_size: int | None,
    seed: int,
    drop_path: float,
    path: str | None,
) -> list[nn.Module]:
    """vit.model.layers.build_layers, with the tensors of `path` (when given) adapted and loaded
    over the seed's."""
    state = pretrained_state(path, model_name, num_classes, in_chans, img_size)[0] if path else None
    return build_layers(model_name, num_classes, in_chans, img_size, seed, drop_path, state)


def check(path: str, model_name: str, num_classes: int, in_chans: int, img_size: int) -> list[str]:
    """Before any process group: does `path` fit the model? Its notes."""
    notes = pretrained_state(path, model_name, num_classes, in_chans, img_size)[1]
    return [f"--pretrained-path {path}: " + "; ".join(notes or ["every tensor fits"])]


def pretrained_norm(model: str, pretrained: bool, path: str | None) -> tuple[tuple, tuple] | None:
    """The (mean, std) that the pretrained weights were trained on, or None (from scratch, or not
    known): the pretrained config beside --pretrained-path (an --export's PATH.json, or a Hugging
    Face folder's config.json), else timm's pretrained config of --model's tag
    (vit_small_patch16_224.augreg_in21k: 0.5, 0.5)."""
    import timm

    if path:
        p = Path(path)
        for cfg_file in (Path(f"{p}.json"), (p if p.is_dir() else p.parent) / "config.json"):
            if cfg_file.is_file():
                try:
                    cfg = json.loads(cfg_file.read_text()).get("pretrained_cfg") or {}
                except (ValueError, AttributeError) as e:
                    raise ConfigError(
                        f"--pretrained-path {path}: {cfg_file} is not a JSON config ({e})"
                    )
                if "mean" in cfg and "std" in cfg:
                    return tuple(cfg["mean"]), tuple(cfg["std"])
    if (pretrained or path) and check_model(model) not in PRESETS:
        cfg = timm.models.get_pretrained_cfg(model)
        if cfg is not None:
            return tuple(cfg.mean), tuple(cfg.std)
    return None


def hub_weights(name: str) -> str:
    """--pretrained: the hub file of timm's pretrained config for `name`, fetched into the local
    cache."""
    import timm
    from huggingface_hub import hf_hub_download

    if check_model(name) in PRESETS:
        raise ConfigError(
            f"--pretrained: {name} is this project's preset, with no hub weights; "
            f"use --pretrained-path"
        )
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None or not cfg.hf_hub_id:
        raise ConfigError(
            f"--pretrained: timm has no hub weights for {name}; use --pretrained-path"
        )
    try:
        return hf_hub_download(cfg.hf_hub_id, cfg.hf_hub_filename or "model.safetensors")
    except Exception as e:  # no network, no such repo, ...: the user's way out is a local file
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"--pretrained: cannot fetch {cfg.hf_hub_id} from the Hugging Face hub ({reason}); "
            "fetch it where there is network and pass --pretrained-path FILE"
        )


def export(path: str, layer_state: dict, model_name: str, data) -> None:
    """Rank 0: the layer list's final weights as timm's, and the config timm and Hugging Face read
    (data: the run's vit.data.datasets.DataSplit, for the classes, channels, image size and
    normalisation)."""
    depth = max(int(k.split(".")[0]) for k in layer_state) - 1
    write_export(path, timm_state_dict(layer_state, depth), model_name, data)


def export_checkpoint(folder: str, path: str, model_name: str, data, ema: bool) -> None:
    """--resume of a complete run with --export: the weights of its last checkpoint (the EMA's with
    --model-ema), as the run's own --export would have written them (under ZeRO-3, partitioned,
    DeepSpeed's zero_to_fp32 joins the fp32 weights: the same with fp32 training, unrounded with
    fp16 or bf16)."""
    d = Path(folder)
    if not ema and (d / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with library_prints():
            state = get_fp32_state_dict_from_zero_checkpoint(str(d.parent), tag=d.name)
        return export(path, state, model_name, data)
    if not ema:
        return write_export(path, read_state(folder, "--export: checkpoint"), model_name, data)
    files = sorted(d.glob("ema_rank*.pt"))
    if not files:
        raise ConfigError(
            f"--export: checkpoint {folder} holds no EMA weights (written without --model-ema)"
        )
    layer_state = {
        k: v for f in files for k, v in torch.load(f, map_location="cpu", weights_only=True).items()
    }
    export(path, layer_state, model_name, data)


def write_export(path: str, timm_state: dict, model_name: str, data) -> None:
    """PATH (.safetensors) and PATH.json from timm-keyed weights, each put in place whole."""
    from safetensors.torch import save_file

    num_classes, in_chans, img_size, mean, std = (
        data.num_classes,
        data.in_chans,
        data.img_size,
        data.mean,
        data.std,
    )
    state = {k: v.detach().float().cpu().contiguous() for k, v in timm_state.items()}
    arch = check_model(model_name)
    args = {"img_size": img_size, "in_chans": in_chans}
    # not a timm name: timm builds it as vit_base_patch16_224 with these arguments
    if arch in PRESETS:
        p = PRESETS[arch]
        args.update(
            patch_size=p.patch_size,
            embed_dim=p.embed_dim,
            depth=p.depth,
            num_heads=p.num_heads,
            mlp_ratio=p.mlp_ratio,
        )
        arch = "vit_base_patch16_224"
    cfg = {
        "architecture": arch,
        "num_classes": num_classes,
        "model_args": args,
        "trained_as": model_name,
        "pretrained_cfg": {
            "input_size": [in_chans, img_size, img_size],
            "num_classes": num_classes,
            "mean": list(mean),
            "std": list(std),
            "interpolation": "bicubic",
            "crop_pct": 1.0,
            "classifier": "head",
            "first_conv": "patch_embed.proj",
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    Path(tmp).unlink(missing_ok=True)  # a killed export's, with safetensors' mode
    try:
        # created here, so with the umask's mode: safetensors' own file is 0600
        with open(tmp, "wb") as f:
            mode = os.fstat(f.fileno()).st_mode & 0o777
        save_file(state, tmp, metadata={"format": "pt"})
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        Path(tmp).write_text(json.dumps(cfg, indent=2) + "\n")
        os.replace(tmp, f"{path}.json")
    finally:
        Path(tmp).unlink(missing_ok=True)  # left only by a failure
    print(f"exported {path} and {path}.json", flush=True)


def layer_state(model: nn.Module) -> dict:
    """The layer list's state (keys '<layer index>.<timm name>') of a timm model: what read_state
    gives back."""
    return layer_state_dict(model.state_dict(), len(model.blocks))
