"""python -m bench finetune: fine-tuning from a model this project pretrained, against training from
scratch.

Pretraining: the default job (vit_digits on the 8x8 digits, 10 classes) with --export. The new task:
even or odd (2 classes) on the same digits drawn as 16x16 RGB PNGs in an image folder, with only
--per-class training images per digit; held out: the 360 held-out digits. Fine-tuning starts from
the export (--pretrained-path: head reset, position embedding resampled from 4x4 to 8x8 patches, the
patch embedding adapted from 1 to 3 channels); the baseline is the same run from a random
initialisation. Median top-1 over seeds."""

import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from bench.common import device_name, failure_tail, load_avg, mpirun_train, publish
from vit.core.settings import positive_int


def write_parity_folder(root: Path, per_class: int, task: str = "parity") -> None:
    """DATA/train/<class>/*.png (per_class of each digit) and DATA/val/<class>/*.png (every held-out
    one), the classes even and odd (task "parity") or the ten digits (task "digit")."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(
        d.images, d.target, test_size=0.2, random_state=0, stratify=d.target
    )
    keep = np.concatenate([np.flatnonzero(y_tr == c)[:per_class] for c in range(10)])
    for split, xs, ys in (("train", x_tr[keep], y_tr[keep]), ("val", x_te, y_te)):
        for i, (img, label) in enumerate(zip(xs, ys)):
            name = f"digit{label}" if task == "digit" else ("even" if label % 2 == 0 else "odd")
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            grey = Image.fromarray(np.round(img * 255 / 16).astype(np.uint8)).resize(
                (16, 16), Image.NEAREST
            )
            grey.convert("RGB").save(folder / f"{i}.png")


def run(a) -> int:
    seeds = [int(s) for s in a.seeds.split(",")]
    rows, load = {}, load_avg()
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(a.out) / "logs" if a.out else Path(tmp)
        data, export = Path(tmp) / "parity", logs / "pretrain" / "digits.safetensors"
        write_parity_folder(data, a.per_class)
        (logs / "pretrain").mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        rc = mpirun_train(
            ["--no-save", "--export", export, "--log-dir", logs / "pretrain"],
            2,
            logs / "pretrain",
            a.timeout,
        )
        if rc != 0:
            raise SystemExit(
                f"bench finetune: pretraining failed: {failure_tail(logs / 'pretrain')}"
            )
        pretrain_s = time.perf_counter() - t0
        task = [
            "--dataset",
            "imagefolder",
            "--data-path",
            data,
            "--img-size",
            16,
            "--micro-batch-size",
            8,
            "--epochs",
            a.epochs,
            "--no-save",
            "--monitor-interval",
            0,
        ]
        for name, extra in (
            ("from scratch", []),
            ("fine-tuned", ["--pretrained-path", export, "--lr", a.lr]),
        ):
            rows[name] = []
            for seed in seeds:
                log_dir = logs / f"{name.replace(' ', '-')}.seed{seed}"
                log_dir.mkdir(parents=True, exist_ok=True)
                rc = mpirun_train(
                    [*task, *extra, "--seed", seed, "--log-dir", log_dir], 2, log_dir, a.timeout
                )
                if rc != 0:
                    raise SystemExit(f"bench finetune: {name} failed: {failure_tail(log_dir)}")
                s = json.loads((log_dir / "summary.json").read_text())
                rows[name].append({"seed": seed, "top1": s["top1"], "wall_s": s["wall_s"]})
                print(
                    f"{name} seed {seed}: top-1 {100 * s['top1']:.2f}% in {s['wall_s']:.1f} s",
                    flush=True,
                )
    result = {
        "benchmark": "finetune",
        "device": device_name(),
        "per_class": a.per_class,
        "epochs": a.epochs,
        "seeds": seeds,
        "pretrain_s": pretrain_s,
        "load_before": load,
        "load_after": load_avg(),
        "rows": rows,
    }
    lines = [
        f"{result['device']}, 2 ranks; even/odd on 16x16 RGB digits, {10 * a.per_class} "
        f"training images, 360 held out; {a.epochs} epochs; load {load} before, "
        f"{result['load_after']} after",
        "",
        "| start | top-1 % (median) | each seed | wall s (median) |",
        "|---|---|---|---|",
    ]
    for name, runs in rows.items():
        each = " / ".join(f"{100 * r['top1']:.2f}" for r in runs)
        lines.append(
            f"| {name} | {100 * statistics.median(r['top1'] for r in runs):.2f} | {each} | "
            f"{statistics.median(r['wall_s'] for r in runs):.1f} |"
        )
    publish(a.out, "finetune", result, "\n".join(lines) + "\n")
    return 0


def add_arguments(p) -> None:
    p.add_argument(
        "--per-class",
        type=positive_int,
        default=10,
        help="training images per digit in the new task",
    )
    p.add_argument("--epochs", type=positive_int, default=30, help="fine-tuning epochs")
    p.add_argument(
        "--lr",
        default="5e-4",
        help="fine-tuning peak learning rate (from scratch keeps the default)",
    )
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds per run")
    p.add_argument("--out", help="write finetune.md, finetune.json and the runs' logs here")


COMMANDS = {
    "finetune": (
        "fine-tuning from a model this project pretrained against training from scratch",
        add_arguments,
        run,
    )
}
