"""The GPU acceptance check, in one command for the day a GPU is lent: DiLoCo's side stream and
timed windows, every engine on one device in bf16 and fp16, fp16's loss scaler on an overflow, host
syncs per step, --micro-batch-size auto and the out-of-memory line, a freeze rebuild's memory, the
monitor's GPU samples, and ViT-B/16 throughput and MFU, compiled and not. Writes gpu.json and gpu.md
under --out. Every check is a real vit.train run (one process, no launcher) or bench train."""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from bench import train as bench_train
from bench.common import child_env, device_name, load_avg, publish
from bench.runs import CONFIGS, RUNS, engine_options
from vit.core.paths import ROOT
from vit.core.settings import positive_int
from vit.telemetry.jsonl import read_jsonl

SYNC_WARNING = "called a synchronizing CUDA operation"
# Run in the child before training: torch.cuda.Event.synchronize warns like the sync debug mode,
# naming its caller's file (stacklevel 2), so that sync_sources counts it where it is called.
EVENT_SYNC_WARNS = f"""import warnings
_event_sync = torch.cuda.Event.synchronize
def _warning_event_sync(self):
    warnings.warn("{SYNC_WARNING} (Event.synchronize)", UserWarning, stacklevel=2)
    return _event_sync(self)
torch.cuda.Event.synchronize = _warning_event_sync
"""


def vit_train(
    args: list, log_dir: Path, timeout: float, sync_debug: bool = False
) -> tuple[int | str, str]:
    """One process of vit.train (rank 0 of 1); its exit code (or why it was killed) and output."""
    code = "import sys, torch\nfrom vit.train import main\n"
    # every host sync of the CUDA stream warns, each one (PYTHONWARNINGS=always below); torch's
    # sync debug mode does not see an event's synchronize (cudaEventSynchronize), so that warns too
    if sync_debug:
        code += "torch.cuda.set_sync_debug_mode('warn')\n" + EVENT_SYNC_WARNS
    code += "sys.exit(main(sys.argv[1:]))\n"
    env = child_env(PYTHONUNBUFFERED="1", **({"PYTHONWARNINGS": "always"} if sync_debug else {}))
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", code, *map(str, args), "--log-dir", str(log_dir)]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return f"timed out after {timeout} s", (e.stdout or b"").decode(errors="replace")
    (log_dir / "output.log").write_text(p.stdout + p.stderr)
    return p.returncode, p.stdout + p.stderr


def losses(log_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(log_dir / "metrics_rank0.jsonl") if r["kind"] == "train"]


def training_verdict(rc, out: str, log_dir: Path) -> dict:
    """ok: the run exited 0 and learns; detail: its first and last loss, or its last line."""
    values = losses(log_dir) if rc == 0 else []
    detail = f"loss {values[0]:.3f} -> {values[-1]:.3f}" if values else last_line(out)
    return {"ok": rc == 0 and learns(values), "detail": detail}


def learns(values: list[float]) -> bool:
    """Every loss finite, and the last fifth's mean below the first fifth's."""
    k = max(1, len(values) // 5)
    return (
        bool(values)
        and all(v == v and abs(v) != float("inf") for v in values)
        and sum(values[-k:]) / k < sum(values[:k]) / k
    )


def engine_runs(a, tmp: Path) -> list[dict]:
    """Every engine for --steps steps in bf16 and fp16: losses finite and falling; a refusal is
    recorded as such."""
    rows = []
    for name in RUNS:
        for precision in ("bf16", "fp16"):
            opts = engine_options(name, pipeline_stages=1)
            log_dir = tmp / f"{name}-{precision}"
            rc, out = vit_train(
                [*opts, "--precision", precision, *common(a, a.steps)], log_dir, a.timeout
            )
            row = {"check": f"{name} {precision}", "exit": rc}
            if rc == 2:  # refused before training, in one line: the refusal is the result
                row.update(ok=None, detail=last_line(out))
            else:
                row.update(training_verdict(rc, out, log_dir))
            rows.append(row)
    rows.append(
        {
            "check": "pipeline, 2 stages on one GPU",
            "ok": None,
            "detail": "not run: NCCL refuses two ranks on one device (vit.runtime.gpu's "
            "one-GPU-per-rank check)",
        }
    )
    return rows


def diloco_runs(a, tmp: Path) -> list[dict]:
    """DiLoCo's device path on one rank: its default fragments (on a GPU each fragment's
    all-reduce runs from the sender thread on a CUDA stream of its own, which the training stream
    waits for only where the fragment is applied; on one rank the int8 wire takes its one-rank
    path, as it exchanges nothing) with --local-steps proportional, so every window is timed with
    CUDA events and its times all-gathered on the device."""
    log_dir, every = tmp / "diloco-fragments", 5  # 5 fragments: one on the wire after every step
    precision = "bf16" if a.device == "cuda" else "fp32"
    where = "on a side CUDA stream" if a.device == "cuda" else "from the sender thread (gloo)"
    args = ["--engine", "diloco", "--sync-every", every, "--local-steps", "proportional"]
    rc, out = vit_train(
        [*args, "--precision", precision, *common(a, 4 * every)], log_dir, a.timeout
    )
    return [
        {
            "check": f"diloco {precision}, 1 rank: 5 fragments {where}, timed windows",
            "exit": rc,
            **training_verdict(rc, out, log_dir),
        },
        {
            "check": "diloco, 2 workers on one GPU",
            "ok": None,
            "detail": "not run: NCCL refuses two ranks on one device; the wire's int8 exchange "
            "needs two (tests/test_diloco.py runs it on gloo)",
        },
    ]


OVERFLOW_STEPS = 40  # from 2^32 the scale halves each skipped step: about 20 steps go to skipping


def overflow_run(a, tmp: Path) -> dict:
    """fp16 with a loss scale of 2^32: the first steps overflow, DeepSpeed skips them, and training
    goes on (judged on the steps after the last skip; at least OVERFLOW_STEPS steps, whatever
    --steps, so that a healthy machine has steps left to learn on)."""
    config = json.loads((CONFIGS / "zero2_fp16.json").read_text())
    config["fp16"] = {**config["fp16"], "initial_scale_power": 32}
    path = tmp / "zero2_overflow.json"
    path.write_text(json.dumps(config))
    log_dir = tmp / "overflow"
    steps = max(a.steps, OVERFLOW_STEPS)
    rc, out = vit_train(
        ["--engine", "zero", "--ds-config", path, *common(a, steps)], log_dir, a.timeout
    )
    records = read_jsonl(log_dir / "metrics_rank0.jsonl") if rc == 0 else []
    skips = [r["step"] for r in records if r["kind"] == "skip"]
    after = [
        r["loss"] for r in records if r["kind"] == "train" and r["step"] > max(skips, default=0)
    ]
    # 2: fp16 refused here
    ok = None if rc == 2 else rc == 0 and len(skips) > 0 and learns(after)
    return {
        "check": "fp16 overflow skipped (zero2, scale 2^32)",
        "exit": rc,
        "ok": ok,
        "detail": f"{len(skips)} of {steps} steps skipped" if rc == 0 else last_line(out),
    }


def sync_sources(out: str) -> Counter:
    """Host-sync warnings by the file that made them: `deepspeed` for DeepSpeed's own (its optimizer
    step reads the overflow flag and the gradient norm on the host), `ours` for everything else
    (this project's code and the torch calls it makes, the backward pass included)."""
    files = re.findall(r"^(\S+?):\d+: UserWarning: " + SYNC_WARNING, out, flags=re.M)
    return Counter("deepspeed" if "/deepspeed/" in f else "ours" for f in files)


def sync_runs(a, tmp: Path) -> list[dict]:
    """Host syncs per training step: the warnings of torch's sync debug mode in a run of 2N steps
    less those of a run of N (start-up, evaluation and the end are the same in both), over N;
    logging only at the end. Ours must be 0; DeepSpeed's are reported."""
    rows = []
    for name in ("zero2", "ddp", "pipeline"):
        counts = []
        for steps in (a.steps, 2 * a.steps):
            rc, out = vit_train(
                [
                    *engine_options(name, pipeline_stages=1),
                    "--precision",
                    "bf16",
                    "--verbose",
                    *common(a, steps, log_interval=steps),
                ],
                tmp / f"sync-{name}-{steps}",
                a.timeout,
                sync_debug=True,
            )
            counts.append(sync_sources(out) if rc == 0 else None)
        if None in counts:
            rows.append(
                {
                    "check": f"host syncs per step, {name} bf16",
                    "ok": False,
                    "detail": "a run failed",
                }
            )
            continue
        ours, theirs = ((counts[1][k] - counts[0][k]) / a.steps for k in ("ours", "deepspeed"))
        rows.append(
            {
                "check": f"host syncs per step, {name} bf16",
                "ok": ours == 0,
                "detail": f"ours {ours:g} per step ({counts[0]['ours']} in {a.steps} steps, "
                f"{counts[1]['ours']} "
                f"in {2 * a.steps}); DeepSpeed's own {theirs:g} per step",
            }
        )
    return rows


def micro_batch_runs(a, tmp: Path) -> list[dict]:
    """--micro-batch-size auto on ViT-B/16: its choice trains a step, and twice that runs out of
    memory with our one-line message."""
    big = [
        "--model",
        "vit_base_patch16_224",
        "--dataset",
        "synthetic",
        "--synthetic-size",
        4096,
        "--precision",
        "bf16",
        "--steps",
        1,
        "--no-save",
        "--monitor-interval",
        0,
    ]
    rows = []
    for name in ("zero2", "ddp"):
        rc, out = vit_train(
            [*engine_options(name), *big, "--micro-batch-size", "auto"],
            tmp / f"auto-{name}",
            a.timeout,
        )
        cfg = json.loads((tmp / f"auto-{name}" / "config.json").read_text()) if rc == 0 else {}
        chosen = cfg.get("deepspeed", {}).get("train_micro_batch_size_per_gpu")
        rows.append(
            {
                "check": f"--micro-batch-size auto, {name}",
                "exit": rc,
                "ok": rc == 0 and bool(chosen),
                "detail": f"chose {chosen}; one step ran" if chosen else last_line(out),
            }
        )
        if chosen:
            rc, out = vit_train(
                [*engine_options(name), *big, "--micro-batch-size", 2 * chosen],
                tmp / f"double-{name}",
                a.timeout,
            )
            line = last_line(out)
            rows.append(
                {
                    "check": f"micro-batch {2 * chosen} (2x auto), {name}",
                    "exit": rc,
                    "ok": rc == 1 and "out of memory" in line and "Traceback" not in out,
                    "detail": line,
                }
            )
    return rows


def freeze_and_monitor_runs(a, tmp: Path) -> list[dict]:
    """A freeze rebuild on the device (memory before and after from the step records) and the
    monitor's GPU samples from NVML and from GPUtil."""
    rows = []
    for backend in ("nvml", "gputil"):
        log_dir = tmp / f"freeze-{backend}"
        rc, out = vit_train(
            [
                "--engine",
                "zero",
                "--ds-config",
                CONFIGS / "zero2.json",
                "--precision",
                "bf16",
                "--freeze",
                "schedule",
                "--freeze-interval-epochs",
                a.steps // 4,
                "--monitor-backend",
                backend,
                "--monitor-interval",
                0.2,
                *common(a, 4 * a.steps, monitor=False),
            ],
            log_dir,
            a.timeout,
        )
        if rc != 0:
            rows.append(
                {
                    "check": f"freeze rebuild, monitor {backend}",
                    "exit": rc,
                    "ok": False,
                    "detail": last_line(out),
                }
            )
            continue
        records = read_jsonl(log_dir / "metrics_rank0.jsonl")
        freezes = [r["step"] for r in records if r["kind"] == "freeze"]
        mem = [(r["step"], r["mem_gib"]) for r in records if r["kind"] == "train"]
        samples = [r for r in read_jsonl(log_dir / "monitor_rank0.jsonl") if r.get("gpus")]
        rows.append(
            {
                "check": f"freeze rebuild, monitor {backend}",
                "exit": rc,
                "ok": bool(freezes) and bool(samples),
                "detail": f"froze after steps {freezes}; mem GiB by step "
                f"{mem[:: max(1, len(mem) // 6)]}; "
                f"{len(samples)} monitor samples with GPU fields",
            }
        )
    return rows


def throughput(a, tmp: Path, compiled: bool = False) -> list[dict]:
    """ViT-B/16 at 224 in bf16: zero1 and zero2 against the plain loop, and MFU; compiled or not."""
    ns = argparse.Namespace(
        model="vit_base_patch16_224",
        global_batch=a.vit_b_batch,
        ranks=1,
        steps=20,
        warmup=5,
        repeat=1,
        precision="bf16",
        engines="zero1,zero2",
        pipeline_stages=None,
        compile=compiled,
        fused_adam=False,
        peak_tflops=None,
        mpirun_args="",
        timeout=a.timeout,
        out=str(tmp / f"vit-b-{'compiled' if compiled else 'eager'}"),
    )
    rc = bench_train.run(ns)
    rows = []
    for row in json.loads((Path(ns.out) / "train.json").read_text())["rows"]:
        mfu = row.get("mfu")
        rows.append(
            {
                "check": f"ViT-B/16 224 bf16 {row['engine']}{' compiled' if compiled else ''}",
                "exit": rc,
                "ok": "error" not in row,
                "detail": row.get("error")
                or f"{row['images_per_s']:.1f} images/s, {row['ratio']:.3f} of the plain loop, MFU "
                + (f"{100 * mfu:.1f}%" if mfu is not None else "-"),
            }
        )
    return rows


def common(a, steps: int, log_interval: int = 1, monitor: bool = True) -> list:
    """vit_digits on 64 synthetic images (2 steps an epoch): a loss that falls within a few dozen
    steps (on the digits it stays near ln 10 for the first hundred)."""
    return [
        "--device",
        a.device,
        "--dataset",
        "synthetic",
        "--synthetic-size",
        64,
        "--steps",
        steps,
        "--log-interval",
        log_interval,
        "--eval-interval",
        0,
        "--no-save",
        *(["--monitor-interval", 0] if monitor else []),
    ]


def last_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def table(result: dict) -> str:
    lines = [
        f"GPU acceptance on {result['device']} ({result['host']}), torch {result['torch']}, "
        f"deepspeed "
        f"{result['deepspeed']}; load {result['load_avg_before']} -> "
        f"{result['load_avg_after']}",
        "",
        "| check | result | detail |",
        "| --- | --- | --- |",
    ]
    for row in result["rows"]:
        verdict = {True: "pass", False: "FAIL", None: "not run"}[row["ok"]]
        lines.append(f"| {row['check']} | {verdict} | {row['detail']} |")
    return "\n".join(lines) + "\n"


def run(a) -> int:
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "bench gpu: no CUDA device here; --device cpu runs the checks that mean something "
            "on a CPU"
        )
    a.checks = a.checks or list(CHECKS if a.device == "cuda" else CPU_CHECKS)
    if a.device == "cpu" and set(a.checks) - set(CPU_CHECKS):
        sys.exit(
            f"bench gpu: --checks {','.join(sorted(set(a.checks) - set(CPU_CHECKS)))} need a "
            f"GPU; on a CPU "
            f"only {','.join(CPU_CHECKS)} run"
        )
    import deepspeed

    result = {
        "benchmark": "gpu",
        "device": device_name(),
        "host": os.uname().nodename,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "load_avg_before": load_avg(),
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(a.out) / "logs" if a.out else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        # written after each, so a run stopped part way still leaves its report
        for name in a.checks:
            result["rows"] += CHECKS[name](a, logs)
            result["load_avg_after"] = load_avg()
            publish(a.out, "gpu", result, table(result), quiet=name != a.checks[-1])
    return 1 if any(row["ok"] is False for row in result["rows"]) else 0


CHECKS = {
    "local-steps": diloco_runs,  # first: DiLoCo, which no GPU has run with more than one rank
    "engines": engine_runs,
    "overflow": lambda a, logs: [overflow_run(a, logs)],
    "syncs": sync_runs,
    "micro-batch": micro_batch_runs,
    "throughput": throughput,
    "compiled": lambda a, logs: throughput(a, logs, compiled=True),
    "freeze": freeze_and_monitor_runs,
}
# the others measure what only a GPU has: stream syncs, device memory, NVML
CPU_CHECKS = ("local-steps", "engines", "overflow")


def check_list(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown check {unknown[0]!r}; choose from {','.join(CHECKS)}"
        )
    return names


def add_arguments(t) -> None:
    t.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: only the engine runs and the overflow check (the rest needs a GPU)",
    )
    t.add_argument("--steps", type=positive_int, default=30, help="steps of each engine run")
    t.add_argument(
        "--vit-b-batch", type=positive_int, default=128, help="global batch of the ViT-B/16 runs"
    )
    t.add_argument("--timeout", type=float, default=600, help="seconds before one run is killed")
    t.add_argument(
        "--checks",
        type=check_list,
        help="comma-separated, run in this order (default: "
        "all on a GPU; "
        f"{','.join(CPU_CHECKS)} with --device cpu): {','.join(CHECKS)}",
    )
    t.add_argument(
        "--out",
        help="folder for gpu.md, gpu.json and every run's logs/; the report is "
        "rewritten "
        "after each check",
    )


COMMANDS = {"gpu": (__doc__.split("\n\n")[0], add_arguments, run)}
