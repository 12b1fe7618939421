"""python -m bench async-pipeline: --engine async-pipeline against DeepSpeed's pipeline
(PipeDream-Flush) at the same stages and micro-batches, both against the no-bubble ideal, and the
held-out top-1 on digits after the default epochs of the synchronous pipeline, the asynchronous one
without weight prediction and with msnag.

Each engine's no-bubble ideal comes from its own run: the global batch over the step time its
slowest stage would take if it never waited for a neighbour nor sent (the breakdown's phases less
pipe_send_s and pipe_recv_s, median over the logging windows after the first). Measured in the same
run, it holds under the load of a shared machine. The whole network on one rank (same micro-batch,
accumulation and threads per rank) times --stages is printed beside it, as a second ideal that
assumes stages of equal work and a machine to itself.

--wire-dtypes fp32,bf16 makes one async-pipeline speed run per --pipe-wire-dtype, each with the
bytes rank 0 sent per step (its wire_bytes), and the narrower wires' images/s over the fp32 wire's.
"""

import argparse
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
    median_step_s,
    mpirun_train,
    publish,
    seed_list,
)
from vit.core.paths import ROOT
from vit.core.settings import positive_int
from vit.telemetry.jsonl import read_jsonl

# all but pipe_*_s
COMPUTE = ("data_s", "forward_s", "backward_s", "allreduce_s", "optimizer_s", "other_s")
PIPELINE_JSON = ROOT / "deepspeed_configs" / "pipeline.json"
ACCURACY = {  # name -> engine options of the accuracy runs
    "pipeline (sync, DeepSpeed)": "--engine pipeline",
    "async, no prediction": "--engine async-pipeline --weight-prediction none",
    "async, msnag": "--engine async-pipeline --weight-prediction msnag",
}


def add_arguments(p) -> None:
    p.add_argument("--stages", type=positive_int, default=2)
    p.add_argument("--grad-accum", type=positive_int, default=4, help="micro-batches per step (m)")
    p.add_argument("--steps", type=positive_int, default=80, help="steps of each speed run")
    p.add_argument(
        "--warmup", type=positive_int, default=10, help="steps left out of the speed median"
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="rounds of speed runs, the engines taking turns within each (the median is kept: "
        "the load of a shared machine drifts)",
    )
    p.add_argument(
        "--no-accuracy", action="store_true", help="skip the default-epochs accuracy runs"
    )
    p.add_argument(
        "--seeds",
        type=seed_list,
        default=[0],
        help="comma-separated seeds of the accuracy runs (the table shows the median and each)",
    )
    p.add_argument("--extra", default="", help="more vit.train options for every run")
    p.add_argument(
        "--mpirun-args",
        default="",
        help="more mpirun options for the pipelines' runs, e.g. '--hostfile H -x IFACE' across "
        "hosts (the simulated hosts of scripts/sim_cluster.sh, from cn0); "
        "the one-rank run stays on this host",
    )
    p.add_argument(
        "--wire-dtypes",
        type=wire_list,
        default=[],
        help="comma-separated --pipe-wire-dtype values: one async-pipeline speed run for each "
        "(e.g. fp32,bf16; default one run, the training precision's)",
    )
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--out", help="write async_pipeline.md and async_pipeline.json into this folder")


def wire_list(text: str) -> list[str]:
    """argparse type: --wire-dtypes."""
    wires = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in wires if w not in ("fp32", "bf16", "fp16")]
    if bad:
        raise argparse.ArgumentTypeError(f"not a wire dtype (fp32, bf16, fp16): {', '.join(bad)}")
    return wires


def speed(name: str, train: list, ranks: int, a, log_dir: Path, mpirun_args: str = "") -> dict:
    """One speed run: images/s from rank 0's median step time after the warm-up window."""
    log_dir.mkdir(parents=True)
    others, load = OthersCpu(), load_avg()
    rc = mpirun_train(
        [
            *train,
            "--steps",
            a.steps,
            "--log-interval",
            a.warmup,
            "--no-save",
            "--eval-interval",
            0,
            "--log-dir",
            log_dir,
            *shlex.split(a.extra),
        ],
        ranks,
        log_dir,
        a.timeout,
        mpirun_args,
    )
    if rc != 0:
        return {"run": name, "error": f"exit {rc}: {failure_tail(log_dir)}"}
    cfg = json.loads((log_dir / "config.json").read_text())
    step_s = median_step_s(log_dir, a.warmup)
    row = {
        "run": name,
        "images_per_s": cfg["global_batch"] / step_s,
        "step_s": step_s,
        "load_before": load,
        "others_cores": others.cores(),
        "ideal_images_per_s": cfg["global_batch"]
        / max(compute_s(log_dir, r, a.warmup) for r in range(ranks)),
        "wire_bytes": wire_bytes(log_dir, a.warmup),
    }
    print(
        f"{name}: {row['images_per_s']:.0f} images/s (load {load}, others' cores "
        f"{row['others_cores']})",
        flush=True,
    )
    return row


def compute_s(log_dir: Path, rank: int, warmup: int) -> float:
    """A rank's median step time without its waits for and sends to its neighbours."""
    records = [r for r in read_jsonl(log_dir / f"metrics_rank{rank}.jsonl") if r["kind"] == "train"]
    return statistics.median(
        sum(r.get(k, 0.0) for k in COMPUTE) for r in records if r["step"] > warmup
    )


def wire_bytes(log_dir: Path, warmup: int) -> float | None:
    """The bytes rank 0 sent its neighbour per step (the async pipeline's wire_bytes), median after
    the warm-up."""
    sent = [
        r["wire_bytes"]
        for r in read_jsonl(log_dir / "metrics_rank0.jsonl")
        if r["kind"] == "train" and r["step"] > warmup and "wire_bytes" in r
    ]
    return statistics.median(sent) if sent else None


def median_row(rows: list[dict]) -> dict:
    """The run's median images/s, with every round's and the median load and others' cores."""
    failed = [r for r in rows if "error" in r]
    if failed:
        return failed[0]
    return {
        "run": rows[0]["run"],
        "images_per_s": statistics.median(r["images_per_s"] for r in rows),
        "each": [round(r["images_per_s"]) for r in rows],
        "ideal_images_per_s": statistics.median(r["ideal_images_per_s"] for r in rows),
        "wire_bytes": rows[0]["wire_bytes"],
        "load_before": round(statistics.median(r["load_before"] for r in rows), 2),
        "others_cores": round(statistics.median(r["others_cores"] for r in rows), 2),
    }


def accuracy(name: str, options: str, a, logs: Path) -> dict:
    """Held-out top-1 after the default epochs, for each of --seeds: the median, and each seed's."""
    runs = []
    for seed in a.seeds:
        log_dir = logs / f"accuracy.{name.split()[0].strip(',')}.{len(list(logs.iterdir()))}"
        log_dir.mkdir(parents=True)
        rc = mpirun_train(
            [
                *shlex.split(options),
                "--pipeline-stages",
                a.stages,
                "--grad-accum",
                a.grad_accum,
                "--seed",
                seed,
                "--no-save",
                "--log-dir",
                log_dir,
                *shlex.split(a.extra),
            ],
            a.stages,
            log_dir,
            a.timeout,
        )
        if rc != 0:
            return {"run": name, "error": f"exit {rc}: {failure_tail(log_dir)}"}
        runs.append(json.loads((log_dir / "summary.json").read_text()))
        print(
            f"{name}, seed {seed}: top-1 {100 * runs[-1]['top1']:.2f}% "
            f"after {runs[-1]['steps']} steps",
            flush=True,
        )
    return {
        "run": name,
        "options": options,
        "top1": statistics.median(r["top1"] for r in runs),
        "each": [r["top1"] for r in runs],
        "steps": runs[0]["steps"],
        "wall_s": statistics.median(r["wall_s"] for r in runs),
    }


def run(a) -> int:
    common = [
        "--pipeline-stages",
        a.stages,
        "--grad-accum",
        a.grad_accum,
        "--ds-config",
        PIPELINE_JSON,
    ]
    hosts = a.mpirun_args
    t0 = time.perf_counter()
    runs = {  # name -> (vit.train options, ranks, mpirun options)
        "one stage, one rank": (
            [
                "--engine",
                "async-pipeline",
                "--pipeline-stages",
                1,
                "--grad-accum",
                a.grad_accum,
                # a pipeline rank's
                "--ds-config",
                PIPELINE_JSON,
            ],
            1,
            "-x OMP_NUM_THREADS=1",
        ),
        "pipeline (DeepSpeed)": (["--engine", "pipeline", *common], a.stages, hosts),
        **{
            f"async-pipeline{f', {w} wire' if w else ''}": (
                ["--engine", "async-pipeline", *common, *(["--pipe-wire-dtype", w] if w else [])],
                a.stages,
                hosts,
            )
            for w in a.wire_dtypes or [None]
        },
    }
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        logs = Path(tmp)
        rounds = [
            [
                speed(name, train, ranks, a, logs / f"{name}.{i}", mpirun)
                for name, (train, ranks, mpirun) in runs.items()
            ]
            for i in range(a.repeats)
        ]
        one, *rows = [median_row(list(same)) for same in zip(*rounds)]
        accuracies = [] if a.no_accuracy else [accuracy(n, o, a, logs) for n, o in ACCURACY.items()]
    ideal = one["images_per_s"] * a.stages if "images_per_s" in one else None
    result = {
        "device": device_name(),
        "stages": a.stages,
        "grad_accum": a.grad_accum,
        "ranks": a.stages,
        "ideal_images_per_s": ideal,
        "one_stage": one,
        "speed": rows,
        "accuracy": accuracies,
        "seeds": a.seeds,
        "wall_s": time.perf_counter() - t0,
    }
    publish(a.out, "async_pipeline", result, table(result))
    return 0 if all("error" not in r for r in [one, *rows, *accuracies]) else 1


def table(r: dict) -> str:
    lines = [
        f"{r['device']}, {r['ranks']} ranks, {r['stages']} stages, {r['grad_accum']} "
        f"micro-batches a step",
        "",
        "| run | images/s, median (each round) | x DeepSpeed's pipeline | its no-bubble ideal | "
        f"of it | of {r['stages']} x one rank | MB sent per step, rank 0 | load before | "
        "others' cores |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ds = next((x.get("images_per_s") for x in r["speed"] if x["run"].startswith("pipeline")), None)
    one = {
        **r["one_stage"],
        "run": f"{r['stages']} x one stage on one rank",
        "images_per_s": r["ideal_images_per_s"],
    }
    for row in [*r["speed"], one]:
        if "error" in row:
            lines.append(f"| {row['run']} | failed: {row['error'].splitlines()[0]} | | | | | | | |")
            continue
        ips, own = row["images_per_s"], row.get("ideal_images_per_s") if row is not one else None
        ratio = f"{ips / ds:.2f}" if ds and ips else ""
        of_one = f"{ips / r['ideal_images_per_s']:.2f}" if ips and r["ideal_images_per_s"] else ""
        each = (
            f" ({', '.join(map(str, row['each']))})" if row.get("each") and row is not one else ""
        )
        lines.append(
            f"| {row['run']} | {ips:.0f}{each} | {ratio} | {f'{own:.0f}' if own else ''} | "
            f"{f'{ips / own:.2f}' if own else ''} | {of_one} | {mb(row.get('wire_bytes'))} | "
            f"{row.get('load_before', '')} | {row.get('others_cores', '')} |"
        )
    base = next(
        (x.get("images_per_s") for x in r["speed"] if x["run"].endswith(", fp32 wire")), None
    )
    lines += [
        f"\n{x['run']}: {x['images_per_s'] / base:.2f}x the fp32 wire's images/s"
        for x in r["speed"]
        if base and x.get("images_per_s") and x["run"].endswith(" wire") and "fp32" not in x["run"]
    ]
    if r["accuracy"]:
        lines += [
            "",
            "| run (default epochs) | held-out top-1 %, median (seeds "
            f"{', '.join(map(str, r['seeds']))}) | steps | wall s, median |",
            "|---|---|---|---|",
        ]
        for row in r["accuracy"]:
            if "error" in row:
                lines.append(f"| {row['run']} | failed: {row['error'].splitlines()[0]} | | |")
            else:
                each = ", ".join(f"{100 * t:.2f}" for t in row["each"])
                lines.append(
                    f"| {row['run']} | {100 * row['top1']:.2f} ({each}) "
                    f"| {row['steps']} | {row['wall_s']:.0f} |"
                )
    return "\n".join(lines) + "\n"


def mb(sent: float | None) -> str:
    return f"{sent / 1e6:.3g}" if sent else ""


COMMANDS = {
    "async-pipeline": (
        "async-pipeline against DeepSpeed's pipeline and the no-bubble ideal (images/s), and the "
        "default job's top-1 with and without weight prediction",
        add_arguments,
        run,
    )
}
