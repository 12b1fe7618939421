"""Pretrained weights in (--pretrained-path, adapted), final weights out (--export), offline, with
real ranks."""

import json
import os

import pytest
import timm
import torch
import torch.nn.functional as F
from helpers import base_env, launch, plan_in_process, run_cmd
from safetensors.torch import save_file
from torch import nn

from vit.core.errors import ConfigError
from vit.data.datasets import load_dataset
from vit.model.layers import build_layers, timm_state_dict
from vit.model.weights import initial_layers

NAME = "vit_tiny_patch16_224"


@pytest.fixture(scope="module")
def timm_file(tmp_path_factory):
    """A timm model's weights as timm writes them: 32x32 images (2x2 patches), 5 classes."""
    torch.manual_seed(11)
    vit = timm.create_model(NAME, pretrained=False, img_size=32, num_classes=5)
    path = tmp_path_factory.mktemp("w") / "model.safetensors"
    save_file({k: v.contiguous() for k, v in vit.state_dict().items()}, str(path))
    return path, vit.state_dict()


def test_normalisation_comes_from_the_pretrained_config(tmp_path):
    """Pretrained weights are fine-tuned on images normalised as in their pretraining: the config
    beside the file (an --export's PATH.json, a Hugging Face folder's config.json), else timm's
    config of the model's tag."""
    from vit.core.errors import ConfigError
    from vit.model.weights import pretrained_norm

    weights = tmp_path / "export.safetensors"
    weights.write_bytes(b"")
    (tmp_path / "export.safetensors.json").write_text(
        json.dumps({"pretrained_cfg": {"mean": [0.3], "std": [0.2]}})
    )
    assert pretrained_norm("vit_digits", False, str(weights)) == ((0.3,), (0.2,))
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "model.safetensors").write_bytes(b"")
    (hub / "config.json").write_text(
        json.dumps({"pretrained_cfg": {"mean": [0.5] * 3, "std": [0.5] * 3}})
    )
    assert pretrained_norm(NAME, False, str(hub / "model.safetensors")) == ((0.5,) * 3, (0.5,) * 3)
    bare = tmp_path / "bare.pth"
    bare.write_bytes(b"")
    augreg = "vit_small_patch16_224.augreg_in21k"
    # timm's config for the tag
    assert pretrained_norm(augreg, False, str(bare)) == ((0.5,) * 3, (0.5,) * 3)
    assert pretrained_norm("deit_small_patch16_224", True, None) == (
        (0.485, 0.456, 0.406),
        (0.229, 0.224, 0.225),
    )
    assert pretrained_norm(augreg, False, None) is None  # from scratch: the data set's own
    # a preset without a config beside it
    assert pretrained_norm("vit_digits", False, str(bare)) is None
    (hub / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not a JSON config"):
        pretrained_norm(NAME, False, str(hub / "model.safetensors"))


def test_pretrained_path_adapts_pos_embed_and_head_and_keeps_the_rest(timm_file):
    path, want = timm_file
    layers = initial_layers(
        NAME, num_classes=10, in_chans=3, img_size=48, seed=0, drop_path=0.0, path=str(path)
    )
    got = timm_state_dict(nn.Sequential(*layers).state_dict(), depth=12)
    fresh = timm_state_dict(
        nn.Sequential(*build_layers(NAME, 10, 3, 48, seed=0)).state_dict(), depth=12
    )
    assert got.keys() == want.keys()
    assert got["pos_embed"].shape == (1, 1 + 9, 192) and want["pos_embed"].shape == (1, 1 + 4, 192)
    # The class token's entry is kept, the 2x2 grid resampled to 3x3 (timm's
    # resample_abs_pos_embed).
    assert torch.equal(got["pos_embed"][:, :1], want["pos_embed"][:, :1])
    assert not torch.allclose(got["pos_embed"][:, 1:].mean(), fresh["pos_embed"][:, 1:].mean())
    assert got["head.weight"].shape == (10, 192) and torch.equal(
        got["head.weight"], fresh["head.weight"]
    )
    for k in want:
        if k not in ("pos_embed", "head.weight", "head.bias"):
            assert torch.equal(got[k], want[k]), k


def test_grey_weights_fine_tune_on_rgb_and_embed_a_grey_image_alike(tmp_path):
    # timm's adapt_input_conv leaves a 1-channel filter as it is; loading it into a 3-channel model
    # failed in load_state_dict (found by bench finetune: digits pretrained in grey, fine-tuned on
    # RGB).
    torch.manual_seed(3)
    grey = timm.create_model(NAME, pretrained=False, img_size=32, num_classes=5, in_chans=1)
    path = tmp_path / "grey.safetensors"
    save_file({k: v.contiguous() for k, v in grey.state_dict().items()}, str(path))
    layers = initial_layers(
        NAME, num_classes=5, in_chans=3, img_size=32, seed=0, drop_path=0.0, path=str(path)
    )
    image = torch.rand(2, 1, 32, 32)
    rgb = timm_state_dict(nn.Sequential(*layers).state_dict(), depth=12)["patch_embed.proj.weight"]
    assert rgb.shape == (192, 3, 16, 16)
    assert torch.allclose(
        F.conv2d(image.expand(-1, 3, -1, -1), rgb, stride=16),
        F.conv2d(image, grey.state_dict()["patch_embed.proj.weight"], stride=16),
        atol=1e-5,
    )


def eval_loss(model: nn.Module, img_size: int) -> float:
    test = load_dataset("synthetic", None, img_size, seed=0).test
    x = torch.stack([test[i][0] for i in range(len(test))])
    y = torch.tensor([test[i][1] for i in range(len(test))])
    with torch.no_grad():
        return F.cross_entropy(model.eval()(x), y).item()


def umask_mode() -> int:
    """The mode a new file gets here: what an export must have (safetensors alone writes 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@pytest.mark.ranks
@pytest.mark.timeout(500)
@pytest.mark.parametrize(
    "engine,config,ema",
    [
        ("zero", "zero2.json", False),
        ("zero", "zero3.json", False),
        ("zero", "zero3.json", True),
        ("diloco", "zero0.json", False),
    ],
)
def test_fine_tune_then_export_loads_into_timm(tmp_path, timm_file, engine, config, ema):
    """The export of a run, and the same from its last checkpoint (--resume of the complete run with
    --export; DiLoCo's global weights: it said the folder had no ddp.pt)."""
    path, _ = timm_file
    out = tmp_path / "export" / "tuned.safetensors"
    args = [
        "--model",
        NAME,
        "--dataset",
        "synthetic",
        "--img-size",
        48,
        "--pretrained-path",
        path,
        "--steps",
        3,
        "--engine",
        engine,
        "--ds-config",
        f"deepspeed_configs/{config}",
        "--log-dir",
        tmp_path / "run",
        *(["--model-ema", "--model-ema-decay", 0.5] if ema else []),
    ]
    r = launch([*args, "--export", out], timeout=360)
    assert r.ok, r
    assert "pos_embed resampled (1, 5, 192) -> (1, 10, 192)" in r.outputs[0]
    assert (
        "head.weight reset: (5, 192) in the file, (10, 192) for this run's classes" in r.outputs[0]
    )
    cfg = json.loads((out.parent / "tuned.safetensors.json").read_text())
    assert (
        cfg["architecture"] == NAME
        and cfg["num_classes"] == 10
        and cfg["pretrained_cfg"]["input_size"] == [3, 48, 48]
    )
    model = timm.create_model(
        NAME,
        pretrained=True,
        num_classes=10,
        img_size=48,
        pretrained_cfg_overlay=dict(cfg["pretrained_cfg"], file=str(out)),
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # The exported weights give the run's own final held-out loss (the EMA's when EMA is on).
    assert eval_loss(model, 48) == pytest.approx(
        summary["ema_eval_loss" if ema else "eval_loss"], rel=1e-4
    )
    if ema:
        assert summary["ema_eval_loss"] != pytest.approx(summary["eval_loss"], rel=1e-4)
    again = tmp_path / "again.safetensors"
    r = launch([*args, "--resume", "--export", again], timeout=240)
    assert r.ok, r
    assert (
        "the run is complete: checkpoint" in r.outputs[0] and "exported its weights" in r.outputs[0]
    ), r
    assert json.loads(again.with_name("again.safetensors.json").read_text()) == cfg
    reloaded = timm.create_model(
        NAME,
        pretrained=True,
        num_classes=10,
        img_size=48,
        pretrained_cfg_overlay=dict(cfg["pretrained_cfg"], file=str(again)),
    )
    want = model.state_dict()
    assert reloaded.state_dict().keys() == want.keys()
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert [f.stat().st_mode & 0o777 for f in (out, again)] == [umask_mode()] * 2
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.ranks
@pytest.mark.timeout(240)
def test_misfit_foreign_damaged_and_offline_pretrained_are_one_line(
    tmp_path, timm_file, monkeypatch
):
    path, want = timm_file
    bad = tmp_path / "bad.pth"
    torch.save({"state_dict": {**want, "blocks.0.mlp.fc1.weight": torch.zeros(3, 3)}}, bad)
    # was accepted: a 4,466-character note, then trained from scratch
    resnet = tmp_path / "resnet18.safetensors"
    save_file(
        {k: v.contiguous() for k, v in timm.create_model("resnet18").state_dict().items()},
        str(resnet),
    )
    truncated = tmp_path / "truncated.safetensors"  # was SafetensorError's traceback
    truncated.write_bytes(path.read_bytes()[:3_000_000])
    cases = [
        (
            ["--pretrained-path", bad],
            "1 tensor(s) do not fit the model: blocks.0.mlp.fc1.weight (3, 3) (model (768, 192))",
        ),
        (
            ["--pretrained-path", resnet],
            f"--pretrained-path {resnet}: a ResNet state dict: no "
            f"ViT keys; it "
            "holds 0 of the model's 150 tensors (the head aside), "
            "under half",
        ),
        (
            ["--pretrained-path", truncated],
            f"--pretrained-path {truncated}: truncated: "
            f"3,000,000 bytes of the "
            f"{path.stat().st_size:,} its header describes",
        ),
    ]

    def check(last: str, message: str) -> None:
        assert message in last and "--pretrained-path" in last and "\n" not in last, last
        assert len(last) < 400, last
        assert not (tmp_path / "run").exists()

    common = ["--model", NAME, "--dataset", "synthetic", "--img-size", "32"]
    # The files: refused as rank 0 of two plans (in-process), before any process group (a check
    # made after it starts would hang there); test_train.py runs one refusal through the entry
    # point (exit 2, the line).
    for args, message in cases:
        with pytest.raises(ConfigError) as e:
            plan_in_process(
                monkeypatch, [*common, *args, "--log-dir", tmp_path / "run"], world_size=2
            )
        check(str(e.value), message)
    # Offline (Hugging Face's HF_HUB_OFFLINE, read when it is imported): through a process, one
    # rank of two that never meets the other.
    env = base_env(
        HF_HUB_OFFLINE="1", RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="9"
    )
    r = run_cmd(
        [
            ".venv/bin/python",
            "-m",
            "vit.train",
            *common,
            "--pretrained",
            "--log-dir",
            str(tmp_path / "run"),
        ],
        env=env,
        timeout=100,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("entry_cn.sh: error: ") and "Traceback" not in r.stderr, r.stderr
    check(last, "--pretrained: cannot fetch timm/vit_tiny_patch16_224")


def test_damaged_and_foreign_files_say_what_they_are(tmp_path, timm_file):
    """Each in one line naming the file: a damaged file, another network's keys, a file of a
    checkpoint folder."""
    from vit.core.errors import ConfigError
    from vit.model.weights import check

    path, want = timm_file
    data = path.read_bytes()
    zipped = tmp_path / "zipped.pth"
    torch.save(want, zipped)

    def keys_of(arch):  # another network's key names, as timm writes them
        with torch.device("meta"):
            keys = list(timm.create_model(arch).state_dict())
        return {k: torch.zeros(1) for k in keys}

    files = {
        "half.safetensors": (
            data[: len(data) // 2],
            f"truncated: {len(data) // 2:,} bytes of the {len(data):,} its header describes",
        ),
        "cut.safetensors": (data[:100], "truncated: 100 bytes, shorter than its own header"),
        "text.safetensors": (
            b"not weights at all",
            "not a safetensors file (18 bytes, without a safetensors header)",
        ),
        "text.pth": (b"garbage", "not a weights file: neither torch.save's format nor safetensors"),
        "half.pth": (
            zipped.read_bytes()[:100_000],
            "truncated or damaged: 100,000 bytes, a zip archive",
        ),
        "empty.bin": (b"", "an empty file"),
        "optim.pt": (
            {"optimizer_state_dict": {}, "ds_version": "0.18"},
            "holds no tensors: a DeepSpeed optimizer state file; pass the checkpoint folder",
        ),
        "convnext.safetensors": (keys_of("convnext_atto"), "a ConvNeXt state dict: no ViT keys"),
        "swin.safetensors": (
            keys_of("swin_tiny_patch4_window7_224"),
            "a Swin Transformer state dict",
        ),
        "hf.safetensors": (
            {
                "vit.embeddings.cls_token": torch.zeros(1),
                "vit.encoder.layer.0.attention.attention.query.weight": torch.zeros(1),
            },
            "a Hugging Face transformers ViT (vit.encoder.layer.*), not timm's names",
        ),
        "shallow.safetensors": (
            {
                k: v.contiguous()
                for k, v in want.items()
                if not k.startswith("blocks.") or int(k.split(".")[1]) < 4
            },
            "a ViT of 4 blocks; it holds 54 of the model's 150 tensors",
        ),
    }
    for name, (content, message) in files.items():
        f = tmp_path / name
        if isinstance(content, bytes):
            f.write_bytes(content)
        elif name.endswith(".pt"):
            torch.save(content, f)
        else:
            save_file(content, str(f))
        with pytest.raises(ConfigError) as e:
            check(str(f), NAME, 5, 3, 32)
        said = str(e.value).removeprefix(f"--pretrained-path {f}: ")
        assert message in said and said != str(e.value) and "\n" not in said and len(said) < 250, (
            e.value
        )
    # torch.save's format before torch 1.6: was refused (mmap reads zip archives)
    legacy = tmp_path / "legacy.pth"
    torch.save({"model": want}, legacy, _use_new_zipfile_serialization=False)
    assert check(str(legacy), NAME, 5, 3, 32) == [f"--pretrained-path {legacy}: every tensor fits"]


def test_a_partial_fit_is_one_short_line_with_counts(tmp_path, timm_file):
    from vit.model.weights import check

    path, want = timm_file
    partial = {
        k: v.contiguous()
        for k, v in want.items()
        if not k.startswith(("blocks.9.", "blocks.10.", "blocks.11."))
    }
    partial.update({"dist_token": torch.zeros(1, 1, 192), "fc_norm.weight": torch.ones(192)})
    save_file(partial, str(tmp_path / "partial.safetensors"))
    [line] = check(str(tmp_path / "partial.safetensors"), NAME, 5, 3, 32)
    note = line.split(": ", 1)[1]
    assert note == (
        "missing, left at initialisation: 36 (blocks.9.norm1.weight, "
        "blocks.9.norm1.bias, "
        "blocks.9.attn.qkv.weight, ...); unexpected, ignored: 2 (dist_token, "
        "fc_norm.weight)"
    ), line
    assert len(line) < 300
