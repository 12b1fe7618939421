"""The data sets: digits (scikit-learn's, its split kept under data/digits), glyphs (drawn from
fonts: vit.data.glyphs), CIFAR's pickle batches, image folders and synthetic images, each as a
DataSplit (training and held-out sets, classes, shape, normalisation); which one --data-path holds.
The order they are read in is vit.data.sampling's."""

import contextlib
import os
import pickle
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, TensorDataset

from vit.core.errors import ConfigError
from vit.core.settings import DATASETS, DataSettings
from vit.data.imagefolder import load_imagefolder

READS_DATA_PATH = ("cifar10", "cifar100", "imagefolder", "glyphs", "glyphs-small")


@dataclass
class DataSplit:
    train: Dataset
    test: Dataset
    num_classes: int
    in_chans: int
    img_size: int
    mean: tuple = (0.485, 0.456, 0.406)  # the normalisation the images got, for --export's config
    std: tuple = (0.229, 0.224, 0.225)
    # the training images as PIL images, for timm's augmentation (vit.data.augment)
    raw_train: Dataset | None = None
    # the random-resized-crop scale when --scale is not given (vit.data.augment)
    default_scale: tuple | None = None


def _normalize(x: np.ndarray, mean, std) -> torch.Tensor:
    mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return (torch.from_numpy(x).float() - mean) / std


DIGITS_CACHE = os.path.join("data", "digits")
DIGITS_KEYS = ("x_train", "x_test", "y_train", "y_test")


def digits_split(folder: str = DIGITS_CACHE) -> dict[str, np.ndarray]:
    """scikit-learn's digits in a fixed, stratified 80/20 split, as arrays (images float32 in
    [0, 1], (N, 1, 8, 8)). Kept in `folder` as one .npz per scikit-learn version, written whole
    (beside it, then renamed): importing scikit-learn cost each rank about a CPU-second at every
    start (AMD EPYC VM: 4.2-4.9 CPU-s for torch and timm, 5.7-5.8 with scikit-learn's digits and
    split), reading the file a few milliseconds. A folder that cannot be written only costs that."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(f"digits: {folder} is a file; the digits' split is kept in that folder")
    path = Path(folder) / f"digits-sklearn-{metadata.version('scikit-learn')}.npz"
    try:
        with np.load(path) as z:
            return {k: z[k] for k in DIGITS_KEYS}
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise ConfigError(f"digits: {path} is corrupt ({e}); delete it to split the data again")
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    d = sk_digits()
    x = d.images.astype(np.float32)[:, None] / 16.0
    split = dict(
        zip(
            DIGITS_KEYS,
            train_test_split(x, d.target, test_size=0.2, random_state=0, stratify=d.target),
        )
    )
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".digits-", suffix=".npz.tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, **split)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return split


def load_digits(folder: str = DIGITS_CACHE) -> DataSplit:
    """scikit-learn's 1,797 handwritten digits (8x8, 17 grey levels); a fixed, stratified 80/20
    split (digits_split)."""
    d = digits_split(folder)
    x_tr, x_te, y_tr, y_te = (d[k] for k in DIGITS_KEYS)
    mean, std = float(x_tr.mean()), float(x_tr.std())

    def tensors(x, y):
        return TensorDataset(_normalize(x, [mean], [std]), torch.from_numpy(y).long())

    raw = PILImages(np.round(x_tr * 255).astype(np.uint8), y_tr)
    # A crop of 95-100% of the area, resized back: +2.5 points of top-1 on the default job
    # (docs/benchmarks.md).
    return DataSplit(
        tensors(x_tr, y_tr),
        tensors(x_te, y_te),
        num_classes=10,
        in_chans=1,
        img_size=8,
        mean=(mean,),
        std=(std,),
        raw_train=raw,
        default_scale=(0.95, 1.0),
    )


class _UInt8Images(Dataset):
    """Images kept as uint8 (N, C, H, W) and normalised per sample, to keep CIFAR's memory small."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, mean, std):
        self.images, self.targets = images, torch.from_numpy(labels).long()
        self.mean = torch.tensor(mean).view(-1, 1, 1) * 255
        self.std = torch.tensor(std).view(-1, 1, 1) * 255

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return (torch.from_numpy(self.images[i]).float() - self.mean) / self.std, self.targets[i]


class PILImages(Dataset):
    """uint8 images (N, C, H, W) with their labels as PIL images, what timm's transforms take."""

    def __init__(self, images: np.ndarray, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        img = self.images[i]
        img = (
            Image.fromarray(img[0])
            if img.shape[0] == 1
            else Image.fromarray(img.transpose(1, 2, 0))
        )
        return img, int(self.labels[i])


CIFAR = {  # folder inside --data-path, training files, test file, label key, mean, std
    "cifar10": (
        "cifar-10-batches-py",
        [f"data_batch_{i}" for i in range(1, 6)],
        "test_batch",
        b"labels",
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
    ),
    "cifar100": (
        "cifar-100-python",
        ["train"],
        "test",
        b"fine_labels",
        (0.5071, 0.4865, 0.4409),
        (0.2673, 0.2564, 0.2762),
    ),
}


def load_cifar(name: str, data_path: str, download: bool, norm: tuple | None = None) -> DataSplit:
    """CIFAR in the standard python pickle batch format (as published, and as torchvision saves it),
    normalised with `norm` (mean, std) when given, else with CIFAR's own statistics."""
    folder, train_files, test_file, label_key, mean, std = CIFAR[name]
    mean, std = norm or (mean, std)
    root = Path(data_path)
    if root.name != folder:
        root = root / folder
    if download and not root.exists():
        from torchvision import datasets  # only when asked for: needs network access

        getattr(datasets, name.upper())(str(root.parent), download=True)
    missing = [f for f in [*train_files, test_file] if not (root / f).is_file()]
    if missing:
        raise ConfigError(
            f"{name}: {root} lacks {', '.join(missing)} (python pickle "
            "batches; pass --download to fetch)"
        )

    def read(files):
        xs, ys = [], []
        for f in files:
            with open(root / f, "rb") as fh:
                batch = pickle.load(fh, encoding="bytes")
            xs.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(batch[label_key], dtype=np.int64))
        return np.concatenate(xs), np.concatenate(ys)

    (x_tr, y_tr), (x_te, y_te) = read(train_files), read([test_file])
    return DataSplit(
        _UInt8Images(x_tr, y_tr, mean, std),
        _UInt8Images(x_te, y_te, mean, std),
        num_classes=100 if name == "cifar100" else 10,
        in_chans=3,
        img_size=32,
        mean=mean,
        std=std,
        raw_train=PILImages(x_tr, y_tr),
    )


def load_glyphs(name: str, data_path: str | None, norm: tuple | None = None) -> DataSplit:
    """The glyphs task (vit.data.glyphs), generated into --data-path (default data/glyphs) on first
    use; glyphs-small is its quick version (720 training and 360 held-out images)."""
    from vit.data import glyphs

    size = "small" if name == "glyphs-small" else "full"
    data = glyphs.load(data_path or os.path.join("data", "glyphs"), size)
    x_tr = data["x_train"]
    mean, std = norm or (
        tuple(float(v) for v in x_tr.mean(axis=(0, 2, 3)) / 255),
        tuple(float(v) for v in x_tr.std(axis=(0, 2, 3)) / 255),
    )
    return DataSplit(
        _UInt8Images(x_tr, data["y_train"], mean, std),
        _UInt8Images(data["x_test"], data["y_test"], mean, std),
        num_classes=len(glyphs.CLASSES),
        in_chans=3,
        img_size=glyphs.SIZE,
        mean=mean,
        std=std,
        raw_train=PILImages(x_tr, data["y_train"]),
    )


class _Synthetic(Dataset):
    """Random images for speed runs: a small seeded pool, repeated; label = index mod classes."""

    def __init__(self, n: int, img_size: int, num_classes: int, seed: int, pool: int = 64):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(pool, 3, img_size, img_size, generator=g)
        self.targets = torch.arange(n) % num_classes

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return self.images[i % len(self.images)], self.targets[i]


def infer_dataset(data_path: str) -> str | None:
    """The data set a --data-path folder holds, from its layout: CIFAR's pickle folders or train/
    and val/."""
    root = Path(data_path)
    for name, (folder, *_rest) in CIFAR.items():
        if root.name == folder or (root / folder).is_dir():
            return name
    if (root / "train").is_dir() and (root / "val").is_dir():
        return "imagefolder"
    return None


def dataset_for(data: DataSettings) -> tuple[str, str | None]:
    """(data set, note): --dataset as given, or inferred from --data-path, else digits; a
    --data-path that the data set would not read is an error, never ignored."""
    if data.data_path is None:
        return data.dataset or "digits", None
    if data.dataset in READS_DATA_PATH:
        return data.dataset, None
    if data.dataset:
        raise ConfigError(
            f"--data-path {data.data_path}: --dataset {data.dataset} reads no files; "
            f"use --dataset {' / '.join(READS_DATA_PATH)}, or leave --data-path out"
        )
    inferred = infer_dataset(data.data_path)
    if inferred is None:
        raise ConfigError(
            f"--data-path {data.data_path}: not a CIFAR folder (cifar-10-batches-py/, "
            "cifar-100-python/) nor an image folder (train/ and val/); pass --dataset"
        )
    return (
        inferred,
        f"--data-path {data.data_path} holds {inferred}: training on it (--dataset {inferred})",
    )


def load_dataset(
    name: str,
    data_path: str | None,
    img_size: int,
    download: bool = False,
    synthetic_size: int = 2048,
    seed: int = 0,
    norm: tuple | None = None,
) -> DataSplit:
    """`norm`: the (mean, std) of pretrained weights (vit.model.weights.pretrained_norm), for the
    RGB data sets; digits and synthetic keep their own."""
    if norm is not None:
        # a grey model's, on RGB images
        norm = tuple(tuple(v) * 3 if len(v) == 1 else tuple(v) for v in norm)
    if name == "digits":
        return load_digits()
    if name in CIFAR:
        return load_cifar(name, data_path or os.path.join("data", name), download, norm)
    if name.startswith("glyphs"):
        return load_glyphs(name, data_path, norm)
    if name == "imagefolder":
        if not data_path:
            raise ConfigError("imagefolder needs --data-path DATA (with DATA/train and DATA/val)")
        mean, std = norm or (DataSplit.mean, DataSplit.std)  # ImageNet's statistics
        train, test, raw = load_imagefolder(data_path, img_size, mean, std)
        return DataSplit(
            train,
            test,
            num_classes=len(train.classes),
            in_chans=3,
            img_size=img_size,
            mean=mean,
            std=std,
            raw_train=raw,
        )
    if name == "synthetic":
        return DataSplit(
            _Synthetic(synthetic_size, img_size, 10, seed),
            _Synthetic(256, img_size, 10, seed + 1),
            num_classes=10,
            in_chans=3,
            img_size=img_size,
            mean=(0.0,) * 3,
            std=(1.0,) * 3,
        )
    raise ConfigError(f"unknown dataset '{name}'; choose one of: {', '.join(DATASETS)}")
