"""The run's named parts, built once the process group runs, in the manner of torchtitan's Trainer:
where it resumes from (ResumePoint), the model's layers, the cluster survey (vit.planner.survey),
the engine factory (EngineFactory: the engine on given layers, at start and at every --freeze
rebuild), the freezer, and what the loop reads and writes (Trainer: batches, statistics, evaluation,
checkpoints, metrics, the monitor). vit.train's loop drives them."""

import contextlib
import copy
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from vit.checkpoints import checkpoint
from vit.core.layout import Layout
from vit.data.augment import train_batches
from vit.data.sampling import TrainBatches, loader_workers, make_loader
from vit.engines import Engine, EngineContext, build
from vit.freeze import activation_cache, replan
from vit.freeze.freezer import Freezer, RebuildParts
from vit.model import weights
from vit.planner.survey import Asked, Survey, survey, time_each_rank
from vit.run.ds_config import with_precision
from vit.run.plan import Plan, choose_resume, resume_notes
from vit.run.records import Measured, start_record, write_summary
from vit.run.rundir import RunLock, agree_log_dir, lock_run_dirs
from vit.runtime import console, preflight, slowdown
from vit.runtime.dist_env import device, rank0_decides, rank_cores
from vit.runtime.faults import Watchdog
from vit.runtime.gpu import set_tf32
from vit.telemetry import tracking
from vit.telemetry.metrics import MetricsLog, peak_mem_gib
from vit.telemetry.monitor import Monitor
from vit.training.ema import Ema
from vit.training.evaluate import Evaluator
from vit.training.stats import StepImages, StepStats


@dataclass(frozen=True)
class ResumePoint:
    """Where the run starts: step 0, or the checkpoint --resume continues (rank 0 verified it), with
    the frozen prefix and pipeline layout it had, and the training time of the runs before
    (summary.json adds them up)."""

    step: int = 0
    tag: str | None = None
    frozen: int = 0
    layout: Layout | None = None
    earlier: dict = field(default_factory=dict)

    @classmethod
    def of(cls, plan: Plan) -> "ResumePoint":
        """Collective where the run resumes: rank 0 chooses the checkpoint for every rank."""
        if not plan.resume:
            return cls()
        tag = rank0_decides(lambda: choose_resume(plan))
        manifest = checkpoint.read_manifest(plan.resume.save_dir, tag)
        state = manifest.get("freeze") or {"frozen": 0}
        earlier = {k: manifest[k] for k in ("train_s", "segments") if k in manifest}  # older: none
        layout = Layout(**state["layout"]) if state.get("layout") else None
        return cls(manifest["step"], tag, state["frozen"], layout, earlier)


@dataclass(frozen=True)
class EngineFactory:
    """The run's engine on given layers: at start and at every --freeze rebuild (with
    --freeze-replan's layout)."""

    name: str  # --engine
    context: EngineContext  # everything but the layers

    def __call__(self, layers: list, layout: Layout | None = None) -> Engine:
        ctx = replace(self.context, layers=layers)
        with console.library_prints():
            return build(self.name, replan.with_layout(ctx, layout) if layout else ctx)


def engine_factory(
    plan: Plan, dev: torch.device, surveyed: Survey, ds_config: dict
) -> EngineFactory:
    s = plan.settings
    context = EngineContext(
        layers=[],
        ds_config=ds_config,
        batch=plan.batch,
        device=dev,
        optim=s.optim,
        total_steps=plan.total_steps,
        precision=surveyed.precision,
        pipeline_stages=s.parallel.pipeline_stages,
        partition=s.parallel.partition,
        parts=surveyed.parts,
        loss_weight=surveyed.loss_weight,
        local_steps=surveyed.local_steps,
        smoothing=s.recipe.smoothing,
        compile=s.parallel.compile,
        settings=s,
    )
    return EngineFactory(s.parallel.engine, context)


def survey_cluster(plan: Plan, dev: torch.device, layers: list, start_step: int) -> Survey:
    """The census and the decisions it settles for this run (vit.planner.survey)."""
    s, job, batch, data = plan.settings, plan.job, plan.batch, plan.data
    pipeline = plan.engine.pipeline

    def probe_batches():  # two steps of this rank's real batches, from where training starts
        probe = TrainBatches(
            len(data.train),
            batch.micro_batch,
            batch.grad_accum,
            job.rank % batch.dp_size,
            batch.dp_size,
            s.train.seed,
            start_step,
            start_step + 2,
            sizes=plan.micro_split,
        )
        return make_loader(data.train, probe, 0, False)

    asked = Asked(
        requested_precision=plan.requested_precision,
        engine=plan.engine,
        micro_batch=batch.micro_batch,
        grad_accum=batch.grad_accum,
        sample=plan.sample,
        balanced=plan.balanced_candidate(),
        proportional=s.parallel.batch_split == "proportional",
        probe_batches=probe_batches if s.parallel.loss_scale == "auto" else None,
        slowdown=plan.slowdowns.get(job.rank, 1.0),
        split=plan.micro_split,
        parts=plan.stage_parts,
        **plan.engine.census_asks(s),
        state_bytes=plan.state_bytes_per_param,
        reserved_bytes=plan.reserved_bytes(dev, plan.likely_precision(dev)),
        probe_on_cpu=pipeline or plan.shape["zero_stage"] == 3,
        profile_only=pipeline and s.freeze.freeze != "none" and s.freeze.freeze_replan == "on",
    )
    return survey(job, dev, layers, asked)


def make_freezer(
    plan: Plan,
    dev: torch.device,
    layers: list,
    factory: EngineFactory,
    surveyed: Survey,
    log_dir: str,
    frozen: int,
    watchdog: Watchdog,
) -> Freezer:
    """--freeze's decisions and rebuilds (vit.freeze.freezer): fresh layers and the factory for a
    rebuild, the survey's record and the layer times for a re-plan, the cache's spill folder."""
    s, job, factor = plan.settings, plan.job, plan.slowdowns.get(plan.job.rank, 1.0)

    def fresh_layers() -> list:
        return plan.fresh_layers(s.model.drop_path)

    def time_layers():  # collective: for a re-plan at a freeze point, when one first needs them
        return time_each_rank(
            job, fresh_layers, plan.sample, plan.batch.micro_batch, surveyed.precision, dev, factor
        )

    return Freezer(
        s.freeze,
        len(layers),
        plan.steps_per_epoch,
        plan.total_steps,
        dev,
        frozen=frozen,
        run_parts=RebuildParts(
            make_layers=lambda: slowdown.attach_all(fresh_layers(), factor, dev),
            make_engine=factory,
            census=surveyed.record,
            micro_batch=plan.batch.micro_batch,
            time_layers=time_layers,
            on_progress=watchdog.beat,
        ),
        cache_dir=activation_cache.directory(s, log_dir, job.rank),
    )


@dataclass(kw_only=True)
class Trainer:
    """A run once its engine is built: what the loop and the finish read and write."""

    plan: Plan
    engine: Engine
    log_dir: str
    resumed: ResumePoint
    precision: str
    ds_config: dict
    stats: StepStats
    evaluator: Evaluator
    checkpointer: checkpoint.Checkpointer
    metrics: MetricsLog
    monitor: Monitor
    locks: list[RunLock]  # the run's folders, held until the process ends
    freezer: Freezer
    ema: Ema | None  # --model-ema's average of the weights, which the loop updates
    workers: int  # DataLoader workers per rank
    split: list[int] | None  # every data-parallel rank's micro-batch (--batch-split proportional)
    batches: Iterator | None = None

    def __post_init__(self):
        self.batches = self.batches_from(self.engine, self.resumed.step)

    def swap(self, engine: Engine, step: int) -> None:
        """--freeze rebuilt the engine, maybe with another layout: the parts take it at each
        call."""
        self.engine, self.batches = engine, self.batches_from(engine, step)

    def batches_from(self, engine: Engine, start: int) -> Iterator | None:
        """This rank's batches from step start + 1 on, as `engine` takes them (through the freeze
        cache)."""
        if not engine.reads_data:
            return None
        s, data, batch, pin = (
            self.plan.settings,
            self.plan.data,
            self.plan.batch,
            engine.device.type == "cuda",
        )
        order = dict(
            micro_batch=batch.micro_batch,
            grad_accum=engine.grad_accum,
            dp_rank=engine.dp_rank,
            dp_size=engine.dp_size,
            start_step=start,
            end_step=self.plan.total_steps,
            sizes=self.split,
        )
        batches = train_batches(
            data,
            s.recipe,
            s.train.seed,
            workers=self.workers,
            pin_memory=pin,
            labels_only=not engine.reads_images,
            cached=self.freezer.samples(engine, self.workers),
            **order,
        )
        order_ = TrainBatches(len(data.train), seed=s.train.seed, **order)
        return self.freezer.cached(batches, order_, engine)


def notes_of(plan: Plan, tag: str | None) -> list[str]:
    """The plan's notes, those of its resume about the checkpoint chosen: the newest, or the one
    choose_resume fell back to past damaged ones (the notes named the newest before it was read)."""
    if (
        not plan.resume
        or not plan.resume.saved
        or tag == checkpoint.tag_for(plan.resume.saved["step"])
    ):
        return plan.notes
    newest = resume_notes(plan)
    chosen = replace(plan.resume, saved=checkpoint.read_manifest(plan.resume.save_dir, tag))
    kept = [n for n in plan.notes if n not in newest]
    return kept + resume_notes(replace(plan, resume=chosen))


def build_trainer(plan: Plan, watchdog: Watchdog, charts) -> Trainer:
    """Every part, in the order the run needs them: the checks once the group is up, the log folder,
    where to resume, the model, the survey, the folders locked, the engine (and its checkpoint
    loaded), the records, and the loop's parts. `charts`: the run's charts for the trackers at its
    end."""
    s, job = plan.settings, plan.job
    preflight.check(job.world_size, s.cluster.hostfile)
    preflight.check_offload(plan.ds_config, job.device_type)
    dev = device(job)
    log_dir = agree_log_dir(s.log.log_dir, s.parallel.engine)
    save_dir = plan.save_dir or os.path.join(log_dir, "checkpoints")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    resumed = ResumePoint.of(plan)  # first: it may fall back past damaged checkpoints
    if job.is_main and (notes := notes_of(plan, resumed.tag)):
        print("\n".join(notes), flush=True)
    layers = weights.initial_layers(
        s.model.model,
        plan.data.num_classes,
        plan.data.in_chans,
        plan.data.img_size,
        s.train.seed,
        s.model.drop_path,
        None if plan.resume else s.model.pretrained_path,
    )
    # before ZeRO-3 partitions them
    ema_layers = copy.deepcopy(layers) if s.recipe.model_ema else None
    # before the census: it times fp32 as trained
    if (tf32 := set_tf32(dev, s.parallel.tf32 == "on")) and job.is_main:
        print(tf32, flush=True)
    surveyed = survey_cluster(plan, dev, layers, resumed.step)
    slowdown.attach_all(layers, plan.slowdowns.get(job.rank, 1.0), dev)
    locks = lock_run_dirs(log_dir, save_dir, s.checkpoint.no_save)
    hidden_to = console.to_file(log_dir, job.rank)
    ds_config = with_precision(plan.ds_config, surveyed.precision, surveyed.scale_power)
    factory = engine_factory(plan, dev, surveyed, ds_config)
    freezer = make_freezer(plan, dev, layers, factory, surveyed, log_dir, resumed.frozen, watchdog)
    freezer.freeze(layers, resumed.frozen)
    engine = factory(layers, resumed.layout)
    ema = Ema(ema_layers, engine, s.recipe.model_ema_decay) if ema_layers else None
    start = resumed.step
    if plan.resume:
        client_state = checkpoint.load(
            engine, plan.resume.save_dir, resumed.tag, ema, plan.resume.universal
        )
        start = client_state["step"]
        if "freeze" in client_state:
            freezer.load_state_dict(client_state["freeze"])
    freezer.watch(engine, start)
    if job.is_main:
        start_record(
            log_dir,
            plan,
            ds_config=ds_config,
            precision=surveyed.precision,
            cluster=surveyed.record,
            start_step=start,
            resumed_from=resumed.tag,
        )
        if console.where(hidden_to):
            print(console.where(hidden_to), flush=True)
    built = Built(
        plan=plan,
        engine=engine,
        log_dir=log_dir,
        save_dir=save_dir,
        resumed=replace(resumed, step=start),
        surveyed=surveyed,
        ds_config=ds_config,
        locks=locks,
        freezer=freezer,
        ema=ema,
    )
    return loop_parts(built, watchdog, charts)


@dataclass(frozen=True, kw_only=True)
class Built:
    """What build_trainer has built once the engine is up, for the loop's parts."""

    plan: Plan
    engine: Engine
    log_dir: str
    save_dir: str
    resumed: ResumePoint  # at the step the checkpoint loaded goes on from
    surveyed: Survey
    ds_config: dict  # with the precision the survey settled
    locks: list[RunLock]
    freezer: Freezer
    ema: Ema | None


def loop_parts(built: Built, watchdog: Watchdog, charts) -> Trainer:
    """The monitor, the metrics log (and trackers), the step statistics, the evaluator and the
    checkpointer. `charts`: as build_trainer's."""
    plan, engine, resumed, surveyed = built.plan, built.engine, built.resumed, built.surveyed
    log_dir = built.log_dir
    s, job, batch = plan.settings, plan.job, plan.batch
    # The driver (NVML, nvidia-smi) numbers GPUs unlike CUDA does; the UUID names this rank's GPU in
    # both.
    cuda = engine.device.type == "cuda"
    gpus = [str(torch.cuda.get_device_properties(engine.device).uuid)] if cuda else None
    say = None if job.is_main or s.log.verbose else console.CAPTURE.add
    monitor = Monitor(
        log_dir, job.rank, s.log.monitor_interval, s.log.monitor_backend, gpu_indices=gpus, say=say
    )
    monitor.start()
    metrics = tracking.metrics_log(
        log_dir,
        job.rank,
        s.log.report_to,
        monitor,
        start_step=resumed.step,
        verbose=s.log.verbose,
        charts=charts,
    )
    my_micro = surveyed.split[engine.dp_rank] if surveyed.split else batch.micro_batch
    stats = StepStats(
        engine,
        metrics,
        images=StepImages(job=batch.global_size, rank=my_micro * batch.grad_accum),
        total_steps=plan.total_steps,
        log_interval=s.log.log_interval,
        max_skipped_steps=s.train.max_skipped_steps if surveyed.precision == "fp16" else None,
        is_main=job.is_main,
        earlier=resumed.earlier,
    )
    workers = loader_workers(s.data.workers, engine.device.type, rank_cores(job.local_world_size))
    evaluator = Evaluator(
        plan.data,
        micro_batch=batch.micro_batch,
        workers=workers,
        metrics=metrics,
        watchdog=watchdog,
        interval=s.train.eval_interval,
        total_steps=plan.total_steps,
        is_main=job.is_main,
    )
    checkpointer = checkpoint.Checkpointer(
        built.save_dir,
        interval=s.checkpoint.save_interval,
        enabled=not s.checkpoint.no_save,
        keep=s.checkpoint.keep_checkpoints,
        meta=plan.checkpoint_meta(),
        on_progress=watchdog.beat,
        extra_state=lambda: {**built.freezer.checkpoint_state(), **stats.train_time()},
        ema=built.ema,
    )
    return Trainer(
        plan=plan,
        engine=engine,
        log_dir=log_dir,
        resumed=resumed,
        precision=surveyed.precision,
        ds_config=built.ds_config,
        stats=stats,
        evaluator=evaluator,
        checkpointer=checkpointer,
        metrics=metrics,
        monitor=monitor,
        locks=built.locks,
        freezer=built.freezer,
        ema=built.ema,
        workers=workers,
        split=surveyed.split,
    )


def loop(plan: Plan, run: Trainer, watchdog: Watchdog) -> None:
    """The steps from the resume point to the end: each step, then what acts at it (the freezer, the
    evaluation, the checkpoint)."""
    for step in range(run.resumed.step + 1, plan.total_steps + 1):
        lr = run.engine.lr
        loss = run.engine.train_step(run.batches)
        watchdog.beat(step)
        run.monitor.step = step
        if run.ema is not None:
            run.ema.update(run.engine, step)
        run.stats.record(run.engine, step, loss, lr)
        if run.stats.should_log(step):
            run.stats.log(run.engine, step)
        # Paused (and the device's queued work waited for) only where one of them acts: a wait
        # in every step would take the host's run-ahead away.
        acting = run.freezer.due(step) or run.evaluator.due(step) or run.checkpointer.due(step)
        with run.stats.paused() if acting else contextlib.nullcontext():
            if (rebuilt := run.freezer.after_step(step, run.engine, run.metrics)) is not None:
                run.swap(rebuilt, step)
            run.evaluator.maybe(run.engine, step, run.ema)
            run.checkpointer.save(run.engine, step)


def finish(plan: Plan, run: Trainer, start_time: float) -> None:
    """The final evaluation and checkpoint, the monitors' summaries, and summary.json."""
    evaluation = run.evaluator.run(run.engine, plan.total_steps, run.ema)
    run.checkpointer.save(run.engine, plan.total_steps, last_step=True)
    # rank 0 holds the state
    ema = run.ema.state_dict() if run.ema is not None else None  # --export: the EMA's weights
    if plan.settings.model.export and (state := run.engine.layer_state(ema)) is not None:
        weights.export(plan.settings.model.export, state, plan.settings.model.model, plan.data)
    peak = torch.tensor([peak_mem_gib(run.engine.device)], device=run.engine.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    run.monitor.stop()
    monitors = [None] * plan.job.world_size
    dist.all_gather_object(monitors, run.monitor.summary())
    if plan.job.is_main:
        write_summary(
            run.log_dir,
            plan,
            precision=run.precision,
            ds_config=run.ds_config,
            start_step=run.resumed.step,
            start_time=start_time,
            measured=Measured(
                totals=run.stats.totals(),
                evaluation=evaluation,
                peak_mem_gib=peak.item(),
                monitors=monitors,
            ),
        )
    run.metrics.close()
    dist.barrier()
