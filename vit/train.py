"""Train a ViT: validate everything, start the process group, build the engine, train, evaluate, summarise.

Run through ./entry_cn.sh (under mpirun, srun, torchrun or directly); `--help` lists the options.
"""
import hashlib
import json
import logging
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from vit import checkpoint, hetero, preflight, slowdown
from vit.config import (
    ROOT,
    Batch,
    ConfigError,
    parse_args,
    precision_of,
    resolve_ds_config,
    zero_stage,
)
from vit.data import DataSplit, TrainBatches, eval_batches, load_dataset, make_loader, steps_per_epoch
from vit.dist_env import DistEnv, device, discover, init_process_group, resolve_master
from vit.engines import EngineContext, build
from vit.faults import Watchdog, announce_failure, failure_elsewhere
from vit.metrics import MetricsLog, log_line, peak_mem_gib, progress, write_json
from vit.model import PRESETS, build_layers, check_img_size
from vit.monitor import Monitor, gpu_util_mean_per_host


@dataclass
class Plan:
    """Everything decided before any process group starts."""
    args: object
    env: DistEnv
    ds_config: dict
    batch: Batch
    precision: str
    data: DataSplit
    total_steps: int
    save_dir: str | None
    resume: tuple[str, list[str]] | None  # (save dir, candidate tags, newest first)
    layout: dict  # what a checkpoint must match to be resumed by this run
    slowdowns: dict  # --simulate-slowdown: rank -> factor


def make_plan(argv) -> Plan:
    args = parse_args(argv)
    env = discover()
    ds_config, batch = resolve_ds_config(args, env.world_size)
    precision = "auto" if args.precision == "auto" else precision_of(ds_config)  # every rank's say: hetero.adapt
    slowdowns = slowdown.parse(args.simulate_slowdown, env.world_size)
    preset = PRESETS[args.model]
    data = load_dataset(args.dataset, args.data_path, args.img_size or preset.img_size, args.download,
                        args.synthetic_size, args.seed)
    if args.img_size and args.img_size != data.img_size:
        raise ConfigError(f"--img-size {args.img_size} does not match the {data.img_size}x{data.img_size} "
                          f"images of {args.dataset}")
    check_img_size(args.model, data.img_size)
    if args.engine == "pipeline" and args.pipeline_stages > preset.depth + 2:
        raise ConfigError(f"--pipeline-stages {args.pipeline_stages} exceeds the {preset.depth + 2} layers of "
                          f"{args.model} (embedding, {preset.depth} blocks, head)")
    per_epoch = steps_per_epoch(len(data.train), batch.global_size)
    if per_epoch == 0:
        raise ConfigError(f"global batch {batch.global_size} is larger than the {len(data.train)} training "
                          f"samples of {args.dataset}")
    total_steps = args.steps or max(1, round(args.epochs * per_epoch))
    save_dir = args.save_dir or (os.path.join(args.log_dir, "checkpoints") if args.log_dir else None)
    layout = {"engine": args.engine, "world_size": env.world_size, "data_parallel_size": batch.dp_size,
              "pipeline_stages": args.pipeline_stages if args.engine == "pipeline" else 1,
              "zero_stage": zero_stage(ds_config) if args.engine != "ddp" else 0}
    resume = None
    if args.resume == "auto" and not save_dir:
        raise ConfigError("--resume needs the run's --log-dir (or --save-dir), or --resume PATH")
    if args.resume:
        resume = checkpoint.locate(save_dir if args.resume == "auto" else args.resume)
        for tag in resume[1]:  # the newest readable manifest says how the run was laid out
            try:
                saved = checkpoint.read_manifest(resume[0], tag)
            except (OSError, ValueError):
                continue
            checkpoint.check_layout(saved, layout, f"checkpoint {resume[0]}/{tag}")
            break
    resolve_master(env)
    return Plan(args, env, ds_config, batch, precision, data, total_steps, save_dir, resume, layout, slowdowns)


def config_hash(plan: Plan) -> str:
    a = plan.args
    what = {"model": a.model, "dataset": a.dataset, "img_size": a.img_size, "seed": a.seed, "lr": a.lr,
            "min_lr": a.min_lr, "weight_decay": a.weight_decay, "deepspeed": plan.ds_config}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def resume_tag(plan: Plan) -> str:
    """Rank 0 verifies the candidates' manifests and picks the newest sound one; all ranks get it."""
    answer = [None]
    if plan.env.is_main:
        try:
            answer[0] = checkpoint.choose(*plan.resume)
        except checkpoint.CheckpointError as e:
            answer[0] = e
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], Exception):
        raise answer[0]
    return answer[0]


def shared_log_dir(plan: Plan) -> str:
    """The run folder; the default name is rank 0's clock, so it is broadcast."""
    name = [plan.args.log_dir or os.path.join(ROOT, "logs", f"{plan.args.engine}-{time.strftime('%Y%m%d-%H%M%S')}")]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def run(plan: Plan, start_time: float) -> None:
    """Train; any failure on any rank ends every rank, non-zero, naming the rank that failed."""
    init_process_group(plan.env, plan.args.dist_timeout)
    watchdog = Watchdog(plan.env.rank, plan.args.dist_timeout)
    watchdog.start()
    try:
        train(plan, start_time, watchdog)
    except Exception as e:
        elsewhere = failure_elsewhere()
        if elsewhere is None:
            if not isinstance(e, ConfigError):  # a preflight finding needs no traceback
                traceback.print_exc()
            message = f"rank {plan.env.rank} ({socket.gethostname()}) failed at step {watchdog.step}: {e}"
            announce_failure(message)
        else:
            message = f"rank {plan.env.rank} ({socket.gethostname()}) stops: {elsewhere}"
        print(message, file=sys.stderr, flush=True)
        os._exit(1)  # not through atexit: DeepSpeed and MPI would wait on the ranks that are gone
    watchdog.stop()
    dist.destroy_process_group()


class NonFiniteLoss(RuntimeError):
    pass


def alive(batches, watchdog: Watchdog):
    """The batches, telling the watchdog of progress at each one."""
    for b in batches:
        watchdog.beat()
        yield b


def train(plan: Plan, start_time: float, watchdog: Watchdog) -> None:
    args, env, batch = plan.args, plan.env, plan.batch
    preflight.check(env.world_size, args.hostfile)
    dev = device(env)
    log_dir = shared_log_dir(plan)
    save_dir = plan.save_dir or os.path.join(log_dir, "checkpoints")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

    data = plan.data
    settings_hash = config_hash(plan)  # the user's settings, before the census fills in precision and loss scale
    start, resumed_from = 0, None
    if plan.resume:
        resumed_from = resume_tag(plan)
        saved = checkpoint.read_manifest(plan.resume[0], resumed_from)
        start = saved["step"]
    layers = build_layers(args.model, data.num_classes, data.in_chans, data.img_size, args.seed)
    hw = hetero.adapt(args, env, batch, plan.ds_config, plan.precision, layers, data, dev, start, plan.slowdowns)
    plan.precision = hw.precision
    engine = build(args.engine, EngineContext(args, layers, plan.ds_config, batch, dev, plan.total_steps,
                                              plan.precision, hw.loss_weight, hw.parts))
    if plan.resume:
        if saved.get("config_hash") != settings_hash and env.is_main:
            print(f"warning: {resumed_from} was written with other settings (model, data, optimizer or "
                  "DeepSpeed config) than this run", flush=True)
        start = checkpoint.load(engine, plan.resume[0], resumed_from)["step"]
    total = plan.total_steps
    main = env.is_main
    if main:
        os.makedirs(log_dir, exist_ok=True)
        write_json(os.path.join(log_dir, "cluster.json"), hw.record)
        write_json(os.path.join(log_dir, "config.json"), {
            "args": vars(args), "deepspeed": plan.ds_config, "precision": plan.precision,
            "world_size": env.world_size, "launcher": env.launcher, "master": f"{env.master_addr}:{env.master_port}",
            "global_batch": batch.global_size, "data_parallel_size": batch.dp_size, "total_steps": total})
        print(f"{args.engine}: {args.model} on {args.dataset} ({len(data.train)} train / {len(data.test)} held-out), "
              f"{env.world_size} ranks, {plan.precision}; global batch {batch.global_size} = micro-batch "
              f"{batch.micro} x grad accum {batch.grad_accum} x data-parallel {batch.dp_size}; "
              f"{steps_per_epoch(len(data.train), batch.global_size)} steps/epoch; steps {start + 1}..{total}"
              f"{' (resumed from ' + resumed_from + ')' if resumed_from else ''}", flush=True)
    metrics = MetricsLog(log_dir, env.rank)
    # The driver (NVML, nvidia-smi) numbers GPUs unlike CUDA does; the UUID names this rank's GPU in both.
    monitor = Monitor(log_dir, env.rank, args.monitor_interval, args.monitor_backend,
                      gpu_indices=[str(torch.cuda.get_device_properties(dev).uuid)] if dev.type == "cuda" else None)
    monitor.start()
    pin = dev.type == "cuda"

    def evaluate(step: int) -> tuple[float, float]:
        lists = eval_batches(len(data.test), batch.micro, engine.dp_rank, engine.dp_size)
        batches = make_loader(data.test, lists, args.workers, pin) if engine.reads_data else [(None, None)] * len(lists)
        loss_sum, correct, count = engine.evaluate(alive(batches, watchdog))
        eval_loss, top1 = loss_sum / count, correct / count
        metrics.write("eval", step, eval_loss=eval_loss, top1=top1)
        if main:
            print(f"eval at step {step}: loss {eval_loss:.4f} | top-1 {100 * top1:.2f}% ({correct}/{count})",
                  flush=True)
        return eval_loss, top1

    def save(step: int) -> None:
        watchdog.beat()
        checkpoint.save(engine, save_dir, step, {"step": step, "engine": args.engine},
                        {**plan.layout, "config_hash": settings_hash}, args.keep_checkpoints)

    sampler = TrainBatches(len(data.train), batch.micro, batch.grad_accum, engine.dp_rank, engine.dp_size,
                           args.seed, start, total, hw.split)
    my_micro = hw.split[engine.dp_rank] if hw.split else batch.micro
    batches = iter(make_loader(data.train, sampler, args.workers, pin)) if engine.reads_data else None
    loss_value, saved_step = float("nan"), start
    # fp16 overflows are DeepSpeed's (or the GradScaler's) to skip; any other non-finite loss stops the run.
    # The first bad step is kept on the device and read on logging steps, to add no host sync per step.
    check_finite = plan.precision != "fp16"
    first_bad_step = torch.zeros((), dtype=torch.long, device=dev)
    skipped_in_a_row, skipped_before = 0, engine.skipped_steps
    train_start = window_start = time.perf_counter()
    window_steps, phase_totals = 0, {}
    for step in range(start + 1, total + 1):
        lr = engine.lr
        loss = engine.train_step(batches)
        watchdog.beat(step)
        monitor.step = step
        window_steps += 1
        if check_finite:
            first_bad_step.masked_fill_((first_bad_step == 0) & ~torch.isfinite(loss.to(dev)), step)
        else:
            skipped_in_a_row = skipped_in_a_row + 1 if engine.skipped_steps > skipped_before else 0
            skipped_before = engine.skipped_steps
            if skipped_in_a_row:  # every skip, as it happens
                metrics.write("skip", step, skipped_steps=engine.skipped_steps, in_a_row=skipped_in_a_row)
                if main:
                    print(f"step {step}: fp16 gradients overflowed, step skipped ({engine.skipped_steps} so far)",
                          flush=True)
            if skipped_in_a_row > args.max_skipped_steps:
                raise NonFiniteLoss(f"fp16: {skipped_in_a_row} overflow-skipped steps in a row up to step {step}; "
                                    "lower initial_scale_power in the DeepSpeed config or use bf16")
        if step % args.log_interval == 0 or step == total:
            # The only host sync and the only collective of our own per step, on logging steps only.
            loss_value = engine.mean_loss(loss).item()
            if check_finite and first_bad_step.item():
                raise NonFiniteLoss(f"the loss became non-finite at step {first_bad_step.item()} (now "
                                    f"{loss_value}); lower --lr, or resume from an earlier checkpoint")
            now = time.perf_counter()
            step_time = (now - window_start) / window_steps
            ips, mem = batch.global_size / step_time, peak_mem_gib(dev)
            phases = engine.breakdown(window_steps)
            for phase, seconds in phases.items():
                phase_totals[phase] = phase_totals.get(phase, 0.0) + seconds * window_steps
            metrics.write("train", step, loss=loss_value, lr=lr, images_per_s=ips, step_time_s=step_time, mem_gib=mem,
                          rank_images_per_s=my_micro * batch.grad_accum / step_time,
                          skipped_steps=engine.skipped_steps, **phases)
            if main:
                if sys.stderr.isatty():
                    sys.stderr.write("\r")
                print(log_line(step, total, loss_value, lr, ips, step_time, mem), flush=True)
            window_start, window_steps = time.perf_counter(), 0
        if main:
            progress(step, total)
        if args.eval_interval and step % args.eval_interval == 0 and step != total:
            evaluate(step)
        if not args.no_save and args.save_interval and step % args.save_interval == 0:
            save(step)
            saved_step = step
    train_s = time.perf_counter() - train_start

    eval_loss, top1 = evaluate(total)
    if not args.no_save and saved_step != total:
        save(total)
    peak = torch.tensor([peak_mem_gib(dev)], device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    monitor.stop()
    monitors = [None] * env.world_size
    dist.all_gather_object(monitors, monitor.summary())
    if main:
        summary = {
            "engine": args.engine, "model": args.model, "dataset": args.dataset, "precision": plan.precision,
            "zero_stage": zero_stage(plan.ds_config) if args.engine != "ddp" else None,
            "pipeline_stages": args.pipeline_stages if args.engine == "pipeline" else None,
            "world_size": env.world_size, "data_parallel_size": batch.dp_size, "micro_batch": batch.micro,
            "grad_accum": batch.grad_accum, "global_batch": batch.global_size, "steps": total,
            "steps_this_run": total - start, "final_loss": loss_value, "eval_loss": eval_loss, "top1": top1,
            "images_per_s": (total - start) * batch.global_size / train_s if total > start else None,
            "train_s": train_s, "wall_s": time.time() - start_time, "peak_mem_gib": peak.item(),
            "breakdown": {k: v / max(1, total - start) for k, v in phase_totals.items()},
            "monitor": monitors, "gpu_util_mean_per_host": gpu_util_mean_per_host(monitors),
        }
        write_json(os.path.join(log_dir, "summary.json"), summary)
        print(f"done: {total} steps in {summary['wall_s']:.1f} s, top-1 {100 * top1:.2f}%, "
              f"logs in {log_dir}", flush=True)
    metrics.close()
    dist.barrier()


def main(argv=None) -> int:
    start_time = psutil.Process().create_time()  # wall time includes the imports
    try:
        plan = make_plan(argv)
    except (ConfigError, ValueError) as e:
        print(f"entry_cn.sh: error: {e}", file=sys.stderr)
        return 2
    run(plan, start_time)
    return 0


if __name__ == "__main__":
    sys.exit(main())
