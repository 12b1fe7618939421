"""python -m bench planner: the planner's predictions against real runs (docs/planner.md,
"Validation").

One `--engine auto` run, then one run of each of the --top families it ranked that fit and run, each
forced with $VIT_ENGINE_AUTO_PICK so that it trains exactly the layout the model predicted (its
micro-batch, split and stage boundaries, from that run's own measurements). For each: the predicted
and the measured step (rank 0's median after warm-up), the error, and where --engine auto's choice
ranks among the measured. PowerSGD's families are left out: auto never runs them, and their first
--powersgd-start-step steps are plain all-reduces. Set the links first (scripts/sim_cluster.sh link
RATE) and run it on the first host with its hostfile; nothing here is a test."""

import json
import os
import statistics
import tempfile
from dataclasses import fields
from pathlib import Path

from bench.common import OthersCpu, failure_tail, load_avg, median_step_s, mpirun_train, publish
from vit.core.costs import Candidate
from vit.core.errors import ConfigError
from vit.core.settings import positive_int
from vit.planner.auto import PICK, family
from vit.planner.cli import CALIBRATION, calibration
from vit.planner.predict import calibration_key, engine_key
from vit.telemetry.metrics import write_json


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=positive_int, default=5)
    p.add_argument(
        "--mpirun-args",
        default="",
        help="extra mpirun arguments, e.g. '--hostfile $SIM_DIR/hostfile -x "
        "GLOO_SOCKET_IFNAME' on the simulated hosts",
    )
    p.add_argument(
        "--condition", default="", help="the table's name for the links and load, e.g. '7.5 Mbit/s'"
    )
    p.add_argument(
        "--top",
        type=positive_int,
        default=8,
        help="families measured, in the model's order (default 8)",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=10,
        help="measured steps after the warm-up (default 10)",
    )
    p.add_argument("--warmup", type=positive_int, default=3)
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds per run")
    p.add_argument(
        "--calibration",
        help="a calibration JSON every run's planner reads ($VIT_PLANNER_CALIBRATION)",
    )
    p.add_argument(
        "--save-calibration",
        metavar="FILE",
        help="write each engine's (and compression's) fixed seconds a micro-batch, fitted to "
        "these runs, as a calibration JSON (measure where the link is fast: "
        "what the model's compute, link and bubble leave of a step; logs/planner_calibration.json "
        "is where --engine auto looks)",
    )
    p.add_argument("--out", help="write planner.md and planner.json here")
    p.add_argument(
        "train",
        nargs="*",
        help="vit.train options after --, e.g. -- --dataset synthetic "
        "--img-size 4 --simulate-slowdown 1=2",
    )


def one_run(a, log_dir: Path, pick: str | None) -> dict:
    """A real --engine auto run (forced to `pick`'s family): its record, the choice and the measured
    step."""
    log_dir.mkdir(parents=True)
    train = [
        "--engine",
        "auto",
        *a.train,
        "--steps",
        a.warmup + a.steps,
        "--log-interval",
        1,
        "--eval-interval",
        0,
        "--no-save",
        "--monitor-interval",
        0,
        "--log-dir",
        log_dir,
    ]
    env = {
        **({PICK: pick} if pick else {}),
        **({CALIBRATION: os.path.abspath(a.calibration)} if a.calibration else {}),
    }
    others = OthersCpu()
    rc = mpirun_train(train, a.ranks, log_dir, a.timeout, a.mpirun_args, env)
    if rc != 0:
        raise SystemExit(f"bench planner: run failed ({rc}); {failure_tail(log_dir)}")
    record = json.loads((log_dir / "config.json").read_text())["engine_auto"]
    return {
        "record": record,
        "measured_ms": 1e3 * median_step_s(log_dir, a.warmup),
        "others_cores": others.cores(),
    }


def result(run: dict, is_auto: bool) -> dict:
    c = run["record"]["choice"]
    candidate = Candidate(**{f.name: c[f.name] for f in fields(Candidate)})
    return {
        "family": family(c),
        "candidate": c["candidate"],
        "predicted_ms": c["step_ms"],
        "measured_ms": run["measured_ms"],
        "error": c["step_ms"] / run["measured_ms"] - 1,
        "bottleneck": c["bottleneck"],
        "others_cores": run["others_cores"],
        "auto": is_auto,
        "engine_key": engine_key(candidate),
        "calibration_key": calibration_key(candidate),
        "fixed_ms": c["fixed_ms"],
        "grad_accum": c["grad_accum"],
        "stages": c["stages"],
        "slots": c["slots"],
    }


def fit(runs: list[tuple[list[dict], dict]]) -> dict[str, float]:
    """Each engine's fixed seconds a micro-batch, with each compression apart (its casts cost CPU
    time): the median over the rows of every run, each run with the calibration `used` (asdict) in
    its predictions. A data-parallel engine's sits in the step's fixed part (step_s + micro-batches
    x it): what the measured step leaves once compute, link and step_s are taken off, over the
    micro-batches. A pipeline's sits in each stage's slot: the value used plus what the measured
    step leaves over the predicted, over the slots it is paid in (predict.busy_slots; where compute
    sets the step: measure where the link is fast). An engine measured only with a compression gets
    its own key from those rows, so that its uncompressed candidates do not fall back to the
    default."""
    left, engines = {}, {}
    for rows, used in runs:
        for r in rows:
            key, per_engine = r["calibration_key"], used["engine_micro_s"]
            if r["stages"] > 1:
                before = per_engine.get(key, per_engine.get(r["engine_key"], used["micro_s"]))
                seconds = before + (r["measured_ms"] - r["predicted_ms"]) / 1e3 / r["slots"]
            else:
                seconds = (
                    (r["measured_ms"] - r["predicted_ms"] + r["fixed_ms"]) / 1e3 - used["step_s"]
                ) / r["grad_accum"]
            left.setdefault(key, []).append(seconds)
            engines.setdefault(r["engine_key"], []).append(seconds)
    fitted = {k: round(max(0.0, statistics.median(v)), 5) for k, v in left.items()}
    # measured compressed only: the engine's own from those, not the default
    for engine, v in engines.items():
        fitted.setdefault(engine, round(max(0.0, statistics.median(v)), 5))
    return fitted


def writable(path: str, prog: str) -> None:
    """Refuse, before tens of minutes of runs, a calibration file that cannot be written."""
    try:
        if os.path.isdir(path):
            raise IsADirectoryError("a folder")
        tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(path))).close()
    except OSError as e:
        raise SystemExit(f"{prog}{path}: cannot write a file there ({e.strerror or e})") from None


def planner(a) -> int:
    """The runs take tens of minutes: the files named are checked before the first."""
    try:
        calibration(a.calibration)
    except ConfigError as e:
        raise SystemExit(f"bench planner: {e}") from None
    if a.save_calibration:
        writable(a.save_calibration, "bench planner: --save-calibration ")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(a.out or tmp) / "logs"
        first = one_run(a, logs / "auto", None)
        chosen, families = family(first["record"]["choice"]), []
        for c in first["record"]["candidates"]:
            if (
                c["fits"]
                and c["runs"]
                and c["compression"] != "powersgd"
                and family(c) not in families
            ):
                families.append(family(c))
        for i, fam in enumerate(families[: a.top]):
            rows.append(
                result(first if fam == chosen else one_run(a, logs / f"{i}", fam), fam == chosen)
            )
            print(
                f"{rows[-1]['candidate']}: predicted {rows[-1]['predicted_ms']:.1f} ms, measured "
                f"{rows[-1]['measured_ms']:.1f} ms",
                flush=True,
            )
    if chosen not in families[: a.top]:
        rows.append(result(first, True))
    by_measured = sorted(rows, key=lambda r: r["measured_ms"])
    auto_row = next(r for r in rows if r["auto"])
    links = (
        ", ".join(f"{h} {v:.1f}" for h, v in first["record"]["links_mbit"].items()) or "one host"
    )
    lines = [
        f"{a.condition or 'condition'}: {a.ranks} ranks, vit.train {' '.join(a.train)}; "
        f"links measured (Mbit/s): {links}; planned in "
        f"{first['record']['planning_s']:.1f} s; load {load_avg()}",
        "",
        "| # predicted | candidate | predicted ms | measured ms | error | # measured | "
        "bottleneck | auto |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for i, r in enumerate(rows, 1):
        lines.append(
            f"| {i} | {r['candidate']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | "
            f"{100 * r['error']:+.0f}% | {by_measured.index(r) + 1} | {r['bottleneck']} | "
            f"{'chosen' if r['auto'] else ''} |"
        )
    errors = sorted(abs(r["error"]) for r in rows)
    lines += [
        "",
        f"median |error| {100 * errors[len(errors) // 2]:.0f}%, largest "
        f"{100 * errors[-1]:.0f}%; auto's choice measured #{by_measured.index(auto_row) + 1} "
        f"of {len(rows)}, {by_measured[0]['measured_ms'] / auto_row['measured_ms']:.2f} of "
        "the best measured images/s",
    ]
    if a.save_calibration:
        fitted = fit([(rows, first["record"]["calibration"])])
        write_json(a.save_calibration, {"engine_micro_s": fitted})
        lines += [
            "",
            f"fixed seconds a micro-batch per engine, fitted to these runs "
            f"({a.save_calibration}): {fitted}",
        ]
    publish(
        a.out,
        "planner",
        {
            "args": {k: v for k, v in vars(a).items() if k != "func"},
            "rows": rows,
            "record": first["record"],
        },
        "\n".join(lines) + "\n",
    )
    return 0


def add_calibrate_arguments(p) -> None:
    p.add_argument(
        "save",
        metavar="FILE",
        help="the calibration JSON to write (logs/planner_calibration.json "
        "is where --engine auto looks)",
    )
    p.add_argument(
        "results",
        nargs="+",
        metavar="PLANNER_JSON",
        help="planner.json of bench planner runs (--out), measured where the link is fast: "
        "where it sets the step, its error lands in the fixed costs",
    )


def calibrate(a) -> int:
    """A calibration fitted to several bench planner runs: one run's residuals carry its layer
    timings' noise."""
    writable(a.save, "bench calibrate: ")
    runs = []
    for path in a.results:
        try:
            result = json.loads(Path(path).read_text())
            runs.append((result["rows"], result["record"]["calibration"]))
            fit(runs[-1:])  # every field the fit reads is there
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
            raise SystemExit(
                f"bench calibrate: {path}: not a bench planner result ({type(e).__name__}: {e})"
            ) from None
    fitted = fit(runs)
    write_json(a.save, {"engine_micro_s": fitted})
    print(f"fixed seconds a micro-batch, the median over {len(runs)} runs ({a.save}): {fitted}")
    return 0


COMMANDS = {
    "planner": (
        "the planner's predicted step times against real runs, and --engine auto's rank",
        add_arguments,
        planner,
    ),
    "calibrate": (
        "fit the planner's calibration to several bench planner runs' results",
        add_calibrate_arguments,
        calibrate,
    ),
}
