"""images/s, step time, peak memory and MFU of each engine (real mpirun runs of vit.train) and their
ratio to a plain single-process PyTorch loop (vit.training.reference.train_step), at one global
batch."""

import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.common import (
    OthersCpu,
    device_name,
    failure_tail,
    flops_per_image,
    load_avg,
    median_step_s,
    mpirun_train,
    peak_tflops,
    publish,
    total_peak_tflops,
)
from bench.runs import CONFIGS, RUN_ENGINES, RUNS, engine_options
from vit.core.errors import ConfigError
from vit.core.settings import positive_int
from vit.model.layers import PRESETS, build_layers, check_model, model_shape
from vit.run.cli import defaults
from vit.telemetry.metrics import peak_mem_gib
from vit.training.optim import make_optimizer, make_scheduler
from vit.training.reference import train_step


def run_reference(a, dev: torch.device) -> dict:
    """The plain loop: nn.Sequential of the same layers, the trainer's AdamW and schedule, data in
    memory."""
    # the trainer's lr, weight decay, seed, AdamW
    s = defaults().with_(model=a.model, fused_adam=a.fused_adam)
    img = model_shape(a.model).img_size
    model = nn.Sequential(*build_layers(a.model, 10, 3, img, s.train.seed)).to(dev)
    opt = make_optimizer(model, s.optim)
    sched = make_scheduler(opt, s.optim, a.warmup + a.steps)
    # as the engines do
    clip = json.loads((CONFIGS / "zero0.json").read_text()).get("gradient_clipping", 0.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.global_batch, 3, img, img, generator=g).to(dev)
    y = (torch.arange(a.global_batch) % 10).to(dev)
    step_model = torch.compile(model) if a.compile else model
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")

    def step():
        train_step(step_model, opt, sched, (x, y), clip, autocast)

    for _ in range(a.warmup):
        step()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # step time per window of --warmup steps, as vit.train logs them
    windows, done, others = [], 0, OthersCpu()
    while done < a.steps:
        n = min(a.warmup, a.steps - done)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        windows.append((time.perf_counter() - start) / n)
        done += n
    step_s = statistics.median(windows)
    return {
        "engine": "reference" + (" (compiled)" if a.compile else ""),
        "ranks": 1,
        "layout": f"{a.global_batch} x 1 x 1",
        "step_time_s": step_s,
        "images_per_s": a.global_batch / step_s,
        "peak_mem_gib": peak_mem_gib(dev),
        "others_cores": others.cores(),
    }


def engine_args(name: str, a) -> tuple[list[str], str]:
    """vit.train options of one run at the global batch, and its layout (micro-batch x accum x
    data-parallel)."""
    engine, config = RUN_ENGINES[name]
    if engine.pipeline:
        stages = a.pipeline_stages or a.ranks
        if a.ranks % stages:
            sys.exit(f"bench train: --pipeline-stages {stages} does not divide --ranks {a.ranks}")
        dp = a.ranks // stages
        grad_accum = json.loads((CONFIGS / config).read_text())["gradient_accumulation_steps"]
        opts = engine_options(name, stages)
    else:
        dp, grad_accum = a.ranks, 1
        opts = engine_options(name)
    if a.global_batch % (grad_accum * dp):
        sys.exit(
            f"bench train: {name}: global batch {a.global_batch} is not divisible by {grad_accum} "
            f"micro-batches x data-parallel size {dp}"
        )
    micro = a.global_batch // (grad_accum * dp)
    return [
        *opts,
        "--micro-batch-size",
        micro,
        "--grad-accum",
        grad_accum,
    ], f"{micro} x {grad_accum} x {dp}"


def run_engine(name: str, a, log_dir: Path) -> dict:
    """One real multi-process run of vit.train under mpirun; the median step time of the records
    after the first (warm-up) window, so that a burst of load from other processes on a shared
    machine skews one window, not all."""
    opts, layout = engine_args(name, a)
    train = [
        *opts,
        "--model",
        a.model,
        "--dataset",
        "synthetic",
        "--synthetic-size",
        max(2048, a.global_batch),
        "--steps",
        a.warmup + a.steps,
        "--log-interval",
        a.warmup,
        "--no-save",
        "--monitor-interval",
        0,
        "--log-dir",
        log_dir,
    ]
    train += ["--precision", a.precision]  # none given would be auto on GPUs
    train += ["--fused-adam"] * a.fused_adam + ["--compile"] * a.compile
    log_dir.mkdir(parents=True)
    row = {"engine": name, "ranks": a.ranks, "layout": layout}
    others = OthersCpu()
    rc = mpirun_train(train, a.ranks, log_dir, a.timeout, a.mpirun_args)
    row["others_cores"] = others.cores()  # over the whole run, start-up included
    if rc != 0 or not (log_dir / "summary.json").exists():
        print(f"bench train: {name} failed ({rc}); {failure_tail(log_dir)}", file=sys.stderr)
        return {**row, "error": f"exit {rc}"}
    step_s = median_step_s(log_dir, a.warmup)
    summary = json.loads((log_dir / "summary.json").read_text())
    census = json.loads((log_dir / "cluster.json").read_text())["census"]
    return {
        **row,
        "step_time_s": step_s,
        "images_per_s": a.global_batch / step_s,
        "peak_mem_gib": summary["peak_mem_gib"],
        "devices": [c["device"] for c in census],
    }


def combine(runs: list[dict]) -> dict:
    """One row from the --repeat runs of an engine: the fastest (other processes only ever slow a
    run down)."""
    failed = [r for r in runs if "error" in r]
    return failed[0] if failed else min(runs, key=lambda r: r["step_time_s"])


def train_table(result: dict) -> str:
    r = result
    lines = [
        f"{r['model']}, global batch {r['global_batch']}, {r['precision']}, {r['steps']} timed "
        f"steps after {r['warmup']} warm-up; step time: the median over windows of {r['warmup']} "
        f"steps, the fastest of {r['repeat']} interleaved repeats; "
        f"{'compiled' if r['compile'] else 'not compiled'}; AdamW "
        f"{'fused' if r['fused_adam'] else 'torch default'}; {r['device']}, reference on "
        f"{r['reference_threads']} threads; {r['flops_per_image'] / 1e9:.3f} GFLOP/image forward "
        f"(x3 to train); peak {r['peak_tflops'] or '?'} TFLOP/s per device; others: "
        f"CPU cores busy with other processes during that run ({r['cpus']} CPUs; "
        f"1-minute load average {r['load_avg_before']} before, {r['load_avg_after']} after)",
        "",
        "| engine | ranks | micro x accum x dp | images/s | step ms | peak mem GiB/rank | "
        "MFU % | ratio to ref | others |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in r["rows"]:
        if "error" in row:
            lines.append(
                f"| {row['engine']} | {row['ranks']} | {row['layout']} | failed: "
                f"{row['error']} | | | | | {row['others_cores']} |"
            )
            continue
        mfu = f"{100 * row['mfu']:.1f}" if row.get("mfu") is not None else "-"
        lines.append(
            f"| {row['engine']} | {row['ranks']} | {row['layout']} | {row['images_per_s']:.1f} | "
            f"{1e3 * row['step_time_s']:.1f} | {row['peak_mem_gib']:.2f} | {mfu} | "
            f"{row['ratio']:.3f} | {row['others_cores']} |"
        )
    return "\n".join(lines) + "\n"


def run(a) -> int:
    try:
        check_model(a.model)
    except ConfigError as e:
        sys.exit(f"bench train: {e}")
    engines = [e for e in a.engines.split(",") if e]
    unknown = [e for e in engines if e not in RUNS]
    if unknown:
        sys.exit(
            f"bench train: unknown engine(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}"
        )
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = device_name()
    peak = a.peak_tflops or peak_tflops(name, a.precision)
    if peak is None:
        print(
            f"bench train: no peak FLOP/s for '{name}' in PEAK_TFLOPS ({a.precision}); "
            "MFU left out. Measure one with `python -m bench peak` and pass --peak-tflops",
            file=sys.stderr,
        )
    before = load_avg()
    img = model_shape(a.model).img_size
    flops = flops_per_image(nn.Sequential(*build_layers(a.model, 10, 3, img)), img)
    runs = []  # reference, engines, reference, engines, ...: --repeat rounds
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(a.out) / "logs" if a.out else Path(tmp)
        for rep in range(a.repeat):
            runs.append(run_reference(a, dev))
            # hand the reference's memory back before the engines start on the same GPU
            if dev.type == "cuda":
                torch._dynamo.reset()
                torch.cuda.empty_cache()
            for engine in engines:
                runs.append(
                    run_engine(
                        engine, a, logs / (engine if a.repeat == 1 else f"{engine}.{rep + 1}")
                    )
                )
            for r in runs[-1 - len(engines) :]:
                print(
                    f"{r['engine']}: " + (r.get("error") or f"{r['images_per_s']:.1f} images/s"),
                    flush=True,
                )
    rows = [combine([r for r in runs if r["engine"] == e]) for e in [runs[0]["engine"], *engines]]
    # On GPUs every rank has its own device, with its own peak; CPU ranks share the cores of one
    # machine, whose peak is the table's.
    for row in rows:
        if "error" not in row:
            gpus = row.get("devices", [name]) if dev.type == "cuda" else None
            total = total_peak_tflops(gpus, a.precision, a.peak_tflops) if gpus else peak
            row["ratio"] = row["images_per_s"] / rows[0]["images_per_s"]
            row["mfu"] = row["images_per_s"] * 3 * flops / (total * 1e12) if total else None
    result = {
        "benchmark": "train",
        "model": a.model,
        "global_batch": a.global_batch,
        "precision": a.precision,
        "steps": a.steps,
        "warmup": a.warmup,
        "ranks": a.ranks,
        "device": name,
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "peak_tflops": peak,
        "flops_per_image": flops,
        "torch": torch.__version__,
        "compile": a.compile,
        "fused_adam": a.fused_adam,
        "reference_threads": torch.get_num_threads(),
        "repeat": a.repeat,
        "load_avg_before": before,
        "load_avg_after": load_avg(),
        "rows": rows,
        "runs": runs,
    }
    publish(a.out, "train", result, train_table(result))
    return 1 if any("error" in r for r in rows) else 0


def add_arguments(t) -> None:
    t.add_argument(
        "--model",
        default="vit_tiny_cifar",
        help="a preset (" + ", ".join(PRESETS) + ") or a timm ViT name",
    )
    t.add_argument(
        "--global-batch",
        type=positive_int,
        default=64,
        help="images per optimizer step, for every engine",
    )
    t.add_argument(
        "--ranks", type=positive_int, default=2, help="processes per engine run (mpirun -np)"
    )
    t.add_argument("--steps", type=positive_int, default=20, help="timed steps")
    t.add_argument(
        "--warmup",
        type=positive_int,
        default=5,
        help="untimed steps before them; also the window whose median step time is reported",
    )
    t.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="rounds of reference + engines, interleaved; each row reports its fastest",
    )
    t.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: autocast in the reference, vit.train --precision bf16 in the engines",
    )
    t.add_argument(
        "--engines", default=",".join(RUNS), help="comma-separated, from: " + ", ".join(RUNS)
    )
    t.add_argument(
        "--pipeline-stages",
        type=positive_int,
        help="pipeline stages (default: --ranks, one data-parallel copy)",
    )
    t.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the reference and every engine (vit.train --compile); "
        "the warm-up steps take the compilation",
    )
    t.add_argument(
        "--fused-adam",
        action="store_true",
        help="torch's fused AdamW in the reference and in every engine (vit.train --fused-adam)",
    )
    t.add_argument(
        "--peak-tflops", type=float, help="peak TFLOP/s per device (default: from PEAK_TFLOPS)"
    )
    t.add_argument(
        "--mpirun-args",
        default="",
        help="extra mpirun arguments, e.g. '--hostfile setup/hosts.txt'",
    )
    t.add_argument(
        "--timeout", type=float, default=1800, help="seconds before an engine run is killed"
    )
    t.add_argument("--out", help="folder for train.md, train.json and each engine's logs/")


COMMANDS = {"train": (__doc__.split("\n\n")[0], add_arguments, run)}
