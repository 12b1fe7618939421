"""Pretrained weights in (--pretrained-path, adapted), final weights out (--export), offline, with real ranks."""
import json
import os

import pytest
import timm
import torch
import torch.nn.functional as F
from helpers import base_env, launch, run_cmd
from safetensors.torch import save_file
from torch import nn

from vit.data import load_dataset
from vit.model import build_layers, timm_state_dict

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
    """Pretrained weights are fine-tuned on images normalised as in their pretraining: the config beside the file
    (an --export's PATH.json, a Hugging Face folder's config.json), else timm's config of the model's tag."""
    from vit.errors import ConfigError
    from vit.weights import pretrained_norm

    weights = tmp_path / "export.safetensors"
    weights.write_bytes(b"")
    (tmp_path / "export.safetensors.json").write_text(json.dumps({"pretrained_cfg": {"mean": [0.3], "std": [0.2]}}))
    assert pretrained_norm("vit_digits", False, str(weights)) == ((0.3,), (0.2,))
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "model.safetensors").write_bytes(b"")
    (hub / "config.json").write_text(json.dumps({"pretrained_cfg": {"mean": [0.5] * 3, "std": [0.5] * 3}}))
    assert pretrained_norm(NAME, False, str(hub / "model.safetensors")) == ((0.5,) * 3, (0.5,) * 3)
    bare = tmp_path / "bare.pth"
    bare.write_bytes(b"")
    augreg = "vit_small_patch16_224.augreg_in21k"
    assert pretrained_norm(augreg, False, str(bare)) == ((0.5,) * 3, (0.5,) * 3)  # timm's config for the tag
    assert pretrained_norm("deit_small_patch16_224", True, None) == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert pretrained_norm(augreg, False, None) is None  # from scratch: the data set's own
    assert pretrained_norm("vit_digits", False, str(bare)) is None  # a preset without a config beside it
    (hub / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not a JSON config"):
        pretrained_norm(NAME, False, str(hub / "model.safetensors"))


def test_pretrained_path_adapts_pos_embed_and_head_and_keeps_the_rest(timm_file):
    path, want = timm_file
    layers = build_layers(NAME, num_classes=10, in_chans=3, img_size=48, seed=0, pretrained_path=str(path))
    got = timm_state_dict(nn.Sequential(*layers).state_dict(), depth=12)
    fresh = timm_state_dict(nn.Sequential(*build_layers(NAME, 10, 3, 48, seed=0)).state_dict(), depth=12)
    assert got.keys() == want.keys()
    assert got["pos_embed"].shape == (1, 1 + 9, 192) and want["pos_embed"].shape == (1, 1 + 4, 192)
    # The class token's entry is kept, the 2x2 grid resampled to 3x3 (timm's resample_abs_pos_embed).
    assert torch.equal(got["pos_embed"][:, :1], want["pos_embed"][:, :1])
    assert not torch.allclose(got["pos_embed"][:, 1:].mean(), fresh["pos_embed"][:, 1:].mean())
    assert got["head.weight"].shape == (10, 192) and torch.equal(got["head.weight"], fresh["head.weight"])
    for k in want:
        if k not in ("pos_embed", "head.weight", "head.bias"):
            assert torch.equal(got[k], want[k]), k


def test_grey_weights_fine_tune_on_rgb_and_embed_a_grey_image_alike(tmp_path):
    # timm's adapt_input_conv leaves a 1-channel filter as it is; loading it into a 3-channel model failed in
    # load_state_dict (found by bench finetune: digits pretrained in grey, fine-tuned on RGB).
    torch.manual_seed(3)
    grey = timm.create_model(NAME, pretrained=False, img_size=32, num_classes=5, in_chans=1)
    path = tmp_path / "grey.safetensors"
    save_file({k: v.contiguous() for k, v in grey.state_dict().items()}, str(path))
    layers = build_layers(NAME, num_classes=5, in_chans=3, img_size=32, seed=0, pretrained_path=str(path))
    image = torch.rand(2, 1, 32, 32)
    rgb = timm_state_dict(nn.Sequential(*layers).state_dict(), depth=12)["patch_embed.proj.weight"]
    assert rgb.shape == (192, 3, 16, 16)
    assert torch.allclose(F.conv2d(image.expand(-1, 3, -1, -1), rgb, stride=16),
                          F.conv2d(image, grey.state_dict()["patch_embed.proj.weight"], stride=16), atol=1e-5)


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
@pytest.mark.parametrize("config,ema", [("zero2.json", False), ("zero3.json", False), ("zero3.json", True)])
def test_fine_tune_then_export_loads_into_timm(tmp_path, timm_file, config, ema):
    """The export of a run, and the same from its last checkpoint (--resume of the complete run with --export)."""
    path, _ = timm_file
    out = tmp_path / "export" / "tuned.safetensors"
    args = ["--model", NAME, "--dataset", "synthetic", "--img-size", 48, "--pretrained-path", path, "--steps", 3,
            "--ds-config", f"deepspeed_configs/{config}", "--log-dir", tmp_path / "run",
            *(["--model-ema", "--model-ema-decay", 0.5] if ema else [])]
    r = launch([*args, "--export", out], timeout=360)
    assert r.ok, r
    assert "pos_embed resampled (1, 5, 192) -> (1, 10, 192)" in r.outputs[0]
    assert "head.weight reset: (5, 192) in the file, (10, 192) for this run's classes" in r.outputs[0]
    cfg = json.loads((out.parent / "tuned.safetensors.json").read_text())
    assert cfg["architecture"] == NAME and cfg["num_classes"] == 10 and cfg["pretrained_cfg"]["input_size"] == [3, 48,
                                                                                                                48]
    model = timm.create_model(NAME, pretrained=True, num_classes=10, img_size=48,
                              pretrained_cfg_overlay=dict(cfg["pretrained_cfg"], file=str(out)))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # The exported weights give the run's own final held-out loss (the EMA's when EMA is on).
    assert eval_loss(model, 48) == pytest.approx(summary["ema_eval_loss" if ema else "eval_loss"], rel=1e-4)
    if ema:
        assert summary["ema_eval_loss"] != pytest.approx(summary["eval_loss"], rel=1e-4)
    again = tmp_path / "again.safetensors"
    r = launch([*args, "--resume", "--export", again], timeout=240)
    assert r.ok, r
    assert "the run is complete: checkpoint" in r.outputs[0] and "exported its weights" in r.outputs[0], r
    assert json.loads(again.with_name("again.safetensors.json").read_text()) == cfg
    reloaded = timm.create_model(NAME, pretrained=True, num_classes=10, img_size=48,
                                 pretrained_cfg_overlay=dict(cfg["pretrained_cfg"], file=str(again)))
    want = model.state_dict()
    assert reloaded.state_dict().keys() == want.keys()
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert [f.stat().st_mode & 0o777 for f in (out, again)] == [umask_mode()] * 2
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_misfit_and_offline_pretrained_are_one_line(tmp_path, timm_file):
    path, want = timm_file
    bad = tmp_path / "bad.pth"
    torch.save({"state_dict": {**want, "blocks.0.mlp.fc1.weight": torch.zeros(3, 3)}}, bad)
    cases = [(["--pretrained-path", str(bad)], "1 tensor(s) do not fit the model: blocks.0.mlp.fc1.weight (3, 3) "
                                              "(model (768, 192))"),
             (["--pretrained"], "--pretrained: cannot fetch timm/vit_tiny_patch16_224")]
    for args, message in cases:
        r = run_cmd([".venv/bin/python", "-m", "vit.train", "--model", NAME, "--dataset", "synthetic", "--img-size",
                     "32", *args, "--log-dir", str(tmp_path / "run")], env=base_env(HF_HUB_OFFLINE="1"), timeout=100)
        assert r.returncode == 2, r.stdout + r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("entry_cn.sh: error: ") and message in last and "--pretrained-path" in last, last
        assert not (tmp_path / "run").exists()
