"""Mixed GPUs: what every rank can do and how fast it is (the census), the precision all of them can run,
the fp16 loss scale, pipeline stages balanced by speed and memory, and data-parallel batches split by speed.

The planning functions (negotiate, balanced_split, proportional_split, scale_power) are pure, so they are
tested against brute force; census() and probe_grad_max() are the collective, measuring parts.
"""
import copy
import itertools
import json
import math
import os
import socket
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist
from torch import nn

from vit.errors import ConfigError
from vit.slowdown import Clock

FP16_MAX = 65504.0
SCALE_MARGIN = 16  # --loss-scale auto leaves the largest probed gradient this far below FP16_MAX
BYTES_PER_PARAM = 16  # fp32 weights, gradients and two AdamW moments; or half weights + grads + fp32 master
USABLE_MEMORY = 0.9  # plans leave 10% of the free memory for the allocator, workspaces and the unforeseen
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ------------------------------------------------------------------------------------------- census

def capabilities(dev: torch.device, local_world_size: int) -> dict:
    """This rank's device: name, memory, compute capability and what DeepSpeed says it can run.

    VIT_CENSUS_OVERRIDE (a JSON object) replaces fields of the report, so that tests can stand in for a GPU
    without bf16 on a machine that has none."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        free, total = torch.cuda.mem_get_info(dev)
        name, capability = props.name, f"{props.major}.{props.minor}"
    else:  # ranks on one host share its memory
        mem = psutil.virtual_memory()
        free, total = mem.available / local_world_size, mem.total / local_world_size
        name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                    "CPU")
        capability = None
    report = {"host": socket.gethostname(), "device": name, "capability": capability,
              "mem_total_gib": total / 2**30, "mem_free_gib": free / 2**30,
              "fp16": bool(acc.is_fp16_supported()), "bf16": bool(acc.is_bf16_supported())}
    override = os.environ.get("VIT_CENSUS_OVERRIDE")
    if override:
        try:
            report.update(json.loads(override))
        except (json.JSONDecodeError, TypeError, ValueError):
            raise ConfigError(f"VIT_CENSUS_OVERRIDE is not a JSON object: {override!r}") from None
    return report


def who(rank: int, report: dict) -> str:
    return f"rank {rank} ({report['host']}, {report['device']})"


def negotiate(requested: str, reports: list[dict]) -> tuple[str, str]:
    """(precision, why). 'auto': bf16 if every rank has it, else fp16, else fp32. An explicit precision that
    some rank lacks is an error naming those ranks."""
    def lacking(p):
        return [who(r, rep) for r, rep in enumerate(reports) if p != "fp32" and not rep[p]]

    if requested != "auto":
        missing = lacking(requested)
        if missing:
            every = [p for p in ("bf16", "fp16", "fp32") if not lacking(p)]
            raise ConfigError(f"precision {requested} is not supported by {', '.join(missing)}; every rank can run "
                              f"{', '.join(every)}: use --precision auto or one of those")
        return requested, "every rank supports it"
    why = []
    for p in ("bf16", "fp16"):
        missing = lacking(p)
        if not missing:
            return p, "; ".join([*why, f"every rank supports {p}"])
        why.append(f"no {p} on {', '.join(missing)}")
    return "fp32", "; ".join(why)


def _timed(fn, clock: Clock, reps: int = 5) -> float:
    """Fastest of `reps` runs of fn() after one warm-up, slowed like the rank's layers (in seconds; the
    fastest, because a busy host only ever slows a run down)."""
    fn()
    times = []
    for _ in range(reps):
        start = clock.now()
        clock.start()
        fn()
        clock.stop()
        times.append(clock.now() - start)
    return min(times)


def measure_speed(dev: torch.device, precision: str, block: nn.Module, micro: int, tokens: int, dim: int,
                  slowdown: float) -> dict:
    """A timed matmul and one timed forward and backward of a ViT block at the run's shapes."""
    dtype = DTYPES[precision]
    clock = Clock(slowdown, dev)
    n = 4096 if dev.type == "cuda" else 512
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    matmul_s = _timed(lambda: a @ b, clock)
    block = block.to(dev, dtype)
    x = torch.randn(micro, tokens, dim, device=dev, dtype=dtype, requires_grad=True)

    def step():
        block(x).float().sum().backward()

    block_s = _timed(step, clock)
    return {"matmul_tflops": 2 * n**3 / matmul_s / 1e12, "block_ms": 1e3 * block_s}


def gather(report: dict) -> list[dict]:
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports


def census_table(reports: list[dict], precision: str) -> str:
    lines = [f"census ({precision}; block: one forward and backward of a ViT block at the run's micro-batch)",
             f"{'rank':>4}  {'host':<12} {'device':<32} {'cc':>4} {'free/total GiB':>15} {'fp16':>4} {'bf16':>4} "
             f"{'matmul TFLOP/s':>14} {'block ms':>9}"]
    for r, rep in enumerate(reports):
        slow = f"  (slowed x{rep['slowdown']:g})" if rep["slowdown"] != 1 else ""
        lines.append(f"{r:>4}  {rep['host'][:12]:<12} {rep['device'][:32]:<32} {rep['capability'] or '-':>4} "
                     f"{rep['mem_free_gib']:>6.1f}/{rep['mem_total_gib']:<8.1f} {'yes' if rep['fp16'] else 'no':>4} "
                     f"{'yes' if rep['bf16'] else 'no':>4} {rep['matmul_tflops']:>14.3f} {rep['block_ms']:>9.2f}"
                     + slow)
    return "\n".join(lines)


# ------------------------------------------------------------------------------- per-layer profile

def profile_layers(layers: list[nn.Module], sample: torch.Tensor) -> list[dict]:
    """Per layer and per sample: forward FLOPs, bytes kept for backward (activations), parameter count."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    out, x = [], sample
    with torch.random.fork_rng():
        for layer in layers:
            own = {p.untyped_storage().data_ptr() for p in layer.parameters()}
            saved = {}

            def pack(t):
                s = t.untyped_storage()
                if s.data_ptr() not in own:
                    saved[s.data_ptr()] = s.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = layer(x)
            counter = FlopCounterMode(display=False)
            with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):  # the math kernel's matmuls are counted
                layer(x)
            out.append({"name": type(layer).__name__, "flops": counter.get_total_flops(),
                        "act_bytes": sum(saved.values()), "params": sum(p.numel() for p in layer.parameters())})
            x = y.detach().requires_grad_()
    return out


# --------------------------------------------------------------------------- balanced pipeline stages

@dataclass
class StagePlan:
    parts: list[int]  # stage s holds layers parts[s]:parts[s+1] (PipelineModule's convention)
    times: list[float]  # predicted seconds per micro-batch, forward and backward
    mems: list[float]  # predicted bytes
    speed: list[float] | None = None  # FLOP/s of each stage (set by plan_stages)


def _stage(s, i, j, cost, static, act, speed, inflight):
    return sum(cost[i:j]) / speed[s], sum(static[i:j]) + sum(act[i:j]) * inflight[s]


def balanced_split(cost: list[float], static: list[float], act: list[float], speed: list[float],
                   capacity: list[float], inflight: list[int]) -> StagePlan | None:
    """The contiguous split of layers into len(speed) non-empty stages that minimises the slowest stage's time
    (sum of its layers' cost / its speed) with every stage's memory (static + act x inflight) within its
    capacity; None when no split fits. Exact dynamic programming over the end of each stage."""
    n, stages = len(cost), len(speed)
    best = {(0, 0): (0.0, None)}  # (stages used, layers placed) -> (slowest time so far, previous cut)
    for s in range(stages):
        for j in range(s + 1, n - (stages - s - 1) + 1):
            options = []
            for i in range(s, j):
                if (s, i) not in best:
                    continue
                t, m = _stage(s, i, j, cost, static, act, speed, inflight)
                if m <= capacity[s]:
                    options.append((max(best[(s, i)][0], t), i))
            if options:
                best[(s + 1, j)] = min(options)
    if (stages, n) not in best:
        return None
    parts = [n]
    for s in range(stages, 0, -1):
        parts.append(best[(s, parts[-1])][1])
    parts.reverse()
    stats = [_stage(s, parts[s], parts[s + 1], cost, static, act, speed, inflight) for s in range(stages)]
    return StagePlan(parts, [t for t, _ in stats], [m for _, m in stats])


def brute_force_split(cost, static, act, speed, capacity, inflight) -> StagePlan | None:
    """Every contiguous split, for testing balanced_split."""
    n, stages, found = len(cost), len(speed), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        parts = [0, *cuts, n]
        stats = [_stage(s, parts[s], parts[s + 1], cost, static, act, speed, inflight) for s in range(stages)]
        if all(m <= capacity[s] for s, (_, m) in enumerate(stats)):
            slowest = max(t for t, _ in stats)
            if found is None or slowest < max(found.times):
                found = StagePlan(parts, [t for t, _ in stats], [m for _, m in stats])
    return found


def pipeline_inflight(stages: int, micro_batches: int) -> list[int]:
    """Micro-batches whose activations stage s holds at once under DeepSpeed's 1F1B schedule."""
    return [max(1, min(stages - s, micro_batches)) for s in range(stages)]


def plan_stages(profile: list[dict], reports: list[dict], stages: int, micro: int, micro_batches: int,
                precision: str) -> StagePlan:
    """Stage s runs on ranks s*dp .. s*dp+dp-1 (DeepSpeed's pipe-major rank order): its speed is their slowest,
    its capacity their smallest free memory. Costs are FLOPs; a rank's speed is one block's FLOPs over its
    measured block time."""
    dp = len(reports) // stages
    groups = [reports[s * dp:(s + 1) * dp] for s in range(stages)]
    block_flops = max(p["flops"] for p in profile)
    speed = [block_flops / max(r["block_ms"] / 1e3 for r in g) for g in groups]  # FLOP/s at this micro-batch
    half = 0.5 if precision in ("fp16", "bf16") else 1.0
    cost = [p["flops"] for p in profile]
    static = [p["params"] * BYTES_PER_PARAM for p in profile]
    act = [p["act_bytes"] * micro * half for p in profile]
    capacity = [USABLE_MEMORY * min(r["mem_free_gib"] for r in g) * 2**30 for g in groups]
    plan = balanced_split(cost, static, act, speed, capacity, pipeline_inflight(stages, micro_batches))
    if plan is None:
        need = (sum(static) + sum(act)) / stages / 2**30
        raise ConfigError(f"--partition balanced: no split of the {len(profile)} layers into {stages} stages fits "
                          f"in the ranks' free memory (at least {need:.2f} GiB per stage on average, smallest "
                          f"free {min(capacity) / 2**30:.2f} GiB usable); use more stages or a smaller micro-batch")
    plan.speed = speed
    return plan


def stage_plan_text(plan: StagePlan, profile: list[dict], reports: list[dict], compare: dict[str, list[int]]) -> str:
    stages = len(plan.times)
    dp = len(reports) // stages
    lines = ["pipeline plan (--partition balanced): layer costs are FLOPs, speeds and free memory from the census"]
    for s in range(stages):
        i, j = plan.parts[s], plan.parts[s + 1]
        names = ", ".join(f"{n} x{len(list(g))}" for n, g in itertools.groupby(p["name"] for p in profile[i:j]))
        hosts = ", ".join(f"rank {r} ({reports[r]['host']})" for r in range(s * dp, (s + 1) * dp))
        lines.append(f"  stage {s} on {hosts}: layers {i}-{j - 1} ({names}); predicted "
                     f"{1e3 * plan.times[s]:.2f} ms per micro-batch, {plan.mems[s] / 2**30:.3f} GiB")
    for name, parts in compare.items():
        slowest = max(sum(p["flops"] for p in profile[parts[s]:parts[s + 1]]) / plan.speed[s] for s in range(stages))
        lines.append(f"  slowest stage {1e3 * max(plan.times):.2f} ms; with --partition {name} (layers "
                     f"{parts}) it would be {1e3 * slowest:.2f} ms")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ proportional batches

def proportional_split(total: int, speed: list[float], cap: list[int]) -> list[int]:
    """`total` samples over the ranks in proportion to speed, each at least 1 and at most its cap.

    Ranks that hit their cap keep it and the rest is shared by the others in proportion; integers by the
    largest remainders."""
    n = len(speed)
    if sum(cap) < total or min(cap) < 1:
        raise ValueError(f"cannot place {total} samples within the per-rank limits {cap}")
    capped: dict[int, int] = {}
    while True:
        free = [r for r in range(n) if r not in capped]
        left = total - sum(capped.values())
        share = {r: left * speed[r] / sum(speed[q] for q in free) for r in free}
        over = [r for r in free if share[r] > cap[r]]
        if not over:
            break
        capped.update({r: cap[r] for r in over})
    sizes = {**capped, **{r: max(1, math.floor(share[r])) for r in free}}
    by_remainder = sorted(free, key=lambda r: share[r] - math.floor(share[r]), reverse=True)
    while sum(sizes.values()) != total:
        step = 1 if sum(sizes.values()) < total else -1
        for r in by_remainder if step > 0 else reversed(by_remainder):
            if sum(sizes.values()) != total and 1 <= sizes[r] + step <= cap[r]:
                sizes[r] += step
    return [sizes[r] for r in range(n)]


def split_batches(profile: list[dict], reports: list[dict], micro: int, precision: str) -> list[int]:
    """Per-rank micro-batch for --batch-split proportional: the data-parallel total micro x ranks shared in
    proportion to the measured block speed, within each rank's free memory."""
    half = 0.5 if precision in ("fp16", "bf16") else 1.0
    static = sum(p["params"] for p in profile) * BYTES_PER_PARAM
    per_sample = sum(p["act_bytes"] for p in profile) * half
    caps = [int((USABLE_MEMORY * r["mem_free_gib"] * 2**30 - static) // per_sample) for r in reports]
    total = micro * len(reports)
    if sum(caps) < total or min(caps) < 1:
        worst = min(range(len(reports)), key=lambda r: caps[r])
        raise ConfigError(f"--batch-split proportional: the ranks' free memory holds {max(0, sum(caps))} samples at "
                          f"once, fewer than the {total} of a micro-step ({who(worst, reports[worst])} fits "
                          f"{max(0, caps[worst])}); lower --micro-batch-size")
    return proportional_split(total, [1 / r["block_ms"] for r in reports], caps)


# ------------------------------------------------------------------------------------ fp16 loss scale

class GradPeak:
    """The largest |gradient| seen: every layer's output (hooked in backward) and the parameters (read())."""

    def __init__(self, layers: list[nn.Module], dev: torch.device):
        self.value = torch.zeros((), device=dev)
        self.handles = [layer.register_forward_hook(self._watch) for layer in layers]

    def keep(self, grad: torch.Tensor) -> None:
        self.value.copy_(torch.maximum(self.value, grad.detach().abs().max().float()))

    def _watch(self, module, inputs, output):
        if output.requires_grad:
            output.register_hook(self.keep)

    def read(self, model: nn.Module) -> torch.Tensor:
        """Fold in the parameters' gradients; the peak so far."""
        for p in model.parameters():
            if p.grad is not None:
                self.keep(p.grad)
        return self.value

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def probe_grad_max(layers: list[nn.Module], batches, dev: torch.device, grad_accum: int) -> float:
    """The largest |gradient| of fp32 forward and backward passes of (loss / grad_accum), over the parameters
    and every layer's output, on this rank's real batches; the maximum over all ranks."""
    from vit.model import loss_fn

    model = nn.Sequential(*layers).to(dev)
    peak = GradPeak(layers, dev)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        for x, y in batches:
            (loss_fn(model(x.to(dev)), y.to(dev)) / grad_accum).backward()
            peak.read(model)
            model.zero_grad(set_to_none=True)
    peak.remove()
    dist.all_reduce(peak.value, op=dist.ReduceOp.MAX)
    return peak.value.item()


def scale_power(grad_max: float) -> int:
    """The largest initial_scale_power with grad_max x 2^power x SCALE_MARGIN below the fp16 limit (0..32)."""
    if not math.isfinite(grad_max):
        raise ConfigError(f"--loss-scale auto: the fp32 probe's gradients are not finite ({grad_max}); lower --lr "
                          "or check the data")
    if grad_max == 0:
        return 16
    return max(0, min(32, math.floor(math.log2(FP16_MAX / (grad_max * SCALE_MARGIN)))))



# ------------------------------------------------------------------------------------------ the plan

@dataclass
class Adapted:
    """What the census decided for this run; `record` is cluster.json."""
    precision: str
    loss_weight: float = 1.0
    split: list[int] | None = None  # every data-parallel rank's micro-batch
    parts: list[int] | None = None  # pipeline stage boundaries
    record: dict | None = None


def adapt(args, env, batch, ds_config: dict, requested: str, layers: list[nn.Module], data, dev: torch.device,
          start_step: int, slowdowns: dict[int, float]) -> Adapted:
    """Collective, before the engine is built: the census, the precision, the stage plan or batch split, the fp16
    loss scale; ds_config gets the precision and the scale. Rank 0 prints each decision."""
    from deepspeed.runtime import utils as ds_utils

    from vit.config import set_precision
    from vit.data import TrainBatches, make_loader
    from vit.model import PRESETS

    caps = gather(capabilities(dev, env.local_world_size))
    precision, why = negotiate(requested, caps)
    set_precision(ds_config, precision)
    factor = slowdowns.get(env.rank, 1.0)
    preset = PRESETS[args.model]
    tokens = (data.img_size // preset.patch_size) ** 2 + 1
    for turn in range(env.world_size):  # one rank at a time: ranks that share a host's cores would slow each other
        if turn == env.rank:
            speed = measure_speed(dev, precision, copy.deepcopy(layers[1]), batch.micro, tokens, preset.embed_dim,
                                  factor)
        dist.barrier()
    reports = gather({**caps[env.rank], **speed, "slowdown": factor})
    out = Adapted(precision)
    record = {"census": reports, "precision": precision, "precision_why": why}
    say = [census_table(reports, precision), f"precision {precision}: {why}"]

    if args.partition == "balanced" or args.batch_split == "proportional":
        profile = profile_layers(layers, data.train[0][0][None])
        record["layers"] = profile
    if args.engine == "pipeline" and args.partition == "balanced":
        stages = args.pipeline_stages
        plan = plan_stages(profile, reports, stages, batch.micro, batch.grad_accum, precision)
        compare = {"parameters": ds_utils.partition_balanced([p["params"] for p in profile], stages),
                   "uniform": ds_utils.partition_uniform(len(profile), stages)}
        compare = {k: [int(i) for i in v] for k, v in compare.items()}
        out.parts = plan.parts
        record["stages"] = {"parts": plan.parts, "predicted_s": plan.times, "predicted_bytes": plan.mems,
                            "compare": compare}
        say.append(stage_plan_text(plan, profile, reports, compare))
    if args.batch_split == "proportional":
        out.split = split_batches(profile, reports, batch.micro, precision)
        out.loss_weight = out.split[env.rank] * len(out.split) / sum(out.split)
        record["batch_split"] = out.split
        say.append(f"batch split (proportional to block speed): micro-batches {out.split} (sum "
                   f"{sum(out.split)} = {batch.micro} x {len(out.split)} ranks)")

    if args.loss_scale == "auto":
        if precision == "fp16":
            dp = batch.dp_size
            probe = TrainBatches(len(data.train), batch.micro, batch.grad_accum, env.rank % dp, dp, args.seed,
                                 start_step, start_step + 2)
            grad_max = probe_grad_max(layers, make_loader(data.train, probe, 0, False), dev, batch.grad_accum)
            power = scale_power(grad_max)
            ds_config["fp16"]["initial_scale_power"] = power
            record["loss_scale"] = {"probe_grad_max": grad_max, "initial_scale_power": power}
            say.append(f"fp16 loss scale: largest gradient of a {2 * batch.grad_accum}-micro-batch fp32 probe "
                       f"{grad_max:.3g} -> initial_scale_power {power} (2^{power} x {grad_max:.3g} x margin "
                       f"{SCALE_MARGIN} < {FP16_MAX:g})")
        else:
            say.append(f"--loss-scale auto: nothing to tune in {precision}")
    if factor != 1:
        from vit.slowdown import attach

        for layer in layers:
            attach(layer, factor, dev)
    if env.is_main:
        print("\n".join(say), flush=True)
    out.record = record
    return out
