"""Benchmarks for mixed GPUs (docs/benchmarks.md):

    python -m bench mixed [--slowdown 1=2]  # pipeline partitions and data-parallel batch splits,
                                            # with some ranks slowed by --simulate-slowdown
    python -m bench lossscale               # fp16 overflow-skipped steps: DeepSpeed's default loss
                                            # scale against --loss-scale auto, emulated from fp32

Numbers are printed and written to --out; nothing here is a test.
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.common import failure_tail, median_step_s, mpirun_train, publish
from vit.core.errors import ConfigError
from vit.core.settings import positive_int
from vit.engines.registry import spec
from vit.planner.cli import CALIBRATION, calibration
from vit.run.cli import defaults
from vit.runtime import slowdown

MIXED_RUNS = [  # (row name, vit.train options)
    ("pipeline, --partition uniform", ["--engine", "pipeline", "--partition", "uniform"]),
    ("pipeline, --partition parameters", ["--engine", "pipeline", "--partition", "parameters"]),
    ("pipeline, --partition balanced", ["--engine", "pipeline", "--partition", "balanced"]),
    ("zero2, --batch-split equal", ["--engine", "zero", "--batch-split", "equal"]),
    ("zero2, --batch-split proportional", ["--engine", "zero", "--batch-split", "proportional"]),
]


def run_train(
    opts: list, ranks: int, log_dir: Path, timeout: float, warmup: int, env: dict | None = None
) -> dict:
    """One real `mpirun -np ranks ./entry_cn.sh` run: its median step time after warm-up, and
    cluster.json."""
    log_dir.mkdir(parents=True, exist_ok=True)
    rc = mpirun_train([*opts, "--log-dir", log_dir], ranks, log_dir, timeout, env=env)
    if rc != 0:
        sys.exit(f"bench mixed: run failed ({rc}); {failure_tail(log_dir)}")
    cluster = json.loads((log_dir / "cluster.json").read_text())
    return {"step_time_s": median_step_s(log_dir, warmup), "cluster": cluster}


def ideal_ratio(speeds: list[float]) -> float:
    """Throughput of perfectly balanced work over that of an equal share per rank."""
    return sum(speeds) / (len(speeds) * min(speeds))


def mixed(a) -> int:
    if a.global_batch % (4 * a.ranks):
        sys.exit(f"bench mixed: --global-batch {a.global_batch} must be a multiple of 4 x --ranks")
    try:  # the balanced run would find a bad file only after the others have run
        calibration(a.calibration)
    except ConfigError as e:
        sys.exit(f"bench mixed: {e}")
    common = [
        "--model",
        a.model,
        "--dataset",
        "synthetic",
        "--steps",
        a.warmup + a.steps,
        "--log-interval",
        a.warmup,
        "--no-save",
        "--monitor-interval",
        0,
        "--simulate-slowdown",
        a.slowdown,
        "--micro-batch-size",
        a.global_batch // a.ranks,
        "--grad-accum",
        1,
    ]
    chosen = [
        (name, opts) for name, opts in MIXED_RUNS if a.runs == "all" or name.startswith(a.runs)
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(a.out or tmp) / "logs"
        for rep in range(a.repeat):
            for name, opts in chosen:
                # a pipeline takes the whole global batch, in 4 micro-batches
                if spec(opts[opts.index("--engine") + 1]).pipeline:
                    extra = [
                        "--pipeline-stages",
                        a.ranks,
                        "--micro-batch-size",
                        a.global_batch // 4,
                        "--grad-accum",
                        4,
                    ]
                else:
                    extra = []
                run = run_train(
                    [*common, *opts, *extra],
                    a.ranks,
                    logs / f"{name.split(',')[0]}-{opts[-1]}.{rep}",
                    a.timeout,
                    a.warmup,
                    {CALIBRATION: os.path.abspath(a.calibration)} if a.calibration else None,
                )
                rows.append(
                    {"name": name, "images_per_s": a.global_batch / run["step_time_s"], **run}
                )
                print(f"{name}: {rows[-1]['images_per_s']:.1f} images/s", flush=True)
    best = {
        name: max((r for r in rows if r["name"] == name), key=lambda r: r["images_per_s"])
        for name, _ in chosen
    }
    publish(a.out, "mixed", {"args": vars(a), "rows": rows}, mixed_table(a, chosen, best))
    return 0


def mixed_table(a, chosen: list, best: dict) -> str:
    lines = [
        f"{a.model}, synthetic data, global batch {a.global_batch}, {a.ranks} ranks, "
        f"--simulate-slowdown {a.slowdown}; images/s from the median step time of {a.steps} steps "
        f"after {a.warmup} warm-up, best of {a.repeat}. ideal: the speed-up of perfectly balanced "
        "work over an equal share, sum of the ranks' speeds / (ranks x the slowest), with speed = "
        "1 / slowdown; census: the same from the block times that run's census measured; "
        "predicted: the step the balanced run's cost model predicted for that split "
        "(vit.planner.balance), and its error against the measured step",
        "",
        "| run | images/s | vs equal share | ideal | census | ms/step | predicted | error | plan |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    factors = slowdown.factors(a.slowdown, a.ranks)
    ideal = ideal_ratio([1 / factors.get(r, 1.0) for r in range(a.ranks)])
    model = best.get("pipeline, --partition balanced", {}).get("cluster", {}).get("stages", {})
    for name, _ in chosen:  # each engine's first row (uniform, equal) is its equal share
        r, base = (
            best[name],
            best[next(n for n, _ in chosen if n.split(",")[0] == name.split(",")[0])],
        )
        c, partition = (
            r["cluster"],
            name.split("--partition ")[-1] if "--partition" in name else None,
        )
        plan = (
            f"layers {c['stages']['parts']}"
            + (f" ({c['stages']['why']})" if "why" in c["stages"] else "")
            if "stages" in c
            else f"micro-batches {c['batch_split']}"
            if "batch_split" in c
            else ""
        )
        census = ideal_ratio([1 / rank["block_ms"] for rank in c["census"]])
        predicted = model.get("predicted_step_s", {}).get(partition)
        if partition == "balanced" and model:
            predicted = model["predicted_step_s"][model["chosen"]]
        guess = (
            f"{1e3 * predicted:.1f} | {predicted / r['step_time_s'] - 1:+.0%}"
            if predicted
            else "| "
        )
        lines.append(
            f"| {name} | {r['images_per_s']:.1f} | {r['images_per_s'] / base['images_per_s']:.2f} "
            f"| {ideal:.2f} | {census:.2f} | {1e3 * r['step_time_s']:.1f} | {guess} | {plan} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ loss
# scale


def grad_max_per_step(a) -> tuple[list[float], float]:
    """fp32 training on the global batch for --steps steps: the largest |gradient| of each step over
    the parameters and the layer outputs; and the --loss-scale auto probe's value at step 0."""
    from vit.data.datasets import load_dataset
    from vit.data.sampling import TrainBatches, make_loader
    from vit.model.layers import build_layers, model_shape
    from vit.planner.loss_scale import GradPeak, probe_grad_max
    from vit.training.optim import make_optimizer, make_scheduler
    from vit.training.reference import train_step

    s = defaults().with_(model=a.model, dataset=a.dataset)
    seed = s.train.seed
    data = load_dataset(a.dataset, None, model_shape(a.model).img_size, seed=seed)
    layers = build_layers(a.model, data.num_classes, data.in_chans, data.img_size, seed)
    n = len(data.train)
    probe = probe_grad_max(
        layers,
        make_loader(data.train, TrainBatches(n, a.global_batch, 1, 0, 1, seed, 0, 2), 0, False),
        torch.device("cpu"),
        1,
    )
    model = nn.Sequential(*layers)
    opt = make_optimizer(model, s.optim)
    sched = make_scheduler(opt, s.optim, a.steps)
    peaks, peak = [], GradPeak(layers, torch.device("cpu"))
    for batch in make_loader(
        data.train, TrainBatches(n, a.global_batch, 1, 0, 1, seed, 0, a.steps), 0, False
    ):
        peak.value.zero_()
        train_step(
            model,
            opt,
            sched,
            batch,
            clip=1.0,
            after_backward=lambda: peaks.append(peak.read(model).item()),
        )
    return peaks, probe


def skipped_steps(peaks: list[float], power: int) -> int:
    """DeepSpeed's dynamic loss scaler (its own class, the fp16 defaults: window 1000, hysteresis 2,
    min 1) fed with overflow = max|g| x scale reaches the fp16 limit."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from vit.planner.loss_scale import FP16_MAX

    scaler = DynamicLossScaler(
        init_scale=2.0**power,
        scale_window=1000,
        min_scale=1,
        delayed_shift=2,
        consecutive_hysteresis=False,
    )
    skipped = 0
    for g in peaks:
        overflow = g * scaler.cur_scale >= FP16_MAX
        skipped += overflow
        scaler.update_scale(overflow)
    return skipped


def lossscale(a) -> int:
    import torch.distributed as dist

    from vit.engines.deepspeed.engine import deepspeed_comm
    from vit.planner.loss_scale import scale_power
    from vit.run.ds_config import DEFAULT_FP16_SCALE_POWER

    # the loss scaler logs through torch.distributed's rank
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        deepspeed_comm()
        torch.set_num_threads(os.cpu_count() or 1)
        start = time.perf_counter()
        peaks, probe = grad_max_per_step(a)
        tuned = scale_power(probe)
        rows = [
            ("DeepSpeed's default", 16),
            ("this project's --precision fp16 default", DEFAULT_FP16_SCALE_POWER),
            ("--loss-scale auto", tuned),
        ]
        counts = [(name, power, skipped_steps(peaks, power)) for name, power in rows]
        dist.destroy_process_group()
    lines = [
        f"{a.model} on {a.dataset}, global batch {a.global_batch}, {a.steps} fp32 steps "
        f"({time.perf_counter() - start:.0f} s): largest |gradient| per step {min(peaks):.3g} .. "
        f"{max(peaks):.3g}; the probe (2 batches before training) saw {probe:.3g}",
        "",
        "| initial loss scale | initial_scale_power | skipped steps (emulated) |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {power} | {n} of {a.steps} |" for name, power, n in counts]
    publish(
        a.out,
        "lossscale",
        {"args": vars(a), "grad_max": peaks, "probe": probe, "rows": counts},
        "\n".join(lines) + "\n",
    )
    return 0


def add_mixed_arguments(p) -> None:
    p.add_argument("--model", default="vit_tiny_cifar")
    p.add_argument("--ranks", type=positive_int, default=2)
    p.add_argument("--slowdown", default="1=2", help="--simulate-slowdown of every run")
    p.add_argument(
        "--runs", choices=("all", "pipeline", "zero"), default="all", help="which engine's rows"
    )
    p.add_argument("--global-batch", type=positive_int, default=64)
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps")
    p.add_argument(
        "--warmup",
        type=positive_int,
        default=3,
        help="untimed steps first; also the metrics window",
    )
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="rounds of all runs; each row reports its fastest",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds before a run is killed")
    p.add_argument(
        "--calibration",
        help="the fixed costs --partition balanced's cost model reads ($VIT_PLANNER_CALIBRATION; "
        "default logs/planner_calibration.json where it exists)",
    )
    p.add_argument("--out", help="folder for mixed.md, mixed.json and the runs' logs")


def add_lossscale_arguments(p) -> None:
    p.add_argument("--model", default="vit_digits")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--global-batch", type=positive_int, default=64)
    p.add_argument("--steps", type=positive_int, default=200)
    p.add_argument("--out", help="folder for lossscale.md and lossscale.json")


COMMANDS = {
    "mixed": ("pipeline partitions and batch splits with slowed ranks", add_mixed_arguments, mixed),
    "lossscale": (
        "fp16 skipped steps, default scale vs auto (emulated)",
        add_lossscale_arguments,
        lossscale,
    ),
}
