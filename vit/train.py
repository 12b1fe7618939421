"""Train a ViT: plan everything, start the process group, build the engine, train, evaluate, summarise.
Run through ./entry_cn.sh (under mpirun, srun, torchrun or directly); `--help` lists the options."""
import copy
import gc
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from vit.config.cli import PROG, parse
from vit.config.ds_config import with_precision
from vit.config.plan import Plan, choose_resume, make_plan, with_auto_choice, with_micro_batch
from vit.data.augment import train_batches
from vit.data.datasets import TrainBatches, loader_workers, make_loader
from vit.engines import Engine, EngineContext, build
from vit.core.layout import Layout
from vit.engines.registry import spec
from vit.core.errors import ConfigError, NonFiniteLoss, NothingToDo, OutOfMemory
from vit.freeze import activation_cache, replan
from vit.freeze.freezer import Freezer
from vit.planner import fit, oom
from vit.planner.survey import Adapted, adapt, time_each_rank
from vit.loop import checkpoint
from vit.loop.ema import Ema
from vit.loop.evaluate import Evaluator
from vit.loop.stats import StepStats
from vit.model import weights
from vit.model.layers import build_layers
from vit.planner import auto as auto_engine
from vit.runtime import console, plugins, preflight, slowdown
from vit.runtime.dist_env import device, discover, end_process_group, init_process_group, rank0_decides, rank_cores
from vit.runtime.faults import Watchdog, announce_failure
from vit.runtime.gpu import set_tf32
from vit.config.rundir import RunLock, agree_log_dir, lock_run_dirs
from vit.telemetry import tracking
from vit.telemetry.metrics import MetricsLog, peak_mem_gib
from vit.telemetry.monitor import Monitor
from vit.config.records import start_record, write_summary


def prepare_environment() -> None:
    """Before DeepSpeed is imported: where it builds its ops, and with which ninja."""
    # DeepSpeed JIT-builds small ops (the CPU shared-memory comm op, CPU Adam) into this cache. Its key includes
    # the interpreter's path, so two environments sharing one cache rebuild each other's ops.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    # torch builds them with the first `ninja` on PATH. The venv's ninja (pip) and the system's write .ninja_log hashes
    # the other cannot read: with and without the venv on PATH, each run rebuilt the op (a minute of CPU); the venv's.
    bin_dir = os.path.dirname(sys.executable)
    if os.path.isfile(os.path.join(bin_dir, "ninja")) and not os.environ.get("PATH", "").startswith(bin_dir):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


@dataclass
class Session:
    """A run once its engine is built: what the loop and the finish need."""
    engine: Engine
    log_dir: str
    start_step: int
    precision: str
    ds_config: dict
    batches: Iterator | None
    stats: StepStats
    evaluator: Evaluator
    checkpointer: checkpoint.Checkpointer
    metrics: MetricsLog
    monitor: Monitor
    locks: list[RunLock]  # the run's folders, held until the process ends
    freezer: Freezer
    make_batches: Callable  # (engine, start step) -> this rank's batches from the next step on

    def swap(self, engine: Engine, step: int) -> None:  # --freeze rebuilt the engine, maybe with another layout
        self.engine, self.batches = engine, self.make_batches(engine, step)  # the rest take the engine at each call


def train(plan: Plan, start_time: float, watchdog: Watchdog) -> None:
    run = setup(plan, watchdog)
    for step in range(run.start_step + 1, plan.total_steps + 1):
        lr = run.engine.lr
        loss = run.engine.train_step(run.batches)
        watchdog.beat(step)
        run.monitor.step = step
        if run.engine.ema is not None:
            run.engine.ema.update(run.engine, step)
        run.stats.record(run.engine, step, loss, lr)
        if run.stats.should_log(step):
            run.stats.log(run.engine, step)
        with run.stats.paused():
            if (rebuilt := run.freezer.after_step(step, run.engine, run.metrics)) is not None:
                run.swap(rebuilt, step)
            run.evaluator.maybe(run.engine, step)
            run.checkpointer.save(run.engine, step)
    finish(plan, run, start_time)


def setup(plan: Plan, watchdog: Watchdog) -> Session:
    s, job, batch, factor = plan.settings, plan.job, plan.batch, plan.slowdowns.get(plan.job.rank, 1.0)
    preflight.check(job.world_size, s.cluster.hostfile)
    preflight.check_offload(plan.ds_config, job.device_type)
    dev = device(job)
    log_dir = agree_log_dir(plan)
    save_dir = plan.save_dir or os.path.join(log_dir, "checkpoints")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if job.is_main and plan.notes:
        print("\n".join(plan.notes), flush=True)
    start, resumed_from, frozen, layout, earlier = 0, None, 0, None, {}
    if plan.resume:
        resumed_from = rank0_decides(lambda: choose_resume(plan))
        manifest = checkpoint.read_manifest(plan.resume.save_dir, resumed_from)
        start, freeze_state = manifest["step"], manifest.get("freeze") or {"frozen": 0}
        earlier = {k: manifest[k] for k in ("train_s", "segments") if k in manifest}  # older ones: this run's alone
        frozen, layout = freeze_state["frozen"], freeze_state.get("layout")
    data = plan.data
    layers = weights.initial_layers(s.model.model, data.num_classes, data.in_chans, data.img_size, s.train.seed,
                                    s.model.drop_path, None if plan.resume else s.model.pretrained_path)
    ema_layers = copy.deepcopy(layers) if s.recipe.model_ema else None  # before ZeRO-3 partitions them
    if (tf32 := set_tf32(dev, s.parallel.tf32 == "on")) and job.is_main:  # before the census: it times fp32 as trained
        print(tf32, flush=True)
    adapted = adapt_to_cluster(plan, dev, layers, start)
    slowdown.attach_all(layers, factor, dev)
    locks = lock_run_dirs(log_dir, save_dir, s.checkpoint.no_save)
    hidden_to = console.to_file(log_dir, job.rank)
    ds_config = with_precision(plan.ds_config, adapted.precision, adapted.scale_power)

    def make_engine(layers: list, layout: Layout | None = None) -> Engine:  # layout: --freeze-replan's
        ctx = EngineContext(layers, ds_config, batch, dev, s.optim, plan.total_steps, adapted.precision,
                            s.parallel.pipeline_stages, s.parallel.partition, adapted.parts, adapted.loss_weight,
                            s.recipe.smoothing, s.asynchrony, s.parallel.compile, s.comm)
        with console.library_prints():
            return build(s.parallel.engine, replan.with_layout(ctx, layout) if layout else ctx)

    def fresh_layers() -> list:
        return build_layers(s.model.model, data.num_classes, data.in_chans, data.img_size, s.train.seed,
                            s.model.drop_path)
    freezer = Freezer(s.freeze, len(layers), plan.steps_per_epoch, plan.total_steps, dev, frozen=frozen,
                      make_layers=lambda: slowdown.attach_all(fresh_layers(), factor, dev), make_engine=make_engine,
                      cache_dir=activation_cache.directory(s, log_dir, job.rank), census=adapted.record,
                      micro_batch=batch.micro_batch, on_progress=watchdog.beat, time_layers=lambda: time_each_rank(
                          job, fresh_layers, data.train[0][0][None], batch.micro_batch, adapted.precision, dev, factor))
    freezer.freeze(layers, frozen)
    engine = make_engine(layers, Layout(**layout) if layout else None)
    if ema_layers:
        engine.ema = Ema(ema_layers, engine, s.recipe.model_ema_decay)
    if plan.resume:
        client_state = checkpoint.load(engine, plan.resume.save_dir, resumed_from)
        start = client_state["step"]
        if "freeze" in client_state:
            freezer.load_state_dict(client_state["freeze"])
    freezer.watch(engine, start)
    if job.is_main:
        start_record(log_dir, plan, ds_config=ds_config, precision=adapted.precision, cluster=adapted.record,
                     start_step=start, resumed_from=resumed_from)
        if console.where(hidden_to):
            print(console.where(hidden_to), flush=True)
    return session(plan, engine, watchdog, log_dir, save_dir, start, adapted, ds_config, locks, freezer, earlier)


def adapt_to_cluster(plan: Plan, dev: torch.device, layers: list, start_step: int) -> Adapted:
    """The census and the plans for mixed GPUs (vit.hetero), from this run's settings."""
    s, job, batch, data = plan.settings, plan.job, plan.batch, plan.data
    pipeline = spec(s.parallel.engine).pipeline

    def probe_batches():  # two steps of this rank's real batches, from where training starts
        probe = TrainBatches(len(data.train), batch.micro_batch, batch.grad_accum, job.rank % batch.dp_size,
                             batch.dp_size, s.train.seed, start_step, start_step + 2)
        return make_loader(data.train, probe, 0, False)

    return adapt(
        job, dev, layers, requested_precision=plan.requested_precision, engine=plan.engine,
        micro_batch=batch.micro_batch, grad_accum=batch.grad_accum, sample=data.train[0][0][None],
        balanced=plan.balanced_candidate(), proportional=s.parallel.batch_split == "proportional",
        probe_batches=probe_batches if s.parallel.loss_scale == "auto" else None,
        slowdown=plan.slowdowns.get(job.rank, 1.0), split=plan.micro_split, parts=plan.stage_parts,
        state_bytes=plan.state_bytes_per_param,
        reserved_bytes=plan.reserved_bytes(dev, plan.likely_precision(dev)),
        probe_on_cpu=pipeline or plan.layout["zero_stage"] == 3,
        profile_only=pipeline and s.freeze.freeze != "none" and s.freeze.freeze_replan == "on")


def session(plan: Plan, engine: Engine, watchdog: Watchdog, log_dir: str, save_dir: str, start: int,
            adapted: Adapted, ds_config: dict, locks: list[RunLock], freezer: Freezer, earlier: dict) -> Session:
    s, job, batch, data = plan.settings, plan.job, plan.batch, plan.data
    pin = engine.device.type == "cuda"
    # The driver (NVML, nvidia-smi) numbers GPUs unlike CUDA does; the UUID names this rank's GPU in both.
    gpus = [str(torch.cuda.get_device_properties(engine.device).uuid)] if engine.device.type == "cuda" else None
    monitor = Monitor(log_dir, job.rank, s.log.monitor_interval, s.log.monitor_backend, gpu_indices=gpus,
                      say=None if job.is_main or s.log.verbose else console.CAPTURE.add)
    monitor.start()
    metrics = tracking.metrics_log(log_dir, job.rank, s.log.report_to, monitor, start_step=start, verbose=s.log.verbose,
                                   charts=tracker_charts)
    my_micro = adapted.split[engine.dp_rank] if adapted.split else batch.micro_batch
    stats = StepStats(engine, metrics, global_batch=batch.global_size, rank_images=my_micro * batch.grad_accum,
                      total_steps=plan.total_steps, log_interval=s.log.log_interval, precision=adapted.precision,
                      max_skipped_steps=s.train.max_skipped_steps, is_main=job.is_main, earlier=earlier)
    workers = loader_workers(s.data.workers, engine.device.type, rank_cores(job.local_world_size))
    evaluator = Evaluator(data, micro_batch=batch.micro_batch, workers=workers, pin_memory=pin,
                          metrics=metrics, watchdog=watchdog, interval=s.train.eval_interval,
                          total_steps=plan.total_steps, is_main=job.is_main)
    checkpointer = checkpoint.Checkpointer(save_dir, interval=s.checkpoint.save_interval,
                                           enabled=not s.checkpoint.no_save, keep=s.checkpoint.keep_checkpoints,
                                           meta=plan.checkpoint_meta(), on_progress=watchdog.beat,
                                           extra_state=lambda: {**freezer.checkpoint_state(), **stats.train_time()})

    def make_batches(engine: Engine, start: int) -> Iterator | None:
        if not engine.reads_data:
            return None
        order = dict(micro_batch=batch.micro_batch, grad_accum=engine.grad_accum, dp_rank=engine.dp_rank,
                     dp_size=engine.dp_size, start_step=start, end_step=plan.total_steps, sizes=adapted.split)
        batches = train_batches(data, s.recipe, s.train.seed, workers=workers, pin_memory=pin,
                                labels_only=not engine.reads_images, cached=freezer.samples(engine, workers), **order)
        return freezer.cached(batches, TrainBatches(len(data.train), seed=s.train.seed, **order), engine)
    return Session(engine, log_dir, start, adapted.precision, ds_config, make_batches(engine, start), stats,
                   evaluator, checkpointer, metrics, monitor, locks, freezer, make_batches)


def finish(plan: Plan, run: Session, start_time: float) -> None:
    """The final evaluation and checkpoint, the monitors' summaries, and summary.json."""
    evaluation = run.evaluator.run(run.engine, plan.total_steps)
    run.checkpointer.save(run.engine, plan.total_steps, last_step=True)
    if plan.settings.model.export and (state := run.engine.export_state()) is not None:  # rank 0 holds the state
        weights.export(plan.settings.model.export, state, plan.settings.model.model, plan.data)
    peak = torch.tensor([peak_mem_gib(run.engine.device)], device=run.engine.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    run.monitor.stop()
    monitors = [None] * plan.job.world_size
    dist.all_gather_object(monitors, run.monitor.summary())
    if plan.job.is_main:
        write_summary(run.log_dir, plan, precision=run.precision, ds_config=run.ds_config, start_step=run.start_step,
                      totals=run.stats.totals(), evaluation=evaluation, peak_mem_gib=peak.item(), monitors=monitors,
                      start_time=start_time)
    run.metrics.close()
    dist.barrier()


def tracker_charts(log_dir: str) -> list:
    """The run's charts for the trackers (matplotlib is imported only by a run that reports to one)."""
    from vit.reports.charts import for_trackers

    return for_trackers(log_dir)


def choose_engine(plan: Plan, dev: torch.device) -> dict:
    """--engine auto: vit.planner.auto's choice for this run (collective)."""
    s = plan.settings
    return auto_engine.choose(plan.job, dev, plan.fresh_layers(s.model.drop_path), plan.sample, plan.batch,
                              plan.likely_precision(dev), s.parallel.engine, plan.slowdowns.get(plan.job.rank, 1.0),
                              s.comm.powersgd_rank)


def fit_micro_batch(plan: Plan, dev: torch.device) -> tuple[int, list[int] | None, dict]:
    """--micro-batch-size auto: vit.planner.fit's search for this run (collective)."""
    precision, batch = plan.likely_precision(dev), plan.batch
    return fit.fit_micro_batch(plan.job, dev, precision, upper=len(plan.data.train) // (batch.dp_size * batch.grad_accum),
                               dp_size=batch.dp_size, proportional=plan.settings.parallel.batch_split == "proportional",
                               autocast=plan.engine.autocast, layers=plan.fresh_layers, sample=plan.data.train[0][0],
                               per_param=plan.state_bytes_per_param(precision),
                               reserved=plan.reserved_bytes(dev, precision))


def out_of_memory(plan: Plan, dev: torch.device, step: int, error: Exception) -> OutOfMemory:
    """An out-of-memory error on this rank as one message (vit.planner.oom), with what this run would fit."""
    def estimated():
        return oom.estimate(dev, plan.job.local_world_size, lambda: plan.likely_precision(dev), plan.fresh_layers,
                            plan.sample, plan.state_bytes_per_param, lambda p: plan.reserved_bytes(dev, p),
                            plan.settings.parallel.engine)
    return oom.out_of_memory(error, dev, step, plan.batch, estimated)


def run(plan: Plan, start_time: float) -> int:
    """Train; any failure on any rank ends every rank, non-zero, naming the rank that failed."""
    try:  # every rank reaches the same verdict on the job's devices, so each stops alike
        init_process_group(plan.job, plan.settings.cluster.dist_timeout, plan.settings.cluster.device,
                           plan.requested_precision, plan.engine)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:  # a full GPU: NCCL's communicators did not fit
        if not oom.is_oom(e):
            raise
        print(f"rank {plan.job.rank} ({socket.gethostname()}) failed at start: "
              f"{oom.nccl_out_of_memory(device(plan.job), e)}", file=sys.stderr, flush=True)
        return 1
    watchdog = Watchdog(plan.job.rank, plan.settings.cluster.dist_timeout)
    watchdog.start()
    plugins.call("start", plan.job.rank, watchdog)
    try:
        if plan.auto is not None:  # --engine auto
            plan = with_auto_choice(plan, choose_engine(plan, device(plan.job)))
        if plan.settings.parallel.micro_batch_size == "auto":
            plan = with_micro_batch(plan, *fit_micro_batch(plan, device(plan.job)))
        train(plan, start_time, watchdog)
    except NothingToDo as e:  # decided on rank 0 before anything was written
        if plan.job.is_main:
            print(f"{PROG}: {e}", flush=True)
    except Exception as e:
        if oom.is_oom(e):
            e = out_of_memory(plan, device(plan.job), watchdog.step, e)
        if isinstance(e, ConfigError):  # a collective finding (preflight, census, lock): the same on every rank
            announce_failure(f"rank {plan.job.rank} ({socket.gethostname()}): {e}")
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
            os._exit(2)
        # os._exit, not through atexit: DeepSpeed and MPI would wait on the ranks that are gone
        watchdog.fail(e, explained=isinstance(e, (NonFiniteLoss, OutOfMemory, checkpoint.CheckpointError)))
    watchdog.stop()
    end_process_group()
    return 0


def main(argv=None) -> int:
    prepare_environment()
    gc.freeze()  # what exists now lives on: each --freeze rebuild's full collection skips it (300 ms -> 70 ms, CPU)
    start_time = psutil.Process().create_time()  # wall time includes the imports
    try:
        settings = parse(argv)
        console.capture(settings.log.verbose)  # before DeepSpeed is imported
        plugins.load()  # VIT_PLUGINS: the tests' fault injection
        plan = make_plan(settings, discover())
    except NothingToDo as e:
        print(f"{PROG}: {e}", flush=True)
        return 0
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return run(plan, start_time)


if __name__ == "__main__":
    sys.exit(main())
