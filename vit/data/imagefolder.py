"""ImageNet-style image folders, DATA/train/<class>/ and DATA/val/<class>/, through torchvision's
ImageFolder.

A damaged image is refused at the start, not met mid-run: every file's header is read with PIL
(Image.open identifies the format and size from the first bytes, without decoding), and any file
that is not an image stops the run in one line naming it. That costs about 30 us an image from the
page cache (3,000 small PNGs: 0.09 s; ImageNet's 1.3 million, about 40 s), more from a cold disk. A
file whose header is sound but whose data is cut short passes that check; reading it fails the run
mid-way, naming the file (read_rgb)."""

from pathlib import Path

from PIL import Image

from vit.core.errors import ConfigError

SHOWN = 3  # unreadable files named in the message; the rest are counted


def read_rgb(path: str) -> Image.Image:
    """torchvision's pil_loader, naming the file when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except OSError as e:  # PIL's UnidentifiedImageError and "image file is truncated" among them
        raise OSError(f"imagefolder: cannot read {path}: {e}") from e


def _header_problem(path: str) -> str | None:
    try:
        with Image.open(path):
            return None
    except OSError as e:  # UnidentifiedImageError too
        return (
            type(e).__name__ if "cannot identify image file" in str(e) else str(e).splitlines()[0]
        )


def check_images(root: Path, paths: list[str]) -> None:
    """Refuse the folder if any of `paths` is not an image PIL can open, naming the first few."""
    bad = [(p, why) for p in paths if (why := _header_problem(p)) is not None]
    if bad:
        named = ", ".join(f"{Path(p).relative_to(root)} ({why})" for p, why in bad[:SHOWN])
        more = f" and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
        raise ConfigError(
            f"imagefolder: {len(bad)} of the {len(paths)} files under {root} are not "
            f"images PIL can read: {named}{more}; remove or replace them (every image's "
            "header is checked before training)"
        )


def load_imagefolder(data_path: str, img_size: int, mean: tuple, std: tuple) -> tuple:
    """ImageNet-style tree: DATA/train/<class>/*.jpg and DATA/val/<class>/*.jpg. (the training set,
    the validation set), normalised with (mean, std), and the training images as they are, for
    augmentation (vit.data.datasets.DataSplit)."""
    from torchvision import datasets, transforms

    root = Path(data_path)
    splits = [root / "train", root / "val"]
    for s in splits:
        if not s.is_dir():
            raise ConfigError(
                f"imagefolder: {s} is not a folder (expected DATA/train/<class>/ "
                "and DATA/val/<class>/)"
            )
    tf = transforms.Compose(
        [
            transforms.Resize(int(img_size * 1.14)),
            transforms.CenterCrop(img_size),
            transforms.ToTensor(),
            transforms.Normalize(mean, std),
        ]
    )
    try:
        train, test = (datasets.ImageFolder(str(s), transform=tf, loader=read_rgb) for s in splits)
    except FileNotFoundError as e:  # torchvision: no class folder, or no image in any of them
        raise ConfigError(
            f"imagefolder: {str(e).splitlines()[0]} (expected "
            f"DATA/<split>/<class>/*.jpg, .png, ...)"
        )
    if train.classes != test.classes:
        raise ConfigError(f"imagefolder: the class folders of {splits[0]} and {splits[1]} differ")
    if len(train.classes) < 2:
        raise ConfigError(
            f"imagefolder: {splits[0]} holds {len(train.classes)} class folder "
            f"({', '.join(train.classes)}); a classifier needs at least two"
        )
    check_images(root, [p for ds in (train, test) for p, _label in ds.samples])
    return train, test, datasets.ImageFolder(str(splits[0]), loader=read_rgb)
