"""python -m bench freeze: freeze training (PipeTransformer's breakdown) on 2 ranks, from a model this project
pretrained.

Pretraining: the default job with --export. Fine-tuning: the ten digits drawn as 16x16 RGB images in an image
folder (every training image; the 360 held-out ones for evaluation), from the export, on the pipeline engine with
2 stages on 2 ranks, each configuration for the same epochs, as in PipeTransformer's Table 1 and Fig. 9:
baseline (no freezing), freeze only (--freeze-replan off, no cache), + AutoPipe/AutoDP (2 stages become 1 stage x
2 copies), + AutoCache; with --configs also `grad + AutoCache` (--freeze grad instead of the schedule). Optionally
with rank 1 slowed (--slow 1=2). Time is summary.json's wall time."""
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import device_name, failure_tail, load_avg, mpirun_train, publish
from bench.finetune import write_parity_folder
from vit.config.settings import positive_int

CONFIGS = {  # name -> options on top of the fine-tuning run
    "baseline": [],
    "freeze only": ["--freeze", "schedule", "--freeze-replan", "off", "--freeze-cache", "off"],
    "+ AutoPipe/AutoDP": ["--freeze", "schedule", "--freeze-replan", "on", "--freeze-cache", "off"],
    "+ AutoCache": ["--freeze", "schedule", "--freeze-replan", "on", "--freeze-cache", "on"],
    "grad + AutoCache": ["--freeze", "grad", "--freeze-replan", "on", "--freeze-cache", "on"],  # --configs only
}
DEFAULT_CONFIGS = "baseline,freeze only,+ AutoPipe/AutoDP,+ AutoCache"


def run(a) -> int:
    seeds = [int(s) for s in a.seeds.split(",")]
    if unknown := [n for n in a.configs.split(",") if n not in CONFIGS] or "baseline" not in a.configs.split(","):
        raise SystemExit(f"bench freeze: --configs {a.configs}: each of {', '.join(CONFIGS)}, baseline among them "
                         f"({unknown or 'no baseline'})")
    slows = [""] + ([a.slow] if a.slow else [])
    rows, load = [], load_avg()
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(a.out) / "logs" if a.out else Path(tmp)
        data, export = Path(tmp) / "digits16", logs / "pretrain" / "digits.safetensors"
        write_parity_folder(data, 10_000, task="digit")
        (logs / "pretrain").mkdir(parents=True, exist_ok=True)
        rc = mpirun_train(["--no-save", "--export", export, "--log-dir", logs / "pretrain"], 2, logs / "pretrain",
                          a.timeout)
        if rc != 0:
            raise SystemExit(f"bench freeze: pretraining failed: {failure_tail(logs / 'pretrain')}")
        task = ["--dataset", "imagefolder", "--data-path", data, "--img-size", 16, "--pretrained-path", export,
                "--lr", a.lr, "--engine", "pipeline", "--pipeline-stages", 2, "--ds-config",
                "deepspeed_configs/pipeline.json", "--epochs", a.epochs, "--no-save", "--monitor-interval", 0]
        for slow in slows:
            for name, extra in ((n, CONFIGS[n]) for n in a.configs.split(",")):
                runs = []
                for seed in seeds:
                    log_dir = logs / f"{name.replace(' ', '_').replace('/', '-')}{'.slow' if slow else ''}.seed{seed}"
                    log_dir.mkdir(parents=True, exist_ok=True)
                    more = ["--simulate-slowdown", slow] if slow else []
                    t0, before = time.perf_counter(), load_avg()
                    rc = mpirun_train([*task, *extra, *more, "--seed", seed, "--log-dir", log_dir], 2, log_dir,
                                      a.timeout)
                    if rc != 0:
                        raise SystemExit(f"bench freeze: {name} failed: {failure_tail(log_dir)}")
                    s = json.loads((log_dir / "summary.json").read_text())
                    runs.append({"seed": seed, "top1": s["top1"], "wall_s": s["wall_s"], "load": before,
                                 "outside_s": time.perf_counter() - t0})
                    print(f"{name}{' ' + slow if slow else ''} seed {seed}: top-1 {100 * s['top1']:.2f}% in "
                          f"{s['wall_s']:.1f} s (load {before})", flush=True)
                rows.append({"config": name, "slow": slow, "runs": runs,
                             "top1": statistics.median(r["top1"] for r in runs),
                             "wall_s": statistics.median(r["wall_s"] for r in runs)})
    result = {"benchmark": "freeze", "device": device_name(), "epochs": a.epochs, "seeds": seeds,
              "load_before": load, "load_after": load_avg(), "rows": rows}
    publish(a.out, "freeze", result, table(result))
    return 0


def table(result: dict) -> str:
    lines = [f"{result['device']}, 2 ranks, pipeline 2 stages; ten digits as 16x16 RGB images fine-tuned from the "
             f"digits export; {result['epochs']} epochs; seeds {result['seeds']}; load {result['load_before']} "
             f"before, {result['load_after']} after", "",
             "| configuration | rank 1 | top-1 % (median) | each seed | wall s (median) | speed-up | load |",
             "|---|---|---|---|---|---|---|"]
    base = {r["slow"]: r["wall_s"] for r in result["rows"] if r["config"] == "baseline"}
    for r in result["rows"]:
        each = " / ".join(f"{100 * x['top1']:.2f}" for x in r["runs"])
        loads = ", ".join(f"{x['load']:.1f}" for x in r["runs"])
        lines.append(f"| {r['config']} | {'slowed ' + r['slow'].split('=')[1] + 'x' if r['slow'] else 'as is'} | "
                     f"{100 * r['top1']:.2f} | {each} | {r['wall_s']:.1f} | {base[r['slow']] / r['wall_s']:.2f}x "
                     f"| {loads} |")
    return "\n".join(lines) + "\n"


def add_arguments(p) -> None:
    p.add_argument("--epochs", type=positive_int, default=10, help="fine-tuning epochs")
    p.add_argument("--lr", default="5e-4", help="fine-tuning peak learning rate")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated configurations of {', '.join(CONFIGS)}"
                   " (baseline among them: the speed-ups are against it)")
    p.add_argument("--slow", default="1=2", help="also run every configuration with --simulate-slowdown SLOW "
                   "('' to skip)")
    p.add_argument("--timeout", type=positive_int, default=900, help="seconds per run")
    p.add_argument("--out", help="write freeze.md, freeze.json and the runs' logs here")


COMMANDS = {"freeze": ("freeze training's breakdown (PipeTransformer's Table 1 / Fig. 9) on 2 ranks", add_arguments,
                       run)}
