"""Data sets in their real file formats, and the step-indexed sampling every engine shares."""

import json
import pickle
import shlex
import sys

import numpy as np
import pytest
import torch
from helpers import base_env, plan_in_process, run_cmd

from vit.core.errors import ConfigError
from vit.data.datasets import DIGITS_KEYS, digits_split, load_dataset
from vit.data.sampling import PAD_LABEL, TrainBatches, eval_batches, make_loader


def test_digits_split_is_fixed_and_stratified():
    load_digits_twice = [load_dataset("digits", None, 8) for _ in range(2)]
    d = load_digits_twice[0]
    assert (len(d.train), len(d.test), d.num_classes, d.in_chans, d.img_size) == (
        1437,
        360,
        10,
        1,
        8,
    )
    assert torch.equal(d.test.tensors[0], load_digits_twice[1].test.tensors[0])
    assert torch.bincount(d.test.tensors[1]).min() >= 35  # every class held out


def test_digits_are_split_once_and_then_read_without_scikit_learn(tmp_path, monkeypatch):
    first = digits_split(str(tmp_path))
    (cache,) = tmp_path.iterdir()  # the split, and nothing half-written beside it
    assert cache.name.startswith("digits-sklearn-") and first["x_train"].shape == (1437, 1, 8, 8)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # importing it now fails
    again = digits_split(str(tmp_path))
    for k in DIGITS_KEYS:
        assert again[k].dtype == first[k].dtype and np.array_equal(again[k], first[k]), k
    cache.write_bytes(cache.read_bytes()[:200])
    with pytest.raises(ConfigError, match="is corrupt .*delete it to split the data again"):
        digits_split(str(tmp_path))
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="file is a file; the digits' split is kept in"):
        digits_split(str(tmp_path / "file"))


def write_cifar(root, name, n_train=24, n_test=12):
    rng = np.random.default_rng(0)
    folder, files, test, key, classes = {
        "cifar10": (
            "cifar-10-batches-py",
            [f"data_batch_{i}" for i in range(1, 6)],
            "test_batch",
            b"labels",
            10,
        ),
        "cifar100": ("cifar-100-python", ["train"], "test", b"fine_labels", 100),
    }[name]
    (root / folder).mkdir(parents=True)
    for f, n in [*[(f, n_train) for f in files], (test, n_test)]:
        batch = {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            key: rng.integers(0, classes, n).tolist(),
        }
        with open(root / folder / f, "wb") as fh:
            pickle.dump(batch, fh)
    return classes, len(files) * n_train, n_test


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_pickle_batches(tmp_path, name):
    classes, n_train, n_test = write_cifar(tmp_path, name)
    d = load_dataset(name, str(tmp_path), 32)
    assert (len(d.train), len(d.test), d.num_classes, d.img_size) == (n_train, n_test, classes, 32)
    x, y = d.train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= int(y) < classes
    assert -3 < float(x.mean()) < 3


def test_cifar_missing_files_name_them(tmp_path):
    with pytest.raises(ConfigError, match="lacks data_batch_1"):
        load_dataset("cifar10", str(tmp_path), 32)


def test_imagefolder(tmp_path):
    from PIL import Image

    for split, n in (("train", 3), ("val", 2)):
        for cls, color in (("cat", (200, 30, 30)), ("dog", (30, 30, 200))):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (40 + i, 36), color).save(tmp_path / split / cls / f"{i}.png")
    d = load_dataset("imagefolder", str(tmp_path), 16)
    assert (len(d.train), len(d.test), d.num_classes) == (6, 4, 2)
    x, y = d.test[3]
    assert x.shape == (3, 16, 16) and y == 1
    red = 200 / 255
    # ImageNet's statistics
    assert float(x[0, 0, 0]) == pytest.approx((30 / 255 - 0.485) / 0.229, abs=1e-5)
    pre = load_dataset("imagefolder", str(tmp_path), 16, norm=((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)))
    assert (pre.mean, pre.std) == ((0.5,) * 3, (0.5,) * 3)  # what --export records
    assert float(pre.train[0][0][0, 0, 0]) == pytest.approx((red - 0.5) / 0.5, abs=1e-5)
    # a grey model's, per channel
    grey = load_dataset("imagefolder", str(tmp_path), 16, norm=((0.2,), (0.4,)))
    assert float(grey.test[3][0][2, 0, 0]) == pytest.approx((red - 0.2) / 0.4, abs=1e-5)
    (tmp_path / "val" / "dog").rename(tmp_path / "val" / "bird")
    with pytest.raises(ConfigError, match="class folders"):
        load_dataset("imagefolder", str(tmp_path), 16)


def image_folder(root, classes, per_class=3):
    from PIL import Image

    for split in ("train", "val"):
        for k, cls in enumerate(classes):
            (root / split / cls).mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (36, 36), (40 * k, 90, 200 - 40 * k)).save(
                    root / split / cls / f"{i}.png"
                )
    return root


@pytest.mark.ranks
@pytest.mark.timeout(200)
def test_a_folder_of_one_class_is_refused_and_few_classes_report_no_top5(tmp_path):
    """One class trained to 100% without a word; with five classes or fewer top-5 is always 100%,
    so it is not reported."""
    with pytest.raises(
        ConfigError, match=r"holds 1 class folder \(cat\); a classifier needs at least two"
    ):
        load_dataset("imagefolder", str(image_folder(tmp_path / "one", ["cat"])), 16)
    three = image_folder(tmp_path / "three", ["cat", "dog", "eel"])
    args = ["--dataset", "imagefolder", "--data-path", three, "--model", "vit_tiny_cifar"]
    args += ["--steps", 2, "--micro-batch-size", 3, "--no-save", "--monitor-interval", 0]
    run = tmp_path / "run"
    r = run_cmd(
        [sys.executable, "-m", "vit.train", *map(str, args), "--log-dir", str(run)],
        env=base_env(),
        timeout=150,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [line for line in r.stdout.splitlines() if line.startswith(("eval at", "done:"))]
    assert len(evals) == 2 and all("top-1" in e and "top-5" not in e for e in evals), evals
    summary = json.loads((run / "summary.json").read_text())
    assert "top1" in summary and "top5" not in summary


def test_an_image_that_is_not_one_is_named_before_training(tmp_path, monkeypatch):
    """A garbage file with a .png name refuses the run at the start, naming it (it was an
    UnidentifiedImageError mid-run); a PNG cut short has a sound header and passes, and reading it
    names the file."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 4), ("val", 2)):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(n):  # noise: the image data is most of the file
                pixels = rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / cls / f"{i}.png")
    bad = tmp_path / "train" / "dog" / "3.png"
    bad.write_bytes(b"garbage bytes with a .png name")
    # Refused by rank 0 of two as vit.train plans (in-process), before any process group: a check
    # made after it starts would hang there.
    with pytest.raises(ConfigError) as e:
        args = shlex.split("--img-size 8 --steps 1 --micro-batch-size 4")
        plan_in_process(
            monkeypatch,
            ["--data-path", tmp_path, *args, "--log-dir", tmp_path / "run"],
            world_size=2,
        )
    assert str(e.value) == (
        f"imagefolder: 1 of the 12 files under {tmp_path} are not images PIL "
        f"can read: "
        "train/dog/3.png (UnidentifiedImageError); remove or replace them (every image's header is "
        "checked before "
        "training)"
    )
    assert not (tmp_path / "run").exists()
    whole = (tmp_path / "train" / "cat" / "0.png").read_bytes()
    bad.write_bytes(whole[: len(whole) // 2])
    d = load_dataset("imagefolder", str(tmp_path), 8)
    with pytest.raises(OSError, match=f"imagefolder: cannot read {bad}: image file is truncated"):
        d.train[[str(p) for p, _label in d.train.samples].index(str(bad))]


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_training_reads_cifar_folder(tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    write_cifar(data, "cifar10")
    args = shlex.split(
        "--dataset cifar10 --model vit_tiny_cifar --steps 2 --micro-batch-size 8 --no-save "
        "--monitor-interval 0"
    )
    r = run_cmd(
        [sys.executable, "-m", "vit.train", *args, "--data-path", data, "--log-dir", run],
        env=base_env(),
        timeout=110,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "eval at step 2" in r.stdout


@pytest.mark.parametrize("dp,ga", [(1, 1), (2, 1), (2, 3), (4, 2)])
def test_data_parallel_micro_batches_make_up_the_global_batch(dp, ga):
    n, mb = 103, 4
    single = list(TrainBatches(n, mb * ga * dp, 1, 0, 1, seed=5, start_step=0, end_step=7))
    per_rank = [
        list(TrainBatches(n, mb, ga, r, dp, seed=5, start_step=0, end_step=7)) for r in range(dp)
    ]
    for step in range(7):
        shards = [i for r in range(dp) for i in sum(per_rank[r][step * ga : (step + 1) * ga], [])]
        assert sorted(shards) == sorted(single[step]) and len(set(shards)) == mb * ga * dp


def test_sampler_resumes_mid_run_and_reshuffles_per_epoch():
    full = list(TrainBatches(50, 5, 2, 1, 2, seed=1, start_step=0, end_step=9))
    assert list(TrainBatches(50, 5, 2, 1, 2, seed=1, start_step=4, end_step=9)) == full[8:]
    one_epoch = TrainBatches(50, 10, 1, 0, 1, seed=1, start_step=0, end_step=10)
    batches = list(one_epoch)
    assert one_epoch.per_epoch == 5 and batches[:5] != batches[5:10]


def test_eval_batches_pad_every_rank_to_the_same_count():
    lists = [eval_batches(11, 4, r, 3) for r in range(3)]
    assert {len(b) for b in lists} == {1} and all(len(b) == 4 for rank in lists for b in rank)
    real = sorted(i for rank in lists for b in rank for i in b if i >= 0)
    assert real == list(range(11))
    assert PAD_LABEL == -100


RECIPE = dict(
    scale=(0.6, 1.0),
    hflip=0.5,
    aa="rand-m9-mstd0.5",
    color_jitter=0.3,
    reprob=0.25,
    mixup=0.8,
    cutmix=1.0,
    smoothing=0.1,
)


@pytest.mark.ranks  # DataLoader workers are processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp,ga,workers", [(2, 2, 0), (4, 1, 2)])
def test_augmented_mixed_global_batch_is_the_same_for_any_width_and_workers(dp, ga, workers):
    from vit.data.augment import train_batches
    from vit.data.datasets import load_digits
    from vit.run.cli import defaults

    data, r, steps, g = load_digits(), defaults().with_(**RECIPE).recipe, 3, 32
    # the whole global batches, as the single-process reference draws them
    one = dict(partners=False, micro_batch=g, grad_accum=1, dp_rank=0, dp_size=1)
    whole = list(train_batches(data, r, 3, **one, start_step=0, end_step=steps))
    ranks = [
        list(
            train_batches(
                data,
                r,
                3,
                micro_batch=g // dp // ga,
                grad_accum=ga,
                dp_rank=k,
                dp_size=dp,
                start_step=0,
                end_step=steps,
                workers=workers,
            )
        )
        for k in range(dp)
    ]
    for step in range(steps):
        parts = [ranks[k][step * ga + j] for j in range(ga) for k in range(dp)]
        assert torch.equal(torch.cat([x for x, _ in parts]), whole[step][0])
        assert torch.equal(torch.cat([y for _, y in parts]), whole[step][1])
        assert whole[step][1].shape == (g, 10)  # soft targets
    plain = next(
        iter(make_loader(data.train, TrainBatches(len(data.train), g, 1, 0, 1, 3, 0, 1), 0, False))
    )
    assert not torch.allclose(whole[0][0], plain[0])  # it did augment and mix
    # Resuming at step 2 gives step 2's augmented batch again.
    again = list(train_batches(data, r, 3, **one, start_step=2, end_step=3))
    assert torch.equal(again[0][0], whole[2][0]) and torch.equal(again[0][1], whole[2][1])


def test_an_augmented_batch_is_its_samples_and_leaves_the_callers_generators_alone():
    """The batched fetch seeds each sample by (seed, step, index), whatever else is in the batch,
    and puts the caller's generators back (drop-path draws the same numbers with or without
    augmentation)."""
    import random

    from vit.data.augment import train_dataset
    from vit.data.datasets import load_digits
    from vit.run.cli import defaults

    data = load_digits()
    ds, keyed = train_dataset(
        data, defaults().with_(**{**RECIPE, "mixup": 0.0, "cutmix": 0.0}).recipe, 5
    )
    assert keyed
    # sample 7 at steps 3 and 9, sample 8 at step 3
    keys = [3 * len(ds) + 7, 9 * len(ds) + 7, 3 * len(ds) + 8]
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    states = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    batch = ds.__getitems__(keys)
    assert random.getstate() == states[0] and np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])
    alone = [ds.__getitems__([k])[0] for k in reversed(keys)][::-1]
    assert all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(batch, alone))
    # another step, another augmentation of the same image
    assert not torch.equal(batch[0][0], batch[1][0])


class _Unreadable(torch.utils.data.Dataset):
    """A data set whose images must not be read, with its labels as `targets` (or none)."""

    def __init__(self, targets):
        self.targets = targets

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        raise AssertionError("an image was read")


def test_a_labels_only_rank_gets_the_same_labels_and_mixed_targets_without_reading_an_image(
    tmp_path,
):
    """A pipeline's last stage uses only the labels: its batches carry the same labels and, with
    mixup and cutmix, the same soft targets (cutmix's lam depends on the images' size), with blank
    images of the right shape."""
    from dataclasses import replace

    from vit.data.augment import train_batches, without_images
    from vit.data.datasets import load_digits
    from vit.run.cli import defaults

    data, r = load_digits(), defaults().with_(**RECIPE).recipe
    order = dict(micro_batch=8, grad_accum=2, dp_rank=1, dp_size=2, start_step=0, end_step=3)
    full = list(train_batches(data, r, 3, **order))
    targets = data.train.tensors[1].tolist()
    # any image read fails
    blind = replace(data, raw_train=_Unreadable(targets), train=_Unreadable(targets))
    labels = list(train_batches(blind, r, 3, labels_only=True, **order))
    assert len(labels) == len(full) == 6
    for (x, y), (blank, same) in zip(full, labels):
        assert torch.equal(y, same) and y.shape == (8, 10)  # soft targets
        assert blank.shape == x.shape and not blank.any()
    test = without_images(data.test, data)
    assert torch.equal(torch.stack([test[i][1] for i in range(len(test))]), data.test.tensors[1])
    # Data sets with `targets` (torchvision's, CIFAR's and synthetic here) too; one with neither is
    # read as it is.
    synthetic = load_dataset("synthetic", None, 8, synthetic_size=32)
    assert [int(without_images(synthetic.train, synthetic)[i][1]) for i in range(32)] == [
        i % 10 for i in range(32)
    ]
    neither = _Unreadable(None)
    assert without_images(neither, data) is neither


class _Counting(torch.utils.data.Dataset):
    """A data set with `targets` that notes each image read; its labels are ints, as
    ImageFolder's."""

    def __init__(self, ds):
        self.ds, self.targets, self.read = ds, ds.tensors[1].tolist(), []

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        self.read.append(i)
        return self.ds[i][0], self.targets[i]


def test_samples_the_freeze_cache_holds_are_not_read():
    """--freeze-cache's samples come with a blank image and their label, without reading the image;
    the rest as before, in the same batches."""
    from dataclasses import replace

    from vit.data.augment import train_batches
    from vit.data.datasets import load_digits
    from vit.run.cli import defaults

    data, r = load_digits(), defaults().with_(no_aug=True).recipe
    counting = _Counting(data.train)
    data = replace(data, train=counting)
    order = dict(micro_batch=8, grad_accum=2, dp_rank=1, dp_size=2, start_step=0, end_step=3)
    full = list(train_batches(data, r, 3, **order))
    every = sorted(set(counting.read))
    held, counting.read = set(every[::2]), []
    part = list(train_batches(data, r, 3, cached=held, **order))
    assert sorted(set(counting.read)) == every[1::2] and len(part) == len(full) == 6
    for (x, y), (x2, y2), idx in zip(full, part, TrainBatches(len(counting), seed=3, **order)):
        assert torch.equal(y, y2)
        for row, i in enumerate(idx):
            assert not x2[row].any() if i in held else torch.equal(x2[row], x[row])
