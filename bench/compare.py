"""python -m bench compare: two configurations over paired seeds, the mean difference of held-out
top-1 and loss with its standard error.

Each configuration is --base plus its own options (--a, --b), run once per seed under mpirun; seed s
of A and seed s of B start from the same weights and see the same batches, so their difference
cancels what the seed alone does. The table gives each seed's pair, the mean of B - A with its
standard error (the standard deviation of the differences over sqrt(seeds)) and a 95% interval
(Student's t), and each configuration's mean and standard deviation. With --out, a run whose folder
already holds a summary.json of the same command is read instead of run again, so a comparison can
be extended by seeds, or B changed with A kept (the runs' folders are named by a hash of their
options)."""

import hashlib
import json
import math
import shlex
import statistics
import tempfile
from pathlib import Path

from bench.common import device_name, failure_tail, load_avg, mpirun_train, publish, seed_list
from vit.core.settings import positive_int

# The glyphs task's recipe (docs/benchmarks.md#the-glyphs-task): vit_glyphs, 10 epochs at LR 1e-3.
GLYPHS = "--dataset glyphs --model vit_glyphs --epochs 10 --lr 1e-3"
# Student's t at 97.5% by degrees of freedom (seeds - 1), for the 95% interval
T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def run_one(tag: str, options: list[str], seed: int, a, logs: Path) -> dict:
    """summary.json of OPTIONS at SEED, in a folder named by their hash: read when it holds one from
    the same command (another comparison in the same --out may have run it), else run."""
    digest = hashlib.sha256(shlex.join(options).encode()).hexdigest()[:10]
    log_dir = logs / f"{digest}.seed{seed}"
    command = [*options, "--seed", str(seed), "--no-save", "--log-dir", str(log_dir)]
    summary, stamp = log_dir / "summary.json", log_dir / "command.json"
    if summary.exists() and stamp.exists() and json.loads(stamp.read_text()) == [a.ranks, *command]:
        print(f"{tag} seed {seed}: read from {log_dir}", flush=True)
        return json.loads(summary.read_text())
    log_dir.mkdir(parents=True, exist_ok=True)
    summary.unlink(missing_ok=True)
    load = load_avg()
    rc = mpirun_train(command, a.ranks, log_dir, a.timeout)
    if rc != 0:
        raise SystemExit(
            f"bench compare: {tag} seed {seed} failed (exit {rc}): {failure_tail(log_dir)}"
        )
    stamp.write_text(json.dumps([a.ranks, *command]))
    s = json.loads(summary.read_text())
    print(
        f"{tag} seed {seed}: top-1 {100 * s['top1']:.2f}%, loss {s['eval_loss']:.4f} in "
        f"{s['wall_s']:.1f} s (load {load})",
        flush=True,
    )
    return s


def paired(a_values: list[float], b_values: list[float]) -> dict:
    """Mean of b - a, its standard error and 95% interval half-width; None for one seed."""
    diffs = [b - a for a, b in zip(a_values, b_values)]
    n = len(diffs)
    se = statistics.stdev(diffs) / math.sqrt(n) if n > 1 else None
    half = se * T975.get(n - 1, 1.96) if se is not None else None
    return {"mean": statistics.mean(diffs), "se": se, "ci95": half, "diffs": diffs}


def spread(values: list[float]) -> dict:
    return {
        "mean": statistics.mean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else None,
    }


def table(r: dict) -> str:
    def pm(x, scale, digits):
        return "-" if x is None else f"{scale * x:.{digits}f}"

    lines = [
        f"{r['device']}, {r['ranks']} ranks, seeds {r['seeds']}, base `{r['base']}`",
        f"A: `{r['a'] or '(base)'}`; B: `{r['b'] or '(base)'}`",
        "",
        "| seed | A top-1 % | B top-1 % | B - A points | A loss | B loss | B - A loss | "
        "A wall s | B wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["runs"]:
        lines.append(
            f"| {row['seed']} | {100 * row['a_top1']:.2f} | {100 * row['b_top1']:.2f} | "
            f"{100 * (row['b_top1'] - row['a_top1']):+.2f} | {row['a_loss']:.4f} | "
            f"{row['b_loss']:.4f} | {row['b_loss'] - row['a_loss']:+.4f} | {row['a_wall_s']:.0f} | "
            f"{row['b_wall_s']:.0f} |"
        )
    t, loss, ta, tb = r["top1"], r["loss"], r["a_top1"], r["b_top1"]
    lines += [
        "",
        f"top-1, B - A: {100 * t['mean']:+.2f} +- {pm(t['se'], 100, 2)} points (standard error; "
        f"95% interval +- {pm(t['ci95'], 100, 2)}); A {100 * ta['mean']:.2f}% (sd "
        f"{pm(ta['sd'], 100, 2)}), B {100 * tb['mean']:.2f}% (sd {pm(tb['sd'], 100, 2)})",
        f"held-out loss, B - A: {loss['mean']:+.4f} +- {pm(loss['se'], 1, 4)} (95% interval +- "
        f"{pm(loss['ci95'], 1, 4)})",
    ]
    return "\n".join(lines) + "\n"


def run(a) -> int:
    if len(a.seeds) < 2:
        raise SystemExit("bench compare: --seeds needs at least two seeds for a standard error")
    base = shlex.split(a.base)
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(a.out) / "logs" if a.out else Path(tmp)
        rows = []
        for seed in a.seeds:
            sa = run_one("a", [*base, *shlex.split(a.a)], seed, a, logs)
            sb = run_one("b", [*base, *shlex.split(a.b)], seed, a, logs)
            rows.append(
                {
                    "seed": seed,
                    **{f"{k}_top1": s["top1"] for k, s in (("a", sa), ("b", sb))},
                    **{f"{k}_loss": s["eval_loss"] for k, s in (("a", sa), ("b", sb))},
                    **{f"{k}_wall_s": s["wall_s"] for k, s in (("a", sa), ("b", sb))},
                }
            )
    result = {
        "benchmark": "compare",
        "device": device_name(),
        "ranks": a.ranks,
        "seeds": a.seeds,
        "base": a.base,
        "a": a.a,
        "b": a.b,
        "runs": rows,
        "top1": paired([r["a_top1"] for r in rows], [r["b_top1"] for r in rows]),
        "loss": paired([r["a_loss"] for r in rows], [r["b_loss"] for r in rows]),
        "a_top1": spread([r["a_top1"] for r in rows]),
        "b_top1": spread([r["b_top1"] for r in rows]),
    }
    publish(a.out, "compare", result, table(result))
    return 0


def add_arguments(p) -> None:
    p.add_argument(
        "--a", default="--engine ddp", help="options of configuration A (default: %(default)s)"
    )
    p.add_argument("--b", required=True, help="options of configuration B, e.g. '--engine diloco'")
    p.add_argument(
        "--base",
        default=GLYPHS,
        help="vit.train options both start from (default: the glyphs task's recipe, %(default)s)",
    )
    p.add_argument(
        "--seeds",
        type=seed_list,
        default=[0, 1, 2, 3, 4],
        help="comma-separated seeds, at least two",
    )
    p.add_argument("--ranks", type=positive_int, default=2, help="mpirun -np")
    p.add_argument("--timeout", type=positive_int, default=1200, help="seconds per run")
    p.add_argument(
        "--out", help="write compare.md, compare.json and the runs' logs here (and reuse them)"
    )


COMMANDS = {
    "compare": (
        "two configurations over paired seeds: the mean difference of top-1 and held-out "
        "loss with its standard error",
        add_arguments,
        run,
    )
}
