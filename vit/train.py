"""Train a ViT: validate everything, start the process group, build the engine, train, evaluate, summarise.

Run through ./entry_cn.sh (under mpirun, srun, torchrun or directly); `--help` lists the options.
"""
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vit import checkpoint
from vit.config import (
    ROOT,
    Batch,
    ConfigError,
    check_precision,
    parse_args,
    precision_of,
    resolve_ds_config,
    zero_stage,
)
from vit.data import DataSplit, TrainBatches, eval_batches, load_dataset, make_loader, steps_per_epoch
from vit.dist_env import DistEnv, device, discover, init_process_group, resolve_master
from vit.engines import EngineContext, build
from vit.metrics import MetricsLog, log_line, peak_mem_gib, progress, write_json
from vit.model import PRESETS, build_layers, check_img_size


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
    resume: tuple[str, str] | None


def make_plan(argv) -> Plan:
    args = parse_args(argv)
    env = discover()
    ds_config, batch = resolve_ds_config(args, env.world_size)
    precision = precision_of(ds_config)
    check_precision(precision)
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
    resume = None
    if args.resume == "auto":
        if not save_dir:
            raise ConfigError("--resume needs the run's --log-dir (or --save-dir), or --resume PATH")
        resume = checkpoint.locate(save_dir)
    elif args.resume:
        resume = checkpoint.locate(args.resume)
    resolve_master(env)
    return Plan(args, env, ds_config, batch, precision, data, total_steps, save_dir, resume)


def shared_log_dir(plan: Plan) -> str:
    """The run folder; the default name is rank 0's clock, so it is broadcast."""
    name = [plan.args.log_dir or os.path.join(ROOT, "logs", f"{plan.args.engine}-{time.strftime('%Y%m%d-%H%M%S')}")]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def run(plan: Plan, start_time: float) -> None:
    args, env, batch = plan.args, plan.env, plan.batch
    init_process_group(env, args.dist_timeout)
    dev = device(env)
    log_dir = shared_log_dir(plan)
    save_dir = plan.save_dir or os.path.join(log_dir, "checkpoints")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

    data = plan.data
    layers = build_layers(args.model, data.num_classes, data.in_chans, data.img_size, args.seed)
    engine = build(args.engine, EngineContext(args, layers, plan.ds_config, batch, dev, plan.total_steps,
                                              plan.precision))
    start = engine.load(*plan.resume)["step"] if plan.resume else 0
    total = plan.total_steps
    main = env.is_main
    if main:
        os.makedirs(log_dir, exist_ok=True)
        write_json(os.path.join(log_dir, "config.json"), {
            "args": vars(args), "deepspeed": plan.ds_config, "precision": plan.precision,
            "world_size": env.world_size, "launcher": env.launcher, "master": f"{env.master_addr}:{env.master_port}",
            "global_batch": batch.global_size, "data_parallel_size": batch.dp_size, "total_steps": total})
        print(f"{args.engine}: {args.model} on {args.dataset} ({len(data.train)} train / {len(data.test)} held-out), "
              f"{env.world_size} ranks, {plan.precision}; global batch {batch.global_size} = micro-batch "
              f"{batch.micro} x grad accum {batch.grad_accum} x data-parallel {batch.dp_size}; "
              f"{steps_per_epoch(len(data.train), batch.global_size)} steps/epoch; steps {start + 1}..{total}"
              f"{' (resumed from ' + plan.resume[1] + ')' if plan.resume else ''}", flush=True)
    metrics = MetricsLog(log_dir, env.rank)
    pin = dev.type == "cuda"

    def evaluate(step: int) -> tuple[float, float]:
        lists = eval_batches(len(data.test), batch.micro, engine.dp_rank, engine.dp_size)
        batches = make_loader(data.test, lists, args.workers, pin) if engine.reads_data else [(None, None)] * len(lists)
        loss_sum, correct, count = engine.evaluate(batches)
        eval_loss, top1 = loss_sum / count, correct / count
        metrics.write("eval", step, eval_loss=eval_loss, top1=top1)
        if main:
            print(f"eval at step {step}: loss {eval_loss:.4f} | top-1 {100 * top1:.2f}% ({correct}/{count})",
                  flush=True)
        return eval_loss, top1

    def save(step: int) -> None:
        engine.save(save_dir, checkpoint.tag_for(step), {"step": step, "engine": args.engine})

    sampler = TrainBatches(len(data.train), batch.micro, batch.grad_accum, engine.dp_rank, engine.dp_size,
                           args.seed, start, total)
    batches = iter(make_loader(data.train, sampler, args.workers, pin)) if engine.reads_data else None
    loss_value, saved_step = float("nan"), start
    train_start = window_start = time.perf_counter()
    window_steps = 0
    for step in range(start + 1, total + 1):
        lr = engine.lr
        loss = engine.train_step(batches)
        window_steps += 1
        if step % args.log_interval == 0 or step == total:
            loss_value = loss.item()  # the only host sync of the step, on logging steps only
            now = time.perf_counter()
            step_time = (now - window_start) / window_steps
            ips, mem = batch.global_size / step_time, peak_mem_gib(dev)
            metrics.write("train", step, loss=loss_value, lr=lr, images_per_s=ips, step_time_s=step_time, mem_gib=mem)
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
        }
        write_json(os.path.join(log_dir, "summary.json"), summary)
        print(f"done: {total} steps in {summary['wall_s']:.1f} s, top-1 {100 * top1:.2f}%, "
              f"logs in {log_dir}", flush=True)
    metrics.close()
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    start_time = time.time()
    try:
        plan = make_plan(argv)
    except (ConfigError, ValueError) as e:
        print(f"entry_cn.sh: error: {e}", file=sys.stderr)
        return 2
    run(plan, start_time)
    return 0


if __name__ == "__main__":
    sys.exit(main())
