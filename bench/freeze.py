"""python -m bench freeze: freeze training on 2 ranks, the pipeline engine with 2 stages (or
--engine-options): PipeTransformer's breakdown and the freeze rules against no freezing, on four
cases.

Cases (--cases), each a training run on the ten digits drawn as RGB images in an image folder (every
training image; the 360 held-out ones for evaluation):
- finetune: 16x16, 10 epochs at lr 5e-4, from the default job's export (vit_digits on the 8x8
  digits, --export);
- undertrained: the same from an export of the default job stopped at 20 of its 40 epochs, 12
  epochs;
- scratch: 16x16, 10 epochs at the default lr, from a random initialisation;
- timm32: a timm name (vit_tiny_patch16_224) at 32x32, 10 epochs at lr 5e-4, from its own export
  after 10 epochs on another task (even or odd, 2 classes) at 32x32: the head is reset for the 10
  digits. Configurations (--configs): baseline (no freezing), freeze only (--freeze-replan off, no
  cache), + AutoPipe/AutoDP (2 stages become 1 stage x 2 copies), + AutoCache (PipeTransformer's
  Table 1 and Fig. 9, all with the schedule), settled + AutoCache and grad + AutoCache (the
  convergence rules instead of the schedule). Optionally with rank 1 slowed (--slow 1=2), or every
  case fine-tuned for --epochs instead of its own. Time is summary.json's wall time; top-1 and wall
  time are medians over --seeds."""

import json
import shlex
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import device_name, failure_tail, load_avg, mpirun_train, publish
from bench.finetune import write_parity_folder
from vit.core.settings import positive_int

PIPELINE = "--engine pipeline --pipeline-stages 2 --ds-config deepspeed_configs/pipeline.json"
REPLAN_CACHE = ["--freeze-replan", "on", "--freeze-cache", "on"]
CONFIGS = {  # name -> options on top of the case's run
    "baseline": [],
    "freeze only": ["--freeze", "schedule", "--freeze-replan", "off", "--freeze-cache", "off"],
    "+ AutoPipe/AutoDP": ["--freeze", "schedule", "--freeze-replan", "on", "--freeze-cache", "off"],
    "+ AutoCache": ["--freeze", "schedule", *REPLAN_CACHE],
    "settled + AutoCache": ["--freeze", "settled", *REPLAN_CACHE],
    "grad + AutoCache": ["--freeze", "grad", *REPLAN_CACHE],
    # the trade between speed and accuracy (docs/benchmarks.md): settled's thresholds around its
    # default 0.65, the schedule deciding every 2 epochs
    "settled 0.5": ["--freeze", "settled", "--freeze-threshold", 0.5, *REPLAN_CACHE],
    "settled 0.6": ["--freeze", "settled", "--freeze-threshold", 0.6, *REPLAN_CACHE],
    "settled 0.65": ["--freeze", "settled", "--freeze-threshold", 0.65, *REPLAN_CACHE],
    "settled 0.7": ["--freeze", "settled", "--freeze-threshold", 0.7, *REPLAN_CACHE],
    "settled 0.85": ["--freeze", "settled", "--freeze-threshold", 0.85, *REPLAN_CACHE],
    "schedule every 2": ["--freeze", "schedule", "--freeze-interval-epochs", 2, *REPLAN_CACHE],
}
DEFAULT_CONFIGS = "baseline,freeze only,+ AutoPipe/AutoDP,+ AutoCache"
TIMM = "vit_tiny_patch16_224"
# name -> (image side, pretraining options (None: from scratch), whether it pretrains on even or odd
# in an image folder instead of the default job's 8x8 digits, fine-tuning options)
CASES = {
    "finetune": (16, [], False, ["--epochs", 10, "--lr", "5e-4"]),
    "undertrained": (16, ["--epochs", 20], False, ["--epochs", 12, "--lr", "5e-4"]),
    "scratch": (16, None, False, ["--epochs", 10]),
    "timm32": (
        32,
        ["--model", TIMM, "--img-size", 32, "--epochs", 10],
        True,
        ["--model", TIMM, "--epochs", 10, "--lr", "5e-4"],
    ),
}


def pretrain(case: str, options: list, parity: Path | None, logs: Path, timeout: int) -> Path:
    """The case's export: the default job with `options`, or with parity (an image folder) that
    model on it."""
    out = logs / f"pretrain.{case}"
    out.mkdir(parents=True, exist_ok=True)
    data = ["--dataset", "imagefolder", "--data-path", parity] if parity else []
    rc = mpirun_train(
        [
            *options,
            *data,
            "--no-save",
            "--monitor-interval",
            0,
            "--export",
            out / "model.safetensors",
            "--log-dir",
            out,
        ],
        2,
        out,
        timeout,
    )
    if rc != 0:
        raise SystemExit(f"bench freeze: pretraining for {case} failed: {failure_tail(out)}")
    return out / "model.safetensors"


def run(a) -> int:
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        raise SystemExit(
            f"bench freeze: --seeds {a.seeds!r}: comma-separated whole numbers"
        ) from None
    configs, cases = a.configs.split(","), a.cases.split(",")
    unknown = [n for n in configs if n not in CONFIGS]
    if unknown or "baseline" not in configs:
        raise SystemExit(
            f"bench freeze: --configs {a.configs}: each of {', '.join(CONFIGS)}, baseline among "
            f"them ({'unknown: ' + ', '.join(unknown) if unknown else 'no baseline'})"
        )
    if unknown := [n for n in cases if n not in CASES]:
        raise SystemExit(
            f"bench freeze: --cases {a.cases}: each of {', '.join(CASES)} (unknown: "
            f"{', '.join(unknown)})"
        )
    slows = [""] + ([a.slow] if a.slow else [])
    rows, load = [], load_avg()
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(a.out) / "logs" if a.out else Path(tmp)
        # 16x16 PNGs; --img-size scales them
        data, parity = Path(tmp) / "digit", Path(tmp) / "parity"
        write_parity_folder(data, 10_000, task="digit")
        if any(CASES[case][2] for case in cases):
            write_parity_folder(parity, 10_000, task="parity")
        for case in cases:
            side, before, on_parity, options = CASES[case]
            start = (
                []
                if before is None
                else [
                    "--pretrained-path",
                    pretrain(case, before, parity if on_parity else None, logs, a.timeout),
                ]
            )
            if a.epochs:  # every case's fine-tuning options name its epochs
                at = options.index("--epochs") + 1
                options = [*options[:at], a.epochs, *options[at + 1 :]]
            common = [
                "--dataset",
                "imagefolder",
                "--data-path",
                data,
                "--img-size",
                side,
                *start,
                *options,
                *shlex.split(a.engine_options),
                "--no-save",
                "--monitor-interval",
                0,
            ]
            # seeds outermost: a change of load spreads over every configuration alike
            for slow in slows:
                runs = {name: [] for name in configs}
                for seed in seeds:
                    for name in configs:
                        runs[name].append(
                            measure(
                                case, name, [*common, *CONFIGS[name]], slow, seed, logs, a.timeout
                            )
                        )
                rows += [
                    {
                        "case": case,
                        "config": name,
                        "slow": slow,
                        "runs": r,
                        "top1": statistics.median(x["top1"] for x in r),
                        "wall_s": statistics.median(x["wall_s"] for x in r),
                    }
                    for name, r in runs.items()
                ]
    result = {
        "benchmark": "freeze",
        "device": device_name(),
        "seeds": seeds,
        "load_before": load,
        "load_after": load_avg(),
        "engine_options": a.engine_options,
        "rows": rows,
    }
    publish(a.out, "freeze", result, table(result))
    return 0


def measure(
    case: str, name: str, train: list, slow: str, seed: int, logs: Path, timeout: int
) -> dict:
    """One run of a configuration: its top-1, wall time, load before it and layers frozen at the
    end."""
    log_dir = (
        logs
        / f"{case}.{name.replace(' ', '_').replace('/', '-')}{'.slow' if slow else ''}.seed{seed}"
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    more = ["--simulate-slowdown", slow] if slow else []
    t0, before = time.perf_counter(), load_avg()
    rc = mpirun_train([*train, *more, "--seed", seed, "--log-dir", log_dir], 2, log_dir, timeout)
    if rc != 0:
        raise SystemExit(f"bench freeze: {case}, {name} failed: {failure_tail(log_dir)}")
    s = json.loads((log_dir / "summary.json").read_text())
    frozen = [
        r["frozen"]
        for r in map(json.loads, (log_dir / "metrics_rank0.jsonl").read_text().splitlines())
        if r["kind"] == "freeze"
    ]
    run = {
        "seed": seed,
        "top1": s["top1"],
        "wall_s": s["wall_s"],
        "load": before,
        "steps": s["steps"],
        "outside_s": time.perf_counter() - t0,
        "frozen": frozen[-1] if frozen else 0,
    }
    print(
        f"{case}, {name}{' ' + slow if slow else ''} seed {seed}: top-1 {100 * s['top1']:.2f}% in "
        f"{s['wall_s']:.1f} s, {run['frozen']} layers frozen at the end (load {before})",
        flush=True,
    )
    return run


def table(result: dict) -> str:
    lines = [
        f"{result['device']}, 2 ranks, {result.get('engine_options', PIPELINE)}; "
        f"seeds {result['seeds']}; load {result['load_before']} before, "
        f"{result['load_after']} after",
        "",
        "| case | configuration | rank 1 | top-1 % (median) | each seed | vs baseline | "
        "wall s (median) | speed-up | layers frozen at the end | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["case"], r["slow"]): r for r in result["rows"] if r["config"] == "baseline"}
    for r in result["rows"]:
        b = base[r["case"], r["slow"]]
        each = " / ".join(f"{100 * x['top1']:.2f}" for x in r["runs"])
        loads = ", ".join(f"{x['load']:.1f}" for x in r["runs"])
        frozen = " / ".join(str(x["frozen"]) for x in r["runs"])
        rank1 = f"slowed {r['slow'].split('=')[1]}x" if r["slow"] else "as is"
        lines.append(
            f"| {r['case']} | {r['config']} | {rank1} | {100 * r['top1']:.2f} | {each} | "
            f"{100 * (r['top1'] - b['top1']):+.2f} | {r['wall_s']:.1f} | "
            f"{b['wall_s'] / r['wall_s']:.2f}x | {frozen} | {loads} |"
        )
    return "\n".join(lines) + "\n"


def add_arguments(p) -> None:
    p.add_argument(
        "--cases", default="finetune", help=f"comma-separated cases of {', '.join(CASES)}"
    )
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help=f"comma-separated configurations of {', '.join(CONFIGS)} (baseline among them: "
        "the speed-ups are against it)",
    )
    p.add_argument(
        "--epochs",
        type=positive_int,
        help="fine-tuning epochs of every case (default: each case's own)",
    )
    p.add_argument(
        "--slow",
        default="1=2",
        help="also run every configuration with --simulate-slowdown SLOW ('' to skip)",
    )
    p.add_argument(
        "--engine-options",
        default=PIPELINE,
        help="the engine of every run (the freeze configurations need "
        "one that freezes) [%(default)s]",
    )
    p.add_argument("--timeout", type=positive_int, default=900, help="seconds per run")
    p.add_argument("--out", help="write freeze.md, freeze.json and the runs' logs here")


COMMANDS = {
    "freeze": (
        "freeze training: PipeTransformer's breakdown and the freeze rules, on 2 ranks",
        add_arguments,
        run,
    )
}
