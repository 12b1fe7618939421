"""python -m bench glyph-split: the glyphs task split for a fine-tune. The 26 letters become one
image folder to pretrain on, the 10 digits another to fine-tune on (a new head, a new label set,
typefaces alike); each split's held-out images are those of the held-out font families. The
pretraining and the paired comparison are ordinary runs (docs/benchmarks.md, "DiLoCo on glyphs at
the defaults of 1 December 2026")."""

import os
import shutil
import tempfile
from pathlib import Path

from PIL import Image

from vit.core.errors import ConfigError

TASKS = {"letters": range(10, 36), "digits": range(10)}  # indices into vit.data.glyphs.CLASSES


def write_split(data: dict, out: Path) -> dict[str, int]:
    """OUT/<task>/{train,val}/<character>/<i>.png for each of TASKS, from the glyphs arrays,
    written beside OUT and renamed into place (OUT is whole or absent); the images of each."""
    from vit.data.glyphs import CLASSES

    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    counts = {}
    try:
        for task, keep in TASKS.items():
            for split, xs, ys in (("train", "x_train", "y_train"), ("val", "x_test", "y_test")):
                chosen = [i for i, y in enumerate(data[ys]) if y in keep]
                for i in chosen:
                    folder = tmp / task / split / CLASSES[data[ys][i]]
                    folder.mkdir(parents=True, exist_ok=True)
                    Image.fromarray(data[xs][i].transpose(1, 2, 0)).save(folder / f"{i}.png")
                counts[f"{task}/{split}"] = len(chosen)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return counts


def run(a) -> int:
    from vit.data import glyphs

    out = Path(a.out)
    if out.exists():
        raise SystemExit(f"bench glyph-split: --out {out} exists; give a new folder")
    if not out.parent.is_dir():
        raise SystemExit(f"bench glyph-split: --out {out}: {out.parent} is not a folder")
    size = "small" if a.dataset == "glyphs-small" else "full"
    try:
        data = glyphs.load(a.data_path, size)
    except ConfigError as e:  # no fonts, a file as --data-path, a damaged cache
        raise SystemExit(f"bench glyph-split: {e}")
    counts = write_split(data, out)
    print(", ".join(f"{k}: {n} images" for k, n in counts.items()) + f", in {out}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="a new folder for letters/ and digits/")
    p.add_argument(
        "--dataset", choices=("glyphs", "glyphs-small"), default="glyphs", help="the task to split"
    )
    p.add_argument(
        "--data-path",
        default=os.path.join("data", "glyphs"),
        help="where the glyphs cache is (drawn there first if missing; default %(default)s)",
    )


COMMANDS = {
    "glyph-split": (
        "the glyphs task as two image folders for a fine-tune: letters to pretrain on, digits to "
        "fine-tune on",
        add_arguments,
        run,
    )
}
