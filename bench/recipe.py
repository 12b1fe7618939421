"""python -m bench recipe: the default job (digits, 2 ranks) with each recipe option on and off,
median of seeds.

Each variant is the default job plus its options (timm train.py's names), run once per seed under
mpirun; the table gives the median held-out top-1 (and the EMA's where it is on) and the median wall
time from summary.json, with the load average, so that a variant's time can be judged on a shared
machine."""

import json
import shlex
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import (
    OthersCpu,
    device_name,
    failure_tail,
    load_avg,
    mpirun_train,
    publish,
    seed_list,
)
from vit.core.settings import positive_int

# name -> extra vit.train options. 'baseline' is the default job as it ships.
VARIANTS = {
    "baseline": "",
    "no-aug": "--no-aug",
    "smoothing": "--smoothing 0.1",
    "mixup": "--mixup 0.2",
    "cutmix": "--cutmix 0.5",
    "drop-path": "--drop-path 0.1",
    "model-ema": "--model-ema --model-ema-decay 0.99",
    "layer-decay": "--layer-decay 0.8",
    "rrc": "--scale 0.8 1.0",
    "reprob": "--reprob 0.1",
    "aa": "--aa rand-m5-mstd0.5",
    "hflip": "--hflip 0.5",
    "color-jitter": "--color-jitter 0.2",
}
# Gradient compression (docs/ethernet.md), only when named: they need --base "--engine ddp".
COMPRESSION = {
    "fp16-hook": "--comm-hook fp16",
    "bf16-hook": "--comm-hook bf16",
    "powersgd": "--comm-hook powersgd",
}


def run_variant(name: str, options: str, seeds: list[int], a, logs: Path) -> dict:
    rows = []
    for seed in seeds:
        log_dir = logs / f"{name}.seed{seed}"
        log_dir.mkdir(parents=True, exist_ok=True)
        others, load, t0 = OthersCpu(), load_avg(), time.perf_counter()
        train = [
            *shlex.split(a.base),
            *shlex.split(options),
            "--seed",
            seed,
            "--no-save",
            "--log-dir",
            log_dir,
        ]
        rc = mpirun_train(train, a.ranks, log_dir, a.timeout)
        if rc != 0:
            return {
                "variant": name,
                "options": options,
                "error": f"exit {rc}: {failure_tail(log_dir)}",
            }
        s = json.loads((log_dir / "summary.json").read_text())
        rows.append(
            {
                "seed": seed,
                "top1": s["top1"],
                "top5": s.get("top5"),  # none with five classes or fewer
                "ema_top1": s.get("ema_top1"),
                "wall_s": s["wall_s"],
                "outside_s": time.perf_counter() - t0,
                "load_before": load,
                "others_cores": others.cores(),
            }
        )
        print(
            f"{name} seed {seed}: top-1 {100 * s['top1']:.2f}% in "
            f"{s['wall_s']:.1f} s (load {load})",
            flush=True,
        )

    def median(key):
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if values else None

    return {
        "variant": name,
        "options": options,
        "runs": rows,
        "top1": median("top1"),
        "ema_top1": median("ema_top1"),
        "wall_s": median("wall_s"),
        "load": median("load_before"),
        "others_cores": median("others_cores"),
        "all_top1": [r["top1"] for r in rows],
    }


def table(result: dict) -> str:
    lines = [
        f"{result['device']}, {result['ranks']} ranks, seeds {result['seeds']}, base: "
        f"`{result['base'] or '(the default job)'}`",
        "",
        "| variant | options | top-1 % (median) | each seed | EMA top-1 % | wall s (median) | "
        "load | others' cores |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | `{r['options']}` | failed | | | | | |")
            continue
        ema = f"{100 * r['ema_top1']:.2f}" if r["ema_top1"] is not None else "–"
        each = " / ".join(f"{100 * t:.2f}" for t in r["all_top1"])
        lines.append(
            f"| {r['variant']} | `{r['options'] or '-'}` | {100 * r['top1']:.2f} | {each} | {ema} "
            f"| {r['wall_s']:.1f} | {r['load']:.1f} | {r['others_cores']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def run(a) -> int:
    variants = {**VARIANTS, **COMPRESSION}
    names = [v for v in a.variants.split(",") if v] if a.variants else list(VARIANTS)
    unknown = [v for v in names if v not in variants]
    if unknown:
        raise SystemExit(
            f"bench recipe: unknown variant(s) {', '.join(unknown)}; choose from "
            f"{', '.join(variants)}"
        )
    seeds = a.seeds
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(a.out) / "logs" if a.out else Path(tmp)
        rows = [run_variant(name, variants[name], seeds, a, logs) for name in names]
    result = {
        "benchmark": "recipe",
        "device": device_name(),
        "ranks": a.ranks,
        "seeds": seeds,
        "base": a.base,
        "rows": rows,
    }
    publish(a.out, "recipe", result, table(result))
    return 1 if any("error" in r for r in rows) else 0


def add_arguments(p) -> None:
    p.add_argument(
        "--variants",
        help="comma-separated, of: " + ", ".join(VARIANTS) + " (default: these), and with --base "
        "'--engine ddp': " + ", ".join(COMPRESSION),
    )
    p.add_argument(
        "--seeds",
        type=seed_list,
        default=[0, 1, 2],
        help="comma-separated seeds; the table shows medians",
    )
    p.add_argument("--ranks", type=positive_int, default=2, help="mpirun -np")
    p.add_argument(
        "--base",
        default="",
        help="vit.train options every variant starts from (default: none, the default job)",
    )
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds per run")
    p.add_argument("--out", help="write recipe.md, recipe.json and the runs' logs here")


COMMANDS = {
    "recipe": (
        "the default job with each recipe option on and off (top-1 and wall time, median of seeds)",
        add_arguments,
        run,
    )
}
