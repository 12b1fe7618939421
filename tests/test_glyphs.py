"""The glyphs task (vit.data.glyphs) at its small size, drawn from the fonts matplotlib ships
(DejaVu, STIX, Computer Modern: VIT_GLYPH_FONTS), so that the generator cannot break unseen:
deterministic, held-out families never in training, one line for each bad input and never a
half-written cache."""

import os
import shutil
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from helpers import launch, read_jsonl

from vit.core.errors import ConfigError
from vit.data import glyphs
from vit.data.datasets import load_dataset

MPL_FONTS = Path(matplotlib.get_data_path()) / "fonts" / "ttf"


@pytest.fixture
def mpl_fonts(monkeypatch):
    monkeypatch.setenv("VIT_GLYPH_FONTS", str(MPL_FONTS))


def cache_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".glyphs.lock"))


def test_small_task_is_deterministic_balanced_and_holds_out_families(mpl_fonts, tmp_path):
    said = []
    first = glyphs.load(str(tmp_path / "a"), "small", say=said.append)
    assert len(said) == 1 and said[0].startswith("glyphs: generating 720 training images from ")
    again = glyphs.load(str(tmp_path / "a"), "small", say=said.append)  # read, not generated
    other = glyphs.load(str(tmp_path / "b"), "small", say=lambda _: None)
    assert len(said) == 1
    for k in ("x_train", "y_train", "x_test", "y_test"):
        assert np.array_equal(first[k], again[k]) and np.array_equal(first[k], other[k]), k
    assert first["x_train"].shape == (720, 3, 32, 32) and first["x_test"].shape == (360, 3, 32, 32)
    assert np.bincount(first["y_train"]).tolist() == [20] * 36
    assert np.bincount(first["y_test"]).tolist() == [10] * 36
    meta = first["meta"]
    train_families = {family for _, family in meta["train_fonts"]}
    test_families = {family for _, family in meta["test_fonts"]}
    assert train_families and test_families and not train_families & test_families
    # every image has ink and paper: no blank draws
    spread = first["x_train"].reshape(720, -1).astype(int)
    assert (spread.max(1) - spread.min(1)).min() > 60
    assert cache_files(tmp_path / "a") == [glyphs.cache_name(glyphs.font_files(), "small")]


def test_dataset_split_normalises_with_training_statistics(mpl_fonts, tmp_path):
    d = load_dataset("glyphs-small", str(tmp_path), 32)
    assert (d.num_classes, d.in_chans, d.img_size, len(d.train), len(d.test)) == (
        36,
        3,
        32,
        720,
        360,
    )
    x = np.stack([d.train[i][0].numpy() for i in range(len(d.train))])
    assert (
        np.abs(x.mean(axis=(0, 2, 3))).max() < 1e-3
        and np.abs(x.std(axis=(0, 2, 3)) - 1).max() < 1e-3
    )
    image, label = d.raw_train[37]
    assert image.size == (32, 32) and image.mode == "RGB" and label == 1


def test_no_fonts_one_line_and_nothing_written(monkeypatch, tmp_path):
    (tmp_path / "fonts").mkdir()
    monkeypatch.setenv("VIT_GLYPH_FONTS", str(tmp_path / "fonts"))
    with pytest.raises(
        ConfigError, match=r"^glyphs: no \.ttf or \.otf files under VIT_GLYPH_FONTS="
    ) as e:
        glyphs.load(str(tmp_path / "data"))
    assert "\n" not in str(e.value) and not (tmp_path / "data").exists()


def test_a_file_as_the_data_folder_is_one_line(mpl_fonts, tmp_path):
    taken = tmp_path / "notes.txt"
    taken.write_text("kept")
    with pytest.raises(ConfigError) as e:
        glyphs.load(str(taken), "small")
    assert str(e.value) == (
        f"glyphs: --data-path {taken} is a file; give the folder to cache the task in"
    )
    assert taken.read_text() == "kept"


def test_one_family_is_not_a_task(monkeypatch, tmp_path):
    fonts = tmp_path / "fonts"
    fonts.mkdir()
    for f in MPL_FONTS.glob("DejaVuSans-*.ttf"):
        shutil.copy(f, fonts)
    monkeypatch.setenv("VIT_GLYPH_FONTS", str(fonts))
    with pytest.raises(
        ConfigError,
        match="^glyphs: 1 usable font family .* need at least 2; install the fonts with "
        "scripts/bootstrap.sh --fonts$",
    ):
        glyphs.load(str(tmp_path / "data"), "small")
    assert cache_files(tmp_path / "data") == []


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="no dpkg here")
def test_missing_font_package_is_named_with_the_install_command(monkeypatch, tmp_path):
    monkeypatch.delenv("VIT_GLYPH_FONTS", raising=False)
    monkeypatch.setattr(glyphs, "packages", lambda: ["fonts-vit-test-not-a-package"])
    with pytest.raises(ConfigError) as e:
        glyphs.load(str(tmp_path))
    assert str(e.value) == (
        "glyphs: 1 of its 1 font packages are not installed (fonts-vit-test-not-a-package); "
        "install them with scripts/bootstrap.sh --fonts"
    )


def test_corrupt_cache_is_named_and_left_alone(mpl_fonts, tmp_path):
    glyphs.load(str(tmp_path), "small", say=lambda _: None)
    (path,) = tmp_path.glob("glyphs-*.npz")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte inside the images
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as e:
        glyphs.load(str(tmp_path), "small")
    message = str(e.value)
    assert (
        message.startswith(f"glyphs: {path} is corrupt (")
        and message.endswith("); delete it to generate the data set again")
        and "\n" not in message
    )
    assert path.read_bytes() == bytes(data)
    path.write_bytes(b"not a zip file")
    with pytest.raises(ConfigError, match="is corrupt"):
        glyphs.load(str(tmp_path), "small")


def test_another_versions_cache_is_not_read(mpl_fonts, tmp_path):
    old = tmp_path / "glyphs-v0-small-0123456789ab.npz"
    old.write_bytes(b"from another version")
    said = []
    glyphs.load(str(tmp_path), "small", say=said.append)
    assert (
        said[0]
        == f"glyphs: not reading {old} (another generator version; this is {glyphs.VERSION})"
    )
    assert old.read_bytes() == b"from another version"


def test_an_interrupted_generation_leaves_no_cache(mpl_fonts, monkeypatch, tmp_path):
    real = glyphs.generate
    calls = []

    def interrupted(fonts, per_class, split):
        calls.append(split)
        if split == 1:
            raise KeyboardInterrupt  # Ctrl-C while the held-out images are drawn
        return real(fonts, per_class, split)

    monkeypatch.setattr(glyphs, "generate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        glyphs.load(str(tmp_path), "small", say=lambda _: None)
    assert calls == [0, 1] and cache_files(tmp_path) == []

    def fails_writing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(glyphs, "generate", real)
    monkeypatch.setattr(np, "savez", fails_writing)
    with pytest.raises(OSError):
        glyphs.load(str(tmp_path), "small", say=lambda _: None)
    assert cache_files(tmp_path) == []


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_two_ranks_train_on_glyphs_generated_once(tmp_path):
    """Two ranks on one host: one generates (the other waits on the lock), both train on the same
    cache; the held-out evaluation covers the 360 images of unseen families."""
    data = tmp_path / "data"
    r = launch(
        [
            "--dataset",
            "glyphs-small",
            "--data-path",
            data,
            "--model",
            "vit_glyphs",
            "--steps",
            6,
            "--eval-interval",
            6,
            "--no-save",
            "--log-dir",
            tmp_path / "logs",
        ],
        env={"VIT_GLYPH_FONTS": str(MPL_FONTS)},
        timeout=240,
    )
    assert r.ok, r
    assert sum(out.count("glyphs: generating 720 training images") for out in r.outputs) == 1, r
    assert len(list(data.glob("glyphs-v*-small-*.npz"))) == 1
    evals = [
        x for x in read_jsonl(tmp_path / "logs" / "metrics_rank0.jsonl") if x["kind"] == "eval"
    ]
    assert evals and 0 <= evals[-1]["top1"] <= 1 and evals[-1]["step"] == 6
    assert os.path.exists(tmp_path / "logs" / "summary.json")


def test_the_fine_tune_split_is_letters_and_digits_as_image_folders(mpl_fonts, tmp_path, capsys):
    """python -m bench glyph-split: the letters' and the digits' images of each split, as folders
    torchvision's ImageFolder reads with their characters as classes; an existing --out is refused
    in one line and left as it was."""
    from torchvision.datasets import ImageFolder

    from bench.__main__ import main

    data, out = str(tmp_path / "glyphs"), tmp_path / "split"
    args = ["glyph-split", "--dataset", "glyphs-small", "--data-path", data, "--out", str(out)]
    assert main(args) == 0
    d = glyphs.load(data, "small")
    for task, classes in (("letters", glyphs.CLASSES[10:]), ("digits", glyphs.CLASSES[:10])):
        for split, ys in (("train", d["y_train"]), ("val", d["y_test"])):
            folder = ImageFolder(str(out / task / split))
            assert folder.classes == sorted(classes)
            assert len(folder) == sum(glyphs.CLASSES[y] in classes for y in ys)
    image, label = ImageFolder(str(out / "digits" / "val"))[0]
    assert image.size == (glyphs.SIZE, glyphs.SIZE) and label == 0
    capsys.readouterr()
    with pytest.raises(SystemExit, match=r"--out .*split exists; give a new folder"):
        main(args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["glyphs", "split"]  # no half-written copy
    a_file = ["--data-path", str(tmp_path / "glyphs" / "x"), "--out", str(tmp_path / "other")]
    (tmp_path / "glyphs" / "x").write_text("")
    with pytest.raises(SystemExit, match=r"^bench glyph-split: glyphs: --data-path .*x is a file"):
        main([*args[:3], *a_file])
    assert not (tmp_path / "other").exists()
