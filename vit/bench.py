"""Benchmarks: training speed of every engine against a plain PyTorch loop, and all-reduce bandwidth.

    python -m vit.bench train [--model M --global-batch B --ranks N --engines ddp,zero1,...] [--fused-adam] [--out DIR]
    mpirun -np N python -m vit.bench allreduce [--max-bytes 64M] [--out DIR]
    python -m vit.bench peak        # measure this machine's GEMM FLOP/s (for a CPU's entry in PEAK_TFLOPS)

Speed targets are judged in docs/benchmarks.md from real runs, never in the tests.
"""
import argparse
import json
import os
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from vit.metrics import peak_mem_gib, write_json
from vit.model import PRESETS, build_layers, loss_fn
from vit.settings import ROOT, defaults

CONFIGS = ROOT / "deepspeed_configs"
ENGINES = ("ddp", "zero0", "zero1", "zero2", "zero3", "pipeline")

# Peak dense TFLOP/s of one device: (a substring of its name, {precision: TFLOP/s}); the first match wins.
# GPUs: vendor specs without sparsity; bf16/fp16 are tensor-core rates with FP32 accumulate (what autocast and
# DeepSpeed use; GeForce cards run FP16-accumulate at twice that), fp32 is the non-tensor rate (PyTorch leaves
# TF32 off for matmuls). CPUs: measured with `python -m vit.bench peak` (a GEMM on all cores), not specs.
PEAK_TFLOPS = [
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),  # SXM5
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6}),
    ("RTX 3090", {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6}),
    ("RTX 3070", {"bf16": 40.6, "fp16": 40.6, "fp32": 20.3}),
    # The 2-core KVM VM of docs/benchmarks.md (Zen 4: family 25 model 17, AVX-512 with bf16): the best of
    # `python -m vit.bench peak --size 1024` at load 0.6 (fp32 0.178, bf16 0.428; 2048^3 gives 0.15-0.16 and 0.40-0.42).
    ("AMD EPYC (2 cores)", {"bf16": 0.43, "fp32": 0.18}),
]


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU")
    return f"{model} ({os.cpu_count()} cores)"


def peak_tflops(name: str, precision: str) -> float | None:
    return next((peaks.get(precision) for key, peaks in PEAK_TFLOPS if key in name), None)


def flops_per_image(model: nn.Module, img_size: int) -> float:
    """Forward FLOPs of one image; attention through the math kernel, whose matmuls the counter sees."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    x = torch.randn(1, 3, img_size, img_size, device=next(model.parameters()).device)
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(x)
    return float(counter.get_total_flops())


def publish(out: str | None, name: str, result: dict, table: str) -> None:
    """Print a benchmark's markdown table; with --out also write it as NAME.md and the numbers as NAME.json."""
    print(table)
    if out:
        os.makedirs(out, exist_ok=True)
        write_json(os.path.join(out, f"{name}.json"), result)
        Path(out, f"{name}.md").write_text(table)


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


class OthersCpu:
    """Cores kept busy by other processes (and other VMs' steal) while a row ran: the machine's busy time from
    /proc/stat less this process's and its children's CPU time. On a shared machine it says which rows to trust."""

    def __init__(self):
        self.start = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float]:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]  # user .. steal
        busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
        own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for f in ("ru_utime", "ru_stime"))
        return time.perf_counter(), busy, own

    def cores(self) -> float:
        (t0, busy0, own0), (t1, busy1, own1) = self.start, self._now()
        return round(max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0), 2)


# ---------------------------------------------------------------------------------------------- train

def run_reference(a, train_args, dev: torch.device) -> dict:
    """The plain loop: nn.Sequential of the same layers, the trainer's AdamW and schedule, data in memory."""
    from vit.optim import make_optimizer, make_scheduler

    img = PRESETS[a.model].img_size
    model = nn.Sequential(*build_layers(a.model, 10, 3, img, train_args.seed)).to(dev)
    opt = make_optimizer(model, train_args.optim)
    sched = make_scheduler(opt, train_args.optim, a.warmup + a.steps)
    clip = json.loads((CONFIGS / "zero0.json").read_text()).get("gradient_clipping", 0.0)  # as the engines do
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.global_batch, 3, img, img, generator=g).to(dev)
    y = (torch.arange(a.global_batch) % 10).to(dev)
    step_model = torch.compile(model) if a.compile else model
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")

    def step():
        with autocast:
            loss = loss_fn(step_model(x), y)
        loss.backward()
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

    for _ in range(a.warmup):
        step()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    windows, done, others = [], 0, OthersCpu()  # step time per window of --warmup steps, as vit.train logs them
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
    return {"engine": "reference" + (" (compiled)" if a.compile else ""), "ranks": 1,
            "layout": f"{a.global_batch} x 1 x 1", "step_time_s": step_s, "images_per_s": a.global_batch / step_s,
            "peak_mem_gib": peak_mem_gib(dev), "others_cores": others.cores()}


def engine_args(name: str, a) -> tuple[list[str], str]:
    """vit.train options of one engine at the global batch, and its layout (micro-batch x accum x data-parallel)."""
    if name == "pipeline":
        stages = a.pipeline_stages or a.ranks
        if a.ranks % stages:
            sys.exit(f"vit.bench: --pipeline-stages {stages} does not divide --ranks {a.ranks}")
        dp = a.ranks // stages
        chunks = json.loads((CONFIGS / "pipeline.json").read_text())["gradient_accumulation_steps"]
        opts = ["--engine", "pipeline", "--pipeline-stages", stages, "--ds-config", CONFIGS / "pipeline.json"]
    else:
        dp, chunks = a.ranks, 1
        config = "zero0.json" if name == "ddp" else f"{name}.json"
        opts = ["--engine", "ddp" if name == "ddp" else "zero", "--ds-config", CONFIGS / config]
    if a.global_batch % (chunks * dp):
        sys.exit(f"vit.bench: {name}: global batch {a.global_batch} is not divisible by {chunks} micro-batches "
                 f"x data-parallel size {dp}")
    micro = a.global_batch // (chunks * dp)
    return [*opts, "--micro-batch-size", micro, "--grad-accum", chunks], f"{micro} x {chunks} x {dp}"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mpirun_train(train: list, ranks: int, log_dir: Path, timeout: float, mpirun_args: str = "") -> int | str:
    """`mpirun -np ranks ./entry_cn.sh TRAIN...`, its output in LOG_DIR/output.log; the exit code, or why it
    was killed."""
    mpirun = [str(ROOT / "scripts" / "mpirun"), "-np", str(ranks), "--oversubscribe", *shlex.split(mpirun_args)]
    with open(log_dir / "output.log", "w") as out:
        p = subprocess.Popen([*mpirun, str(ROOT / "entry_cn.sh"), *map(str, train)], cwd=ROOT, stdout=out,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return f"timed out after {timeout} s"


def failure_tail(log_dir: Path) -> str:
    return f"{log_dir / 'output.log'} ends:\n  " + "\n  ".join((log_dir / "output.log").read_text().splitlines()[-5:])


def median_step_s(log_dir: Path, warmup: int) -> float:
    """Rank 0's median step time over the metric windows after the first (warm-up) one: a burst of load from
    other processes on a shared machine skews one window, not all."""
    records = [r for r in read_jsonl(log_dir / "metrics_rank0.jsonl") if r["kind"] == "train"]
    return statistics.median(r["step_time_s"] for r in records if r["step"] > warmup)


def run_engine(name: str, a, log_dir: Path) -> dict:
    """One real multi-process run of vit.train under mpirun; the median step time of the records after the first
    (warm-up) window, so that a burst of load from other processes on a shared machine skews one window, not all."""
    opts, layout = engine_args(name, a)
    train = [*opts, "--model", a.model, "--dataset", "synthetic", "--synthetic-size", max(2048, a.global_batch),
             "--steps", a.warmup + a.steps, "--log-interval", a.warmup, "--no-save", "--monitor-interval", 0,
             "--log-dir", log_dir]
    if a.precision != "fp32":
        train += ["--precision", a.precision]
    if a.fused_adam:
        train.append("--fused-adam")
    shutil.rmtree(log_dir, ignore_errors=True)  # vit.train appends to its metrics files
    log_dir.mkdir(parents=True)
    row = {"engine": name, "ranks": a.ranks, "layout": layout}
    others = OthersCpu()
    rc = mpirun_train(train, a.ranks, log_dir, a.timeout, a.mpirun_args)
    row["others_cores"] = others.cores()  # over the whole run, start-up included
    if rc != 0 or not (log_dir / "summary.json").exists():
        print(f"vit.bench: {name} failed ({rc}); {failure_tail(log_dir)}", file=sys.stderr)
        return {**row, "error": f"exit {rc}"}
    step_s = median_step_s(log_dir, a.warmup)
    summary = json.loads((log_dir / "summary.json").read_text())
    return {**row, "step_time_s": step_s, "images_per_s": a.global_batch / step_s,
            "peak_mem_gib": summary["peak_mem_gib"]}


def combine(runs: list[dict]) -> dict:
    """One row from the --repeat runs of an engine: the fastest (other processes only ever slow a run down)."""
    failed = [r for r in runs if "error" in r]
    return failed[0] if failed else min(runs, key=lambda r: r["step_time_s"])


def train_table(result: dict) -> str:
    r = result
    lines = [
        f"{r['model']}, global batch {r['global_batch']}, {r['precision']}, {r['steps']} timed steps after "
        f"{r['warmup']} warm-up; step time: the median over windows of {r['warmup']} steps, the fastest of "
        f"{r['repeat']} interleaved repeats; AdamW {'fused' if r['fused_adam'] else 'torch default'}; "
        f"{r['device']}, reference on {r['reference_threads']} threads; "
        f"{r['flops_per_image'] / 1e9:.3f} GFLOP/image forward (x3 to train); peak {r['peak_tflops'] or '?'} "
        f"TFLOP/s per device; others: CPU cores busy with other processes during that run ({r['cpus']} CPUs; "
        f"1-minute load average {r['load_avg_before']} before, {r['load_avg_after']} after)",
        "",
        "| engine | ranks | micro x accum x dp | images/s | step ms | peak mem GiB/rank | MFU % | ratio to ref "
        "| others |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in r["rows"]:
        if "error" in row:
            lines.append(f"| {row['engine']} | {row['ranks']} | {row['layout']} | failed: {row['error']} | | | | | "
                         f"{row['others_cores']} |")
            continue
        mfu = f"{100 * row['mfu']:.1f}" if row.get("mfu") is not None else "-"
        lines.append(f"| {row['engine']} | {row['ranks']} | {row['layout']} | {row['images_per_s']:.1f} | "
                     f"{1e3 * row['step_time_s']:.1f} | {row['peak_mem_gib']:.2f} | {mfu} | {row['ratio']:.3f} | "
                     f"{row['others_cores']} |")
    return "\n".join(lines) + "\n"


def train(a) -> int:
    if a.model not in PRESETS:
        sys.exit(f"vit.bench: unknown model '{a.model}'; choose one of: {', '.join(PRESETS)}")
    engines = [e for e in a.engines.split(",") if e]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        sys.exit(f"vit.bench: unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    if a.compile:
        print("vit.bench: --compile applies to the reference only; the engines run as vit.train runs them",
              file=sys.stderr)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = device_name()
    peak = a.peak_tflops or peak_tflops(name, a.precision)
    if peak is None:
        print(f"vit.bench: no peak FLOP/s for '{name}' in PEAK_TFLOPS ({a.precision}); MFU left out. Measure one "
              "with `python -m vit.bench peak` and pass --peak-tflops", file=sys.stderr)
    # The trainer's defaults (lr, weight decay, warm-up, seed), and its optimizer choice
    train_args = defaults().with_(model=a.model, fused_adam=a.fused_adam)
    before = load_avg()
    img = PRESETS[a.model].img_size
    flops = flops_per_image(nn.Sequential(*build_layers(a.model, 10, 3, img)), img)
    runs = []  # reference, engines, reference, engines, ...: --repeat rounds
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(a.out) / "logs" if a.out else Path(tmp)
        for rep in range(a.repeat):
            runs.append(run_reference(a, train_args, dev))
            if dev.type == "cuda":  # hand the reference's memory back before the engines start on the same GPU
                torch._dynamo.reset()
                torch.cuda.empty_cache()
            for engine in engines:
                runs.append(run_engine(engine, a, logs / (engine if a.repeat == 1 else f"{engine}.{rep + 1}")))
            for run in runs[-1 - len(engines):]:
                print(f"{run['engine']}: " + (run.get("error") or f"{run['images_per_s']:.1f} images/s"), flush=True)
    rows = [combine([r for r in runs if r["engine"] == e]) for e in [runs[0]["engine"], *engines]]
    # On a GPU every rank has its own device; CPU ranks share the cores of one machine, whose peak is the table's.
    for row in rows:
        if "error" not in row:
            devices = row["ranks"] if dev.type == "cuda" else 1
            row["ratio"] = row["images_per_s"] / rows[0]["images_per_s"]
            row["mfu"] = row["images_per_s"] * 3 * flops / (peak * 1e12 * devices) if peak else None
    result = {"benchmark": "train", "model": a.model, "global_batch": a.global_batch, "precision": a.precision,
              "steps": a.steps, "warmup": a.warmup, "ranks": a.ranks, "device": name, "host": socket.gethostname(),
              "cpus": os.cpu_count(),
              "peak_tflops": peak, "flops_per_image": flops, "torch": torch.__version__, "compile": a.compile,
              "fused_adam": a.fused_adam, "reference_threads": torch.get_num_threads(),
              "repeat": a.repeat, "load_avg_before": before, "load_avg_after": load_avg(), "rows": rows,
              "runs": runs}
    publish(a.out, "train", result, train_table(result))
    return 1 if any("error" in r for r in rows) else 0


# ------------------------------------------------------------------------------------------ allreduce

def parse_bytes(text: str) -> int:
    units = {"": 1, "K": 2**10, "KIB": 2**10, "M": 2**20, "MIB": 2**20, "G": 2**30, "GIB": 2**30}
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    if not digits.isdigit() or t[len(digits):] not in units:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 65536, 64K, 64M, 1G)")
    size = int(digits) * units[t[len(digits):]]
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: a message is float32s, so its size must be a positive "
                                         "multiple of 4 bytes")
    return size


def iterations(n: int, size: int) -> int:
    return max(1, min(n, 2**30 // size))  # at most 1 GiB per size and phase: big messages stay quick on a CPU


def time_torch(size: int, a, dev) -> float:
    import torch.distributed as dist

    world = dist.get_world_size()
    check = torch.full((size // 4,), float(dist.get_rank() + 1), device=dev)
    dist.all_reduce(check)
    if not torch.all(check == world * (world + 1) / 2):
        raise RuntimeError(f"all_reduce of {size} bytes gave a wrong sum")
    buf = torch.zeros(size // 4, device=dev)
    for _ in range(iterations(a.warmup, size)):
        dist.all_reduce(buf)
    n = iterations(a.iters, size)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(buf)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def time_mpi(size: int, a) -> float:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    send, recv = np.full(size // 4, comm.rank + 1, np.float32), np.empty(size // 4, np.float32)
    comm.Allreduce(send, recv, op=MPI.SUM)
    if not np.all(recv == comm.size * (comm.size + 1) / 2):
        raise RuntimeError(f"MPI Allreduce of {size} bytes gave a wrong sum")
    for _ in range(iterations(a.warmup, size)):
        comm.Allreduce(send, recv, op=MPI.SUM)
    n = iterations(a.iters, size)
    comm.Barrier()
    start = MPI.Wtime()
    for _ in range(n):
        comm.Allreduce(send, recv, op=MPI.SUM)
    return (MPI.Wtime() - start) / n


def allreduce_table(r: dict) -> str:
    ways = [w for w in ("torch", "mpi") if w in r["rows"][0]]
    names = {"torch": f"torch.distributed ({r['backend']})", "mpi": "MPI (mpi4py, host memory)"}
    link = r.get("link_gbps")
    per_way = " time us | algbw GB/s | busbw GB/s |" + (" busbw / link |" if link else "")
    head = "| bytes |" + "".join(f" {names[w]}{per_way}" for w in ways)
    link_note = (f"; busbw / link = busbw x 8 / {link:g} Gbit/s (TCP over 1500-byte frames carries at most 0.94-0.96 "
                 "of a link)" if link else "")
    lines = [f"all-reduce, float32 sum, {r['world_size']} ranks on {r['placement']}; algbw = bytes / time, "
             f"busbw = algbw x 2(n-1)/n = algbw x {r['bus_factor']:.3f}{link_note}; time = slowest rank's mean; "
             f"load average {r['load_avg_before']} -> {r['load_avg_after']}", "", head,
             "| ---: |" + (" ---: |" * per_way.count("|")) * len(ways)]
    for row in r["rows"]:
        cells = ""
        for w in ways:
            cells += f" {1e6 * row[w]['time_s']:.1f} | {row[w]['algbw_gbps']:.3f} | {row[w]['busbw_gbps']:.3f} |"
            if link:
                cells += f" {row[w]['busbw_gbps'] * 8 / link:.2f} |"
        lines.append(f"| {row['bytes']} |{cells}")
    return "\n".join(lines) + "\n"


def allreduce(a) -> int:
    import torch.distributed as dist

    from vit.dist_env import MPI_LAUNCHERS, device, discover, init_process_group, resolve_master

    if a.link_gbps is not None and not a.link_gbps > 0:
        print(f"vit.bench: --link-gbps must be a positive rate in Gbit/s, got {a.link_gbps}", file=sys.stderr)
        return 2
    job = resolve_master(discover())
    if a.no_torch and (a.no_mpi or job.launcher not in MPI_LAUNCHERS):
        print("vit.bench: --no-torch leaves nothing to time without MPI (run under mpirun, without --no-mpi)",
              file=sys.stderr)
        return 2
    dev = device(job)
    max_bytes = a.max_bytes or (256 * 2**20 if dev.type == "cuda" else 64 * 2**20)
    sizes, size = [], a.min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    if not sizes:
        sys.exit(f"vit.bench: --min-bytes {a.min_bytes} is above the largest size, {max_bytes}")
    backend = init_process_group(job, a.timeout)
    world = job.world_size
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    placement = " ".join(f"{h}:{n}" for h, n in Counter(hosts).items())
    use_mpi = job.launcher in MPI_LAUNCHERS and not a.no_mpi
    factor = 2 * (world - 1) / world
    before, rows = load_avg(), []
    for size in sizes:
        row = {"bytes": size}
        timings = {} if a.no_torch else {"torch": time_torch(size, a, dev)}
        if use_mpi:
            timings["mpi"] = time_mpi(size, a)
        for way, t in timings.items():
            slowest = torch.tensor([t], dtype=torch.float64, device=dev)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            t = slowest.item()
            row[way] = {"time_s": t, "algbw_gbps": size / t / 1e9, "busbw_gbps": size / t / 1e9 * factor}
        rows.append(row)
        if job.is_main:
            print(f"{size} bytes done", file=sys.stderr, flush=True)
    result = {"benchmark": "allreduce", "backend": backend, "world_size": world, "placement": placement,
              "bus_factor": factor, "link_gbps": a.link_gbps, "device": device_name(), "load_avg_before": before,
              "load_avg_after": load_avg(), "rows": rows}
    if job.is_main:
        publish(a.out, "allreduce", result, allreduce_table(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------- peak

def peak(a) -> int:
    """GEMM throughput of this device, for PEAK_TFLOPS where no vendor figure applies (a CPU)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"{device_name()}, {torch.get_num_threads()} threads, load average {load_avg()}")
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = torch.randn(a.size, a.size, device=dev, dtype=dtype)
        best = float("inf")
        for _ in range(a.repeats):  # the best of several: other processes only ever slow it down
            if dev.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            x @ x
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        print(f"{precision}: {2 * a.size**3 / best / 1e12:.4f} TFLOP/s ({a.size}^3 GEMM, best of {a.repeats})")
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except where there is none to show."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == "":
            return action.help
        return super()._get_help_string(action)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vit.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, formatter_class=_Help, help=text, description=text)

    t = command("train", "images/s, step time, peak memory and MFU of each engine (real mpirun runs of vit.train) "
                "and their ratio to a plain single-process PyTorch loop, at one global batch")
    t.add_argument("--model", default="vit_tiny_cifar", help="one of: " + ", ".join(PRESETS))
    t.add_argument("--global-batch", type=int, default=64, help="images per optimizer step, for every engine")
    t.add_argument("--ranks", type=int, default=2, help="processes per engine run (mpirun -np)")
    t.add_argument("--steps", type=int, default=20, help="timed steps")
    t.add_argument("--warmup", type=int, default=5, help="untimed steps before them; also the window whose median "
                   "step time is reported")
    t.add_argument("--repeat", type=int, default=1, help="rounds of reference + engines, interleaved; each row "
                   "reports its fastest")
    t.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast in the "
                   "reference, vit.train --precision bf16 in the engines")
    t.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, from: " + ", ".join(ENGINES))
    t.add_argument("--pipeline-stages", type=int, help="pipeline stages (default: --ranks, one data-parallel copy)")
    t.add_argument("--compile", action="store_true", help="torch.compile the reference (the engines are not "
                   "compiled)")
    t.add_argument("--fused-adam", action="store_true", help="torch's fused AdamW in the reference and in every "
                   "engine (vit.train --fused-adam)")
    t.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device (default: from PEAK_TFLOPS)")
    t.add_argument("--mpirun-args", default="", help="extra mpirun arguments, e.g. '--hostfile setup/hosts.txt'")
    t.add_argument("--timeout", type=float, default=1800, help="seconds before an engine run is killed")
    t.add_argument("--out", help="folder for train.md, train.json and each engine's logs/")
    r = command("allreduce", "all-reduce time, algbw and busbw per message size through torch.distributed "
                "and, under mpirun, MPI (mpi4py); run it as mpirun -np N python -m vit.bench allreduce")
    r.add_argument("--min-bytes", type=parse_bytes, default=1024, help="smallest message; sizes double from here")
    r.add_argument("--max-bytes", type=parse_bytes, help="largest message (default 256M on a GPU, 64M on a CPU)")
    r.add_argument("--iters", type=int, default=20, help="timed iterations per size (fewer where they would "
                   "move more than 1 GiB)")
    r.add_argument("--warmup", type=int, default=5, help="untimed iterations per size")
    r.add_argument("--no-mpi", action="store_true", help="torch.distributed only")
    r.add_argument("--no-torch", action="store_true", help="MPI only (torch.distributed still gathers the results): "
                   "time each without the other's processes in the way, e.g. MPI's busy-polling on shared cores")
    r.add_argument("--link-gbps", type=float, help="the rate of each host's link in Gbit/s (1 for 1 GbE): adds a "
                   "busbw / link column, the share of the link that the all-reduce uses")
    r.add_argument("--timeout", type=float, default=300, help="seconds before a collective fails")
    r.add_argument("--out", help="folder for allreduce.md and allreduce.json")
    k = command("peak", "GEMM TFLOP/s of this machine in fp32 and bf16, the best of --repeats (for a CPU's entry "
                "in PEAK_TFLOPS)")
    k.add_argument("--size", type=int, default=2048, help="side of the square matrices")
    k.add_argument("--repeats", type=int, default=10, help="GEMMs timed; the fastest counts")
    a = p.parse_args(argv)
    for name in ("global_batch", "ranks", "steps", "warmup", "repeat", "iters", "pipeline_stages", "size", "repeats"):
        if getattr(a, name, None) is not None and getattr(a, name) <= 0:
            sys.exit(f"vit.bench: --{name.replace('_', '-')} must be positive")
    return {"train": train, "allreduce": allreduce, "peak": peak}[a.command](a)


if __name__ == "__main__":
    sys.exit(main())
