"""glyphs: the built-in benchmark task. The 36 characters 0-9 and A-Z drawn from a fixed set of
fonts (the Debian packages of glyph_fonts.txt), in colour at 32x32, each under its own random
affine, stroke, ink, paper texture, neighbouring glyph and noise; the held-out images come from font
families that training never sees, so the task measures generalisation to new typefaces
(notMNIST's idea). Generated once, deterministically from the fonts and VERSION, and cached as one
.npz under the data folder."""

import fcntl
import hashlib
import json
import os
import subprocess
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from vit.core.errors import ConfigError

VERSION = (
    1  # bump on any change to what the generator draws: caches of another version are not read
)
CLASSES = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
SIZE = 32
# images per class: (training, held-out)
SIZES = {"full": (700, 250), "small": (20, 10)}
PACKAGES = Path(__file__).with_name("glyph_fonts.txt")  # the Debian packages whose fonts it draws
HELD_OUT_SHARE = 0.2  # of the font families
INSTALL = "scripts/bootstrap.sh --fonts"
MIN_FAMILIES = 2
_RENDER = 64  # glyphs are drawn at twice the size, then reduced


@dataclass(frozen=True)
class Font:
    path: str
    family: str


def packages() -> list[str]:
    return [w for line in PACKAGES.read_text().splitlines() if (w := line.split("#")[0].strip())]


def font_files() -> list[Path]:
    """The fonts the task draws: every .ttf and .otf of the packages in glyph_fonts.txt, or, where
    VIT_GLYPH_FONTS names folders (separated by ':'), every one under them; one line naming what is
    missing and how to install it otherwise."""
    if os.environ.get("VIT_GLYPH_FONTS"):
        dirs = [d for d in os.environ["VIT_GLYPH_FONTS"].split(os.pathsep) if d]
        files = [
            p for d in dirs for p in Path(d).rglob("*") if p.suffix.lower() in (".ttf", ".otf")
        ]
        if not files:
            raise ConfigError(
                f"glyphs: no .ttf or .otf files under VIT_GLYPH_FONTS={':'.join(dirs)}"
            )
        return sorted(set(files))
    names = packages()
    try:
        status = subprocess.run(
            ["dpkg-query", "-W", "-f", "${Package} ${db:Status-Abbrev}\n", *names],
            capture_output=True,
            text=True,
        ).stdout
    except FileNotFoundError:
        raise ConfigError(
            "glyphs: no dpkg-query here to find the fonts of glyph_fonts.txt's Debian packages; "
            "set VIT_GLYPH_FONTS to folders of .ttf/.otf fonts (other fonts make another task)"
        ) from None
    installed = {line.split()[0] for line in status.splitlines() if line.split()[1:2] == ["ii"]}
    missing = [n for n in names if n not in installed]
    if missing:
        raise ConfigError(
            f"glyphs: {len(missing)} of its {len(names)} font packages are not installed "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
            f"install them with {INSTALL}"
        )
    listed = subprocess.run(["dpkg-query", "-L", *names], capture_output=True, text=True).stdout
    files = {Path(f) for f in listed.splitlines() if f.lower().endswith((".ttf", ".otf"))}
    return sorted(f for f in files if f.is_file())


def cache_name(files: list[Path], size: str) -> str:
    """The cache's file name: the generator's version, the size and a hash of the font files' names
    and sizes (cheap to compute on every start; the contents' hash is in the cache's metadata)."""
    h = hashlib.sha256(f"{VERSION} {size}\n".encode())
    for f in files:
        h.update(f"{f.name} {f.stat().st_size}\n".encode())
    return f"glyphs-v{VERSION}-{size}-{h.hexdigest()[:12]}.npz"


def _family(path: Path) -> str | None:
    """The font's family (typographic family first), or None when it lacks one of CLASSES."""
    import logging

    from fontTools.ttLib import TTFont

    logging.getLogger("fontTools").setLevel(logging.ERROR)  # its notes on odd tables are not ours

    try:
        font = TTFont(path, lazy=True, fontNumber=0)
        cmap = font.getBestCmap() or {}
        names = font["name"]
        family = names.getDebugName(16) or names.getDebugName(1)
    except Exception:  # a file fontTools cannot read is not a font we can use
        return None
    if not family or any(ord(c) not in cmap for c in CLASSES):
        return None
    return family


def _draw(font: ImageFont.FreeTypeFont, char: str, stroke: int) -> np.ndarray | None:
    """The glyph's ink as a float mask cropped to its box, or None when it draws nothing."""
    canvas = Image.new("L", (2 * _RENDER, 2 * _RENDER))
    ImageDraw.Draw(canvas).text(
        (_RENDER, _RENDER),
        char,
        font=font,
        fill=255,
        anchor="mm",
        stroke_width=stroke,
        stroke_fill=255,
    )
    box = canvas.getbbox()
    if box is None or box[2] - box[0] < 2 or box[3] - box[1] < 4:
        return None
    return np.asarray(canvas.crop(box), dtype=np.float32) / 255


def usable_fonts(files: list[Path]) -> list[Font]:
    """The fonts with every class, each drawing something, no two classes alike (symbol fonts map
    letters to one shape), and one file per contents."""
    fonts, seen = [], set()
    for path in files:
        family = _family(path)
        if family is None:
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest in seen:
            continue
        try:
            face = ImageFont.truetype(str(path), _RENDER // 2)
        except OSError:
            continue
        masks = [_draw(face, c, 0) for c in CLASSES]
        if any(m is None for m in masks):
            continue
        shapes = {(m.shape, np.round(m, 1).tobytes()) for m in masks}
        if len(shapes) < len(CLASSES):
            continue
        seen.add(digest)
        fonts.append(Font(str(path), family))
    return fonts


def split_families(fonts: list[Font]) -> tuple[list[Font], list[Font]]:
    """(training, held-out): the held-out families are the first HELD_OUT_SHARE of the families in
    the order of their names' sha256, so a family is on one side only and the choice is fixed."""
    families = sorted(
        {f.family for f in fonts}, key=lambda n: hashlib.sha256(n.encode()).hexdigest()
    )
    if len(families) < MIN_FAMILIES:
        raise ConfigError(
            f"glyphs: {len(families)} usable font famil{'y' if len(families) == 1 else 'ies'} "
            f"(every class drawn, no two alike), need at least {MIN_FAMILIES}; "
            f"install the fonts with {INSTALL}"
        )
    held = set(families[: max(1, round(HELD_OUT_SHARE * len(families)))])
    return [f for f in fonts if f.family not in held], [f for f in fonts if f.family in held]


def _affine(rng: np.random.Generator, w: int, h: int) -> tuple:
    """The inverse map (output pixel to glyph pixel) that PIL's Image.transform takes: the glyph
    scaled to a random height, rotated, sheared and moved off the centre of a _RENDER canvas."""
    height = rng.uniform(0.6, 0.85) * _RENDER
    s = min(height / h, 0.9 * _RENDER / w)
    sx, sy = s * rng.uniform(0.9, 1.1), s
    a, k = np.deg2rad(rng.uniform(-8, 8)), rng.uniform(-0.15, 0.15)
    rot = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
    m = rot @ np.array([[1, k], [0, 1]]) @ np.diag([sx, sy])
    centre = _RENDER / 2 + rng.uniform(-0.05, 0.05, 2) * _RENDER
    inv = np.linalg.inv(m)
    offset = np.array([w / 2, h / 2]) - inv @ centre
    return (inv[0, 0], inv[0, 1], offset[0], inv[1, 0], inv[1, 1], offset[1])


def _texture(rng: np.random.Generator) -> np.ndarray:
    """Paper: a smooth random field (a 4x4 grid, bicubic) and a gradient, in [-1, 1]."""
    grid = Image.fromarray(rng.uniform(0, 255, (4, 4)).astype(np.uint8))
    field = np.asarray(grid.resize((SIZE, SIZE), Image.BICUBIC), np.float32) / 127.5 - 1
    ramp = np.linspace(-1, 1, SIZE, dtype=np.float32)
    g = rng.uniform(-1, 1, 2)
    return 0.6 * field + 0.4 * (g[0] * ramp[None, :] + g[1] * ramp[:, None])


def _colours(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(ink, paper) RGB in [0, 1]: dark ink on light paper, one time in four the other way round,
    their luminance at least 0.35 apart. (Paper of any colour and ink of either polarity kept a
    6-block ViT at chance for 600 steps: the background's colour swamped the patches.)"""
    lum = np.array([0.299, 0.587, 0.114])
    while True:
        light, dark = rng.uniform(0.55, 1.0, 3), rng.uniform(0.0, 0.45, 3)
        if light @ lum - dark @ lum >= 0.35:
            return (light, dark) if rng.random() < 0.25 else (dark, light)


class _Glyphs:
    """Each font's glyph masks, drawn once per (class, stroke)."""

    def __init__(self, fonts: list[Font]):
        self.faces = [ImageFont.truetype(f.path, _RENDER // 2) for f in fonts]
        self.masks = {}

    def mask(self, font: int, char: str, stroke: int) -> np.ndarray:
        key = (font, char, stroke)
        if key not in self.masks:
            self.masks[key] = _draw(self.faces[font], char, stroke)
        return self.masks[key]


def render(glyphs: _Glyphs, font: int, label: int, rng: np.random.Generator) -> np.ndarray:
    """One image (3, SIZE, SIZE) uint8: class `label` in font `font`, sometimes with part of a
    neighbouring character at a side, as in a crop from a word."""
    stroke = int(rng.choice([0, 0, 0, 1, 2]))
    ink_mask = np.zeros((_RENDER, _RENDER), np.float32)
    for char, shift in [(CLASSES[label], 0.0)] + (
        [(CLASSES[rng.integers(len(CLASSES))], rng.choice([-1.0, 1.0]))]
        if rng.random() < 0.25
        else []
    ):
        m = glyphs.mask(font, char, stroke)
        glyph = Image.fromarray(m * 255).convert("L")
        coeffs = list(_affine(rng, glyph.width, glyph.height))
        if shift:  # the neighbour stands 0.85-1 of the canvas to one side
            d = shift * rng.uniform(0.85, 1.0) * _RENDER
            coeffs[2] -= coeffs[0] * d
            coeffs[5] -= coeffs[3] * d
        out = glyph.transform((_RENDER, _RENDER), Image.AFFINE, coeffs, Image.BICUBIC)
        ink_mask = np.maximum(ink_mask, np.asarray(out, np.float32) / 255)
    small = Image.fromarray((ink_mask * 255).astype(np.uint8)).reduce(2)
    alpha = np.asarray(small, np.float32)[None] / 255
    ink, paper = _colours(rng)
    texture = _texture(rng) * rng.uniform(0.0, 0.2)
    background = np.clip(paper[:, None, None] + texture[None], 0, 1)
    image = background * (1 - alpha) + ink[:, None, None] * alpha
    image = image + rng.normal(0, rng.uniform(0, 0.04), image.shape)
    return np.round(np.clip(image, 0, 1) * 255).astype(np.uint8)


def generate(fonts: list[Font], per_class: int, split: int) -> tuple[np.ndarray, np.ndarray]:
    """per_class images of every class, the families taken in turn (from another offset per class)
    and each family's fonts in turn, so that a family of twenty weights weighs as much as a family
    of one; each image from its own generator seeded by (VERSION, split, index)."""
    glyphs = _Glyphs(fonts)
    families = {}
    for i, f in enumerate(fonts):
        families.setdefault(f.family, []).append(i)
    members = list(families.values())
    n = per_class * len(CLASSES)
    images = np.empty((n, 3, SIZE, SIZE), np.uint8)
    labels = np.arange(n, dtype=np.int64) % len(CLASSES)
    for i in range(n):
        label = int(labels[i])
        turn, family = divmod(i // len(CLASSES) + 7 * label, len(members))
        font = members[family][turn % len(members[family])]
        rng = np.random.default_rng([VERSION, split, i])
        images[i] = render(glyphs, font, label, rng)
    return images, labels


def _sha256(data: dict) -> str:
    """Of the images and labels, what the cache's metadata records and every read checks."""
    digest = hashlib.sha256()
    for k in ("x_train", "y_train", "x_test", "y_test"):
        digest.update(np.ascontiguousarray(data[k]).tobytes())
    return digest.hexdigest()


def _read(path: Path) -> dict:
    try:
        with np.load(path) as z:
            data = {k: z[k] for k in ("x_train", "y_train", "x_test", "y_test", "meta")}
        meta = json.loads(str(data.pop("meta")))
        if meta.get("version") != VERSION:
            raise ValueError(f"generator version {meta.get('version')}")
        if _sha256(data) != meta["sha256"]:
            raise ValueError("its images do not match their sha256")
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise ConfigError(
            f"glyphs: {path} is corrupt ({e}); delete it to generate the data set again"
        )
    return {**data, "meta": meta}


def _write(path: Path, data: dict, meta: dict) -> None:
    """The whole file or nothing: written beside the cache, then renamed over it."""
    meta = {**meta, "sha256": _sha256(data)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".glyphs-", suffix=".npz.tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **data, meta=np.array(json.dumps(meta)))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would keep the data set from the other users
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load(root: str, size: str = "full", say=print) -> dict:
    """The cached data set under `root` for these fonts, generated first if missing: x_train,
    y_train, x_test, y_test (images uint8 (N, 3, 32, 32)) and meta (fonts of each side, sha256).
    Ranks of one host wait for the one that generates (a lock beside the cache)."""
    files = font_files()
    folder = Path(root)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"glyphs: --data-path {root} is a file; give the folder to cache the task in"
        )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / cache_name(files, size)
    with open(folder / ".glyphs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            for other in sorted(folder.glob("glyphs-v*.npz")):
                if not other.name.startswith(f"glyphs-v{VERSION}-"):
                    say(
                        f"glyphs: not reading {other} (another generator "
                        f"version; this is {VERSION})"
                    )
            fonts = usable_fonts(files)
            train_fonts, test_fonts = split_families(fonts)
            per_train, per_test = SIZES[size]
            say(
                f"glyphs: generating {per_train * len(CLASSES)} training images from "
                f"{len(train_fonts)} fonts and {per_test * len(CLASSES)} held-out images from "
                f"{len(test_fonts)} fonts of other families (once; cached as {path})"
            )
            x_train, y_train = generate(train_fonts, per_train, 0)
            x_test, y_test = generate(test_fonts, per_test, 1)
            meta = {
                "version": VERSION,
                "size": size,
                "classes": CLASSES,
                "train_fonts": [[f.path, f.family] for f in train_fonts],
                "test_fonts": [[f.path, f.family] for f in test_fonts],
            }
            data = {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}
            _write(path, data, meta)
        return _read(path)
