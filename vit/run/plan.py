"""Everything decided before any process group starts: the settings checked against each other, the
data, the DeepSpeed JSON and its batch arithmetic, the length of the run, where it writes, and what
it resumes from. Any mistake found here is one line and exit 2, with nothing written."""

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from vit.checkpoints import checkpoint
from vit.checkpoints.universal import LOAD_UNIVERSAL
from vit.core.batch import Batch
from vit.core.costs import Candidate
from vit.core.errors import CannotGoOn, ConfigError, NothingToDo
from vit.core.paths import DS_CONFIGS, ROOT
from vit.core.settings import DEFAULT_EPOCHS, DEFAULT_SAVE_INTERVAL, Settings
from vit.core.spec import EngineSpec
from vit.data.augment import data_recipe
from vit.data.datasets import DataSplit, dataset_for, load_dataset
from vit.data.sampling import steps_per_epoch
from vit.engines.registry import AUTO, spec
from vit.model import weights
from vit.model.layers import build_layers, check_img_size, model_shape
from vit.planner import balance
from vit.planner.batch_split import proportional_split
from vit.planner.memory import RunMemory
from vit.run.cli import validate
from vit.run.compat import PROVISIONAL, check_freeze, check_precision, splits_batches
from vit.run.ds_config import BATCH_KEYS, precision_of, resolve
from vit.run.rundir import check_export, check_unused, check_writable
from vit.runtime import slowdown
from vit.runtime.dist_env import Job, resolve_master
from vit.telemetry import tracking


@dataclass(frozen=True)
class Resume:
    save_dir: str
    tags: list[str]  # complete checkpoints to try, newest first
    # the run that wrote them: the newest readable manifest (saved_run)
    saved: dict = field(default_factory=dict)
    # ZeRO state of another data-parallel size: loaded as DeepSpeed's universal checkpoint
    universal: bool = False


@dataclass(frozen=True, kw_only=True)
class Plan:
    settings: Settings  # the data set filled in when --data-path named it
    job: Job
    # resolved; the census may still settle the precision ("auto") and the fp16 loss scale
    ds_config: dict
    batch: Batch
    # what --precision or the JSON asks for (auto too); None: none given
    requested_precision: str | None
    data: DataSplit
    steps_per_epoch: int
    total_steps: int
    save_dir: str | None  # None: <log dir>/checkpoints, once the log dir's default name is agreed
    resume: Resume | None
    # what a checkpoint must match to be resumed by this run (model, engine, ranks, ...)
    shape: dict
    slowdowns: dict[int, float]  # --simulate-slowdown: rank -> factor
    notes: list[str]  # said first by rank 0
    # --micro-batch-size auto with --batch-split proportional: each rank's micro-batch
    micro_split: list[int] | None = None
    # what --micro-batch-size auto measured and chose (config.json)
    micro_search: dict | None = None
    # --engine auto: {} until vit.planner.auto chooses, then its table and choice
    auto: dict | None = None
    # --engine auto's pipeline stage boundaries (else the engine's partition)
    stage_parts: list[int] | None = None

    def settings_hash(self, with_batch: bool = False) -> str:
        """The user's settings that make checkpoints comparable (before the census fills in
        precision). Without the JSON's batch sizes, which a resume on other ranks sets itself (the
        global batch is compared on its own); with them, as checkpoints before 29 November 2026
        recorded it."""
        m, d, o = self.settings.model, self.settings.data, self.settings.optim
        what = {
            "model": m.model,
            "dataset": d.dataset,
            "img_size": m.img_size,
            "seed": self.settings.train.seed,
            "lr": o.lr,
            "min_lr": o.min_lr,
            "weight_decay": o.weight_decay,
            # DeepSpeed's JSON, less the universal-checkpoint switch a resume may add
            "deepspeed": {
                k: v
                for k, v in self.ds_config.items()
                if k != "checkpoint" and (with_batch or k not in BATCH_KEYS)
            },
        }
        # only then: AdamW checkpoints written before --opt existed keep their hash
        if o.opt != "adamw":
            what.update(opt=o.opt, momentum=o.momentum, nesterov=o.nesterov)
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    def checkpoint_meta(self) -> dict:
        """What each checkpoint's manifest records of the run, for a resume to compare with its
        own."""
        # --engine auto's choice, which `--engine auto --resume` takes again (resumed_auto_choice)
        auto = {"engine_auto": self.auto} if self.auto else {}
        return {
            **self.shape,
            "config_hash": self.settings_hash(),
            "total_steps": self.total_steps,
            "save_interval": self.settings.checkpoint.save_interval,
            **auto,
        }

    @property
    def engine(self) -> EngineSpec:
        return spec(self.settings.parallel.engine)

    @property
    def sample(self) -> torch.Tensor:
        """One training image (a batch of 1), for measuring the model."""
        return self.data.train[0][0][None]

    def fresh_layers(self, drop_path: float = 0.0) -> list:
        """The model's layers as the run's seed builds them (vit.model.layers)."""
        s, data = self.settings, self.data
        return build_layers(
            s.model.model, data.num_classes, data.in_chans, data.img_size, s.train.seed, drop_path
        )

    @property
    def memory(self) -> RunMemory:
        """This run's terms of the memory model: its engine, DeepSpeed JSON, data-parallel size,
        EMA, compression, the weight copies its engine's options stash (the async pipeline's
        stashing or prediction) and --freeze's handover."""
        return RunMemory(
            engine=self.engine,
            requested_precision=self.requested_precision,
            ds_config=self.ds_config,
            dp_size=self.batch.dp_size,
            ema_on_gpu=self.settings.recipe.model_ema,
            stashed_copies=self.engine.stashed_weights(self.settings),
            compression=self.compression(),
            freezing=self.settings.freeze.freeze != "none",
        )

    def likely_precision(self, dev: torch.device) -> str:
        """What this rank will probably train in, before the census settles it (for memory
        estimates)."""
        return self.memory.likely_precision(dev)

    def compression(self) -> str:
        """The compression the settings and the JSON ask of the engine
        (EngineSpec.compression_of)."""
        return self.engine.compression_of(self.settings, self.ds_config)

    def state_bytes_per_param(self, precision: str) -> float:
        """vit.planner.memory.bytes_per_param for this run (RunMemory.per_param)."""
        return self.memory.per_param(precision)

    def reserved_bytes(self, dev: torch.device, precision: str) -> float:
        """What a GPU rank keeps free beside the plan's memory (0 on a CPU), a freeze point's
        handover included."""
        return self.memory.reserved(dev, precision)

    def balanced_candidate(self) -> Candidate | None:
        """The run's pipeline as the cost model names it, when it asks for balanced stages."""
        par = self.settings.parallel
        return balance.candidate(
            par.engine,
            par.partition,
            par.pipeline_stages,
            self.batch.micro_batch,
            self.batch.grad_accum,
            self.shape["zero_stage"] or 0,
            self.compression(),
        )


def make_plan(settings: Settings, job: Job) -> Plan:
    # planned as PROVISIONAL until vit.planner.auto chooses (train.run)
    if settings.parallel.engine == AUTO:
        if settings.checkpoint.resume:
            return resumed_auto_choice(settings, job)
        return replace(make_plan(settings.with_(engine=PROVISIONAL), job), auto={})
    dataset, note = dataset_for(settings.data)
    s = settings.with_(dataset=dataset)
    par, ckpt = s.parallel, s.checkpoint
    check_outputs(s)
    save_dir = ckpt.save_dir or (
        os.path.join(s.log.log_dir, "checkpoints") if s.log.log_dir else None
    )
    if ckpt.resume:
        check_resumed_stages(s, job, save_dir)
    ds_config, batch = resolve_ds_config(s, par, job.world_size)
    requested = par.precision or precision_of(ds_config)  # settled by vit.runtime.precision.choose
    if par.precision is None and not any(
        ds_config.get(k, {}).get("enabled") for k in ("fp16", "bf16")
    ):
        requested = None  # none given: auto on GPUs, fp32 on CPUs
    check_precision(requested, par.engine)
    slowdowns = slowdown.factors(par.simulate_slowdown, job.world_size)
    if par.compile and slowdowns:
        raise ConfigError(
            "--compile cannot run with --simulate-slowdown: the slowdown times each "
            "layer on the host inside its forward and backward, which a compiled graph "
            "does not stop for; leave one out"
        )
    preset = model_shape(s.model.model)
    norm = weights.pretrained_norm(s.model.model, s.model.pretrained, s.model.pretrained_path)
    data = load_dataset(
        dataset,
        s.data.data_path,
        s.model.img_size or preset.img_size,
        s.data.download,
        s.data.synthetic_size,
        s.train.seed,
        norm,
    )
    if s.model.img_size and s.model.img_size != data.img_size:
        raise ConfigError(
            f"--img-size {s.model.img_size} does not match the "
            f"{data.img_size}x{data.img_size} images of {dataset}"
        )
    check_img_size(s.model.model, data.img_size)
    s, notes = check_recipe(s, data, [note] if note else [])
    # the recipe as the data has it
    if s.freeze.freeze_cache == "on" and (s.recipe.augments or s.recipe.mixes):
        raise ConfigError(
            "--freeze-cache on needs the same sample every epoch, and this run's training "
            "data is augmented or mixed: add --no-aug (and leave out --mixup/--cutmix), or "
            "use --freeze-cache auto or off"
        )
    kept = []  # the line of a global batch the resume chose (keep_global_batch)
    if ckpt.resume and not par.grad_accum and par.micro_batch_size != "auto":
        s, ds_config, batch, kept = keep_global_batch(s, job, save_dir, ds_config, batch)
        notes += kept
    check_layout(s, job, preset.depth, batch)
    notes += fill_notes(s, batch)
    per_epoch, total_steps = run_length(s, data, batch)
    shape = {
        "model": s.model.model,
        "engine": par.engine,
        "world_size": job.world_size,
        "data_parallel_size": batch.dp_size,
        "pipeline_stages": par.pipeline_stages if spec(par.engine).pipeline else 1,
        "zero_stage": spec(par.engine).zero_stage_of(ds_config),
        "global_batch": batch.global_size,
    }
    check_freeze(s, ds_config)
    resume = find_resume(s, save_dir, shape, batch, bool(kept)) if ckpt.resume else None
    if resume and resume.universal:  # DeepSpeed reads it at initialize
        ds_config = {
            **ds_config,
            "checkpoint": {**ds_config.get("checkpoint", {}), LOAD_UNIVERSAL: True},
        }
    if resume and s.train.steps is None and s.train.epochs is None:
        # the length's default would change the run's: keep its own (the LR schedule's)
        total_steps = resume.saved.get("total_steps", total_steps)
    every = resume.saved.get("save_interval") if resume else None
    if every not in (None, ckpt.save_interval) and ckpt.save_interval == DEFAULT_SAVE_INTERVAL:
        s = s.with_(save_interval=every)  # not given: the run's own, as its length
        notes.append(f"--resume: a checkpoint every {every} steps, as the run saved them")
    resolve_master(job)
    plan = Plan(
        settings=s,
        job=job,
        ds_config=ds_config,
        batch=batch,
        requested_precision=requested,
        data=data,
        steps_per_epoch=per_epoch,
        total_steps=total_steps,
        save_dir=save_dir,
        resume=resume,
        shape=shape,
        slowdowns=slowdowns,
        notes=notes,
        micro_split=list(batch.split) if batch.split else None,
    )
    return replace(plan, notes=notes + resume_notes(plan)) if resume else plan


def check_outputs(s: Settings) -> None:
    """Where the run writes: folders it can write and no other run's, the export's file, wandb."""
    ckpt = s.checkpoint
    if "wandb" in s.log.report_to.split(","):
        tracking.check_wandb()
    check_writable(s.log.log_dir or str(ROOT / "logs"), "--log-dir")
    if ckpt.save_dir and not ckpt.no_save:
        check_writable(ckpt.save_dir, "--save-dir")
    if not ckpt.resume:
        check_unused(s.log.log_dir, None if ckpt.no_save else ckpt.save_dir)
    if s.model.export:
        check_export(s.model.export)


def check_layout(s: Settings, job: Job, depth: int, batch: Batch) -> None:
    """The engine's layout against the ranks and the model: stages, updates in flight, workers."""
    par, engine = s.parallel, spec(s.parallel.engine)
    if engine.pipeline and par.pipeline_stages > depth + 2:
        raise ConfigError(
            f"--pipeline-stages {par.pipeline_stages} exceeds the {depth + 2} layers of "
            f"{s.model.model} (embedding, {depth} blocks, head)"
        )
    engine.check_layout(s, job.world_size, batch.grad_accum)


def fill_notes(s: Settings, batch: Batch) -> list[str]:
    """A pipeline that flushes every step given fewer micro-batches than stages: most of its slots
    are bubble."""
    stages, m = s.parallel.pipeline_stages, batch.grad_accum
    bubble = spec(s.parallel.engine).bubble_slots(stages) if spec(s.parallel.engine).pipeline else 0
    if not bubble or m >= stages:
        return []
    return [
        f"warning: --pipeline-stages {stages} with {m} micro-batches a step: 1F1B takes {m} + "
        f"{bubble} = {m + bubble} slots for them, each stage busy {m / (m + bubble):.0%} of the "
        f"step; --grad-accum {2 * stages} (at least {stages}) fills the pipeline"
    ]


def check_recipe(s: Settings, data: DataSplit, notes: list[str]) -> tuple[Settings, list[str]]:
    """The starting weights (fetched for --pretrained, shapes checked); the recipe
    as it applies to the data (vit.data.augment.data_recipe), so that config.json records it."""
    s = replace(s, recipe=data_recipe(s.recipe, data))
    m = s.model
    if m.pretrained and m.pretrained_path:
        raise ConfigError("--pretrained and --pretrained-path: choose one")
    # the checkpoint's weights replace them
    if s.checkpoint.resume and (m.pretrained or m.pretrained_path):
        what = f"--pretrained-path {m.pretrained_path}" if m.pretrained_path else "--pretrained"
        notes = notes + [f"{what}: not loaded; the run resumes from its checkpoint's weights"]
    elif m.pretrained:
        s = s.with_(pretrained_path=weights.hub_weights(m.model))
    if s.model.pretrained_path and not s.checkpoint.resume:
        notes = notes + weights.check(
            s.model.pretrained_path, m.model, data.num_classes, data.in_chans, data.img_size
        )
    return s, notes


def resolve_ds_config(s: Settings, par, world_size: int) -> tuple[dict, Batch]:
    """The DeepSpeed JSON with the command line's overrides, and its batch arithmetic."""
    ds_config, batch = resolve(par, world_size)
    if s.optim.clip_grad is not None:  # --clip-grad over the JSON's gradient_clipping, for DDP too
        ds_config = {**ds_config, "gradient_clipping": s.optim.clip_grad}
    return ds_config, batch


def run_length(s: Settings, data: DataSplit, batch: Batch) -> tuple[int, int]:
    """(steps per epoch, steps of the run)."""
    per_epoch = steps_per_epoch(len(data.train), batch.global_size)
    if per_epoch == 0:
        raise ConfigError(
            f"global batch {batch.global_size} is larger than the {len(data.train)} training "
            f"samples of {s.data.dataset}"
        )
    epochs = DEFAULT_EPOCHS if s.train.epochs is None else s.train.epochs
    return per_epoch, s.train.steps or max(1, round(epochs * per_epoch))


def with_micro_batch(plan: Plan, micro_batch: int, split: list[int] | None, search: dict) -> Plan:
    """The plan once --micro-batch-size auto has measured: its DeepSpeed JSON, batch and length."""
    par = replace(plan.settings.parallel, micro_batch_size=micro_batch)
    ds_config, batch = resolve_ds_config(plan.settings, par, plan.job.world_size)
    per_epoch, total_steps = run_length(plan.settings, plan.data, batch)
    return replace(
        plan,
        ds_config=ds_config,
        batch=batch,
        steps_per_epoch=per_epoch,
        total_steps=total_steps,
        shape={**plan.shape, "global_batch": batch.global_size},
        micro_split=split,
        micro_search=search,
    )


AGAIN = "--engine auto --resume:"  # the line of a choice made again on a changed cluster


def cannot_take(plan: Plan) -> Callable[[Candidate], str | None]:
    """For --engine auto choosing again on a resume: why a candidate cannot load the checkpoint
    (checkpoint.check_shape's refusal of its layout), None where it can."""
    saved, where = plan.resume.saved, f"checkpoint {plan.resume.save_dir}/{plan.resume.tags[0]}"

    def why(c: Candidate) -> str | None:
        shape = {
            **plan.shape,
            "engine": c.engine,
            "pipeline_stages": c.stages,
            "zero_stage": c.zero_stage,
            "data_parallel_size": plan.job.world_size // c.stages,
        }
        try:
            checkpoint.check_shape(saved, shape, where, spec(c.engine))
        except ConfigError:
            return f"cannot resume the --engine {saved['engine']} checkpoint"
        return None

    return why


def with_auto_choice(plan: Plan, record: dict) -> Plan:
    """The run's plan with --engine auto's choice (vit.planner.auto.choose's record): its options as
    a command line would give them, checked like one."""
    if not plan.resume:
        return planned_as_chosen(plan.settings, plan.job, record)
    # chosen again for a resume on a changed cluster: said so (resumed_auto_choice) and recorded
    record = {**record, "resumed_from": f"{plan.resume.save_dir}/{plan.resume.tags[0]}"}
    new = planned_as_chosen(plan.settings, plan.job, record)
    return replace(new, notes=[n for n in plan.notes if n.startswith(AGAIN)] + new.notes)


def resumed_auto_choice(settings: Settings, job: Job) -> Plan:
    """`--engine auto --resume`: the run planned as it chose (the record its newest readable
    checkpoint's manifest keeps), measuring nothing again, then resumed like any run: on another
    number of ranks its checkpoint is refused as a named engine's would be."""
    ckpt, log_dir = settings.checkpoint, settings.log.log_dir
    save_dir = ckpt.save_dir or (os.path.join(log_dir, "checkpoints") if log_dir else None)
    where, tags = checkpoint.locate(save_dir if ckpt.resume == "auto" else ckpt.resume)
    for tag in tags:
        try:
            manifest = checkpoint.read_manifest(where, tag)
        except (OSError, ValueError):
            continue
        if "engine_auto" not in manifest:
            raise ConfigError(
                f"--engine {AUTO} --resume: checkpoint {where}/{tag} is of a run that named its "
                f"engine; resume it with --engine {manifest.get('engine', '...')}"
            )
        record = {**manifest["engine_auto"], "resumed_from": f"{where}/{tag}"}
        chosen_on = len(record.get("contention", [])) or job.world_size
        if chosen_on == job.world_size:
            return planned_as_chosen(settings, job, record)
        # another cluster: planned as the old choice refitted until auto chooses again (train.run)
        # among the candidates that can take the checkpoint (cannot_take)
        refitted = planned_as_chosen(settings, job, record, refit=True)
        if refitted.batch.split or refitted.batch.global_size != manifest.get("global_batch"):
            said = (
                f"{AGAIN} chosen for {chosen_on} ranks, {job.world_size} here, which do not divide "
                f"the global batch of {where}/{tag}: its choice goes on, refitted (the search "
                "weighs only global batches the ranks divide)"
            )
            return replace(refitted, notes=[said, *refitted.notes])
        said = (
            f"{AGAIN} chosen for {chosen_on} ranks, {job.world_size} here: choosing again among "
            f"the engines that can take {where}/{tag}"
        )
        return replace(refitted, auto={}, notes=[said, *refitted.notes])
    raise ConfigError(f"--resume {where}: no readable checkpoint manifest there")


def planned_as_chosen(settings: Settings, job: Job, record: dict, refit: bool = False) -> Plan:
    """The plan of --engine auto's choice (`record`). `refit`: for a resume on another number of
    ranks than it chose for, until auto chooses again: the same engine, ZeRO stage and compression,
    the stages that divide the ranks there are (at most the chosen ones, their boundaries again),
    the checkpoint's global batch kept with the chosen micro-batch as the largest, equal batches."""
    c, engine = record["choice"], spec(record["choice"]["engine"])
    stages = c["stages"]
    if refit:
        stages = max(k for k in range(1, stages + 1) if job.world_size % k == 0)
    changes = dict(
        engine=c["engine"],
        auto_allow="",  # an option of --engine auto's, which the chosen engine refuses
        ds_config=str(DS_CONFIGS / engine.config_for(c["zero_stage"], stages, job.world_size)),
        micro_batch_size=c["micro_batch"],
        grad_accum=None if refit else c["grad_accum"],
        batch_split="proportional" if c["split"] and not refit else "equal",
    )
    if engine.pipeline:
        changes["pipeline_stages"] = stages
    options, json_keys = engine.compression_options(c["compression"])
    new = make_plan(validate(settings.with_(**changes, **options)), job)
    if json_keys:  # DeepSpeed's gradient reduction in bf16
        new = replace(new, ds_config={**new.ds_config, **json_keys})
    return replace(
        new,
        auto=record,
        micro_split=list(c["split"]) if c["split"] and not refit else new.micro_split,
        stage_parts=list(c["parts"]) if c["parts"] and stages == c["stages"] else None,
    )


def find_resume(
    s: Settings, save_dir: str | None, shape: dict, batch: Batch, batch_chosen: bool = False
) -> Resume:
    """What --resume continues from, refused when it cannot be continued without overwriting a
    checkpoint. `batch_chosen`: the global batch is the one keep_global_batch chose from it."""
    where, tags = checkpoint.locate(
        save_dir if s.checkpoint.resume == "auto" else s.checkpoint.resume
    )
    saved, universal = {}, False
    for tag in tags:  # the newest readable manifest says how the run was laid out
        try:
            saved = saved_run(where, checkpoint.read_manifest(where, tag))
        except (OSError, ValueError):
            continue
        universal = checkpoint.check_shape(
            saved, shape, f"checkpoint {where}/{tag}", spec(s.parallel.engine)
        )
        if not batch_chosen:
            check_global_batch(saved.get("global_batch"), batch, f"checkpoint {where}/{tag}")
        break
    step = checkpoint.step_of(tags[0])
    newer = (
        [t for t in checkpoint.complete_tags(save_dir) if checkpoint.step_of(t) > step]
        if save_dir
        else []
    )
    if newer and os.path.realpath(save_dir) == os.path.realpath(where):
        raise ConfigError(
            f"--resume {where}/{tags[0]}: {save_dir} also holds newer checkpoints "
            f"({', '.join(newer)}) that this run would overwrite; resume from the newest (--resume "
            "without a path), or write elsewhere (--save-dir or another --log-dir)"
        )
    return Resume(where, tags, saved, universal)


def saved_run(where: str, manifest: dict) -> dict:
    """A manifest with the model and the run's length, taken from the run's config.json (beside its
    checkpoints/ folder) where a checkpoint written before manifests recorded them lacks them."""
    config = Path(where).parent / "config.json"
    if (
        {"model", "total_steps"} <= manifest.keys()
        or Path(where).name != "checkpoints"
        or not config.is_file()
    ):
        return manifest
    try:
        run = json.loads(config.read_text())
        found = {"model": run["args"]["model"], "total_steps": run["total_steps"]}
    # not a config.json of ours: the manifest alone
    except (OSError, ValueError, TypeError, KeyError):
        return manifest
    return {**found, **manifest}


def resume_notes(plan: Plan) -> list[str]:
    """Rank 0's warnings on what this run changes of the run it resumes: settings behind the
    checkpoint's hash (--lr, --seed, ...), and the length, which the LR schedule (warm-up and cosine
    decay) is computed from."""
    saved, notes = plan.resume.saved, []
    if not saved:  # no readable manifest: choose_resume will say so
        return notes
    at = f"checkpoint {plan.resume.save_dir}/{checkpoint.tag_for(saved['step'])}"
    if plan.resume.universal:
        by = (
            f" of --engine {saved['engine']}, under --engine {plan.settings.parallel.engine}"
            if saved["engine"] != plan.settings.parallel.engine
            else ""
        )
        stages = (saved["pipeline_stages"], plan.shape["pipeline_stages"])
        was, now = (
            (f"{stages[0]} pipeline stages x ", f"{stages[1]} x ")
            if len(set(stages)) > 1
            else ("", "")
        )
        notes.append(
            f"{at}: ZeRO-{saved['zero_stage']} state of {was}{saved['data_parallel_size']} "
            f"data-parallel ranks{by}, loaded on {now}{plan.batch.dp_size} through DeepSpeed's "
            "universal checkpoint (ds_to_universal)"
        )
    if saved.get("config_hash") not in (plan.settings_hash(), plan.settings_hash(with_batch=True)):
        notes.append(
            f"warning: {at} was written with other settings (model, data, optimizer or "
            "DeepSpeed config) than this run"
        )
    if saved.get("total_steps", plan.total_steps) != plan.total_steps:
        notes.append(
            f"warning: {at} belongs to a run of {saved['total_steps']} steps, this one has "
            f"{plan.total_steps} (--steps or --epochs): the LR schedule is recomputed over "
            f"{plan.total_steps} steps, so the learning rate from step {saved['step'] + 1} on is "
            "not the one the first run would have used"
        )
    return notes


def choose_resume(plan: Plan) -> str:
    """Rank 0, once the process group is up: the newest checkpoint that verifies
    (vit.checkpoints.checkpoint.choose falls back past damaged ones). A run already complete is
    nothing to do but --export's, from its last checkpoint; a checkpoint at or past the run's end is
    refused, never trained over."""
    r, total = plan.resume, plan.total_steps
    tag = checkpoint.choose(r.save_dir, r.tags)
    step = checkpoint.step_of(tag)
    m = plan.settings.model
    if m.export:  # --resume with --export writes the checkpoint's weights and never trains
        weights.export_checkpoint(
            f"{r.save_dir}/{tag}", m.export, m.model, plan.data, plan.settings.recipe.model_ema
        )
        where = f"checkpoint {r.save_dir}/{tag}"
        said = (
            f"the run is complete: {where} is its last step ({step})"
            if step == total
            else f"{where} is at step {step} of {total}"
        )
        raise NothingToDo(
            f"{said}; exported its weights to {m.export}, nothing trained (without "
            "--export, --resume trains on)"
        )
    if step < total:
        return tag
    log_dir = plan.settings.log.log_dir
    summary = Path(log_dir, "summary.json") if log_dir else Path(r.save_dir).parent / "summary.json"
    if step == total and summary.is_file() and json.loads(summary.read_text()).get("steps") == step:
        raise NothingToDo(
            f"the run is complete: checkpoint {r.save_dir}/{tag} is its last step ({step}), and "
            f"{summary} says so; nothing to do (add --export PATH to write its weights)"
        )
    raise ConfigError(
        f"--resume: checkpoint {r.save_dir}/{tag} is already at step {step}, and this run ends at "
        f"step {total}; ask for more steps (--steps or --epochs)"
        + (", or add --export PATH to write its weights" if step == total else "")
    )


def keep_global_batch(
    s: Settings, job: Job, save_dir: str | None, ds_config: dict, batch: Batch
) -> tuple[Settings, dict, Batch, list[str]]:
    """--resume on another number of data-parallel ranks without --grad-accum (scripts/retry.sh
    relaunching on the hosts that answer): the checkpoint's global batch kept, and the line that
    says how. Where the ranks divide it: equal shares (equal_shares). Where they do not: unequal
    shares of each micro-step, each rank's loss weighed by its share as --batch-split
    proportional does (the same mean gradient), on the engines that take them; on the others
    (pipelines, DiLoCo: compat.splits_batches) the nearest global batch the ranks divide in the
    fewest micro-steps, the learning rate not scaled. Unchanged where nothing needs it."""
    saved = saved_global_batch(s, save_dir)
    if not saved or saved == batch.global_size:
        return s, ds_config, batch, []
    n, engine = batch.dp_size, spec(s.parallel.engine)
    was = f"({batch.micro_batch} x {batch.grad_accum} would make {batch.global_size}); "
    if saved % n == 0:
        s, ds_config, kept = equal_shares(s, job, saved, batch)
        return (
            s,
            ds_config,
            kept,
            [
                f"--resume: the checkpoint's global batch {saved} kept on {n} data-parallel "
                f"ranks: micro-batch {kept.micro_batch} x grad accum {kept.grad_accum} {was}"
                "--grad-accum chooses otherwise"
            ],
        )
    split = unequal_shares(saved, n, batch.micro_batch) if splits_batches(engine) else None
    if split:
        accum = saved // sum(split)
        s = s.with_(micro_batch_size=max(split), grad_accum=accum, batch_split="proportional")
        ds_config, nominal = resolve_ds_config(s, s.parallel, job.world_size)
        kept = replace(nominal, split=tuple(split))
        return (
            s,
            ds_config,
            kept,
            [
                f"--resume: the checkpoint's global batch {saved} kept on {n} data-parallel "
                f"ranks, which do not divide it: unequal micro-batches {list(split)} x grad accum "
                f"{accum}, each rank's loss weighed by its share as --batch-split proportional "
                f"does (the same mean gradient) {was}--grad-accum chooses otherwise"
            ],
        )
    # the nearest the ranks divide in the fewest micro-steps within the micro-batch (160 on 3 at
    # 32: 162 = 27 x 2 x 3, not 159 = 1 x 53 x 3)
    accum = -(-saved // (n * batch.micro_batch))
    near = n * accum * min(max(1, round(saved / (n * accum))), batch.micro_batch)
    s, ds_config, kept = equal_shares(s, job, near, batch)
    if engine.pipeline:
        why = "splits no batch unequally (its stages pass micro-batches of one size)"
    elif engine.local_steps:
        why = (
            "splits no batch unequally (a worker's inner steps average its own batch, and a sync "
            "weighs the workers by steps, not samples)"
        )
    else:
        why = f"finds no unequal split of it within micro-batch {batch.micro_batch}"
    return (
        s,
        ds_config,
        kept,
        [
            f"--resume: the checkpoint's global batch {saved} does not divide over {n} "
            f"data-parallel ranks, and --engine {s.parallel.engine} {why}: global batch {near}, "
            f"the nearest they divide in the fewest micro-steps: micro-batch {kept.micro_batch} x "
            f"grad accum {kept.grad_accum}; the learning rate is not scaled and the LR schedule "
            "goes on at its step, the data order from here on is not the first run's"
        ],
    )


def equal_shares(
    s: Settings, job: Job, global_batch: int, batch: Batch
) -> tuple[Settings, dict, Batch]:
    """`global_batch` over `batch`'s data-parallel ranks in equal shares: the largest micro-batch
    up to `batch`'s that divides a rank's share, the gradient accumulation for the rest."""
    share, micro_batch = global_batch // batch.dp_size, batch.micro_batch
    micro = next(m for m in range(min(micro_batch, share), 0, -1) if share % m == 0)
    s = s.with_(micro_batch_size=micro, grad_accum=share // micro)
    ds_config, kept = resolve_ds_config(s, s.parallel, job.world_size)
    return s, ds_config, kept


def unequal_shares(global_batch: int, n: int, micro_batch: int) -> list[int] | None:
    """Each micro-step's samples over `n` ranks whose number does not divide `global_batch`: the
    fewest micro-steps whose shares (as equal as they can be: batch_split.proportional_split at
    equal speeds) stay within `micro_batch`; None where none do."""
    for accum in range(1, global_batch // n + 1):
        per_step = global_batch // accum
        if global_batch % accum == 0 and -(-per_step // n) <= micro_batch:
            return proportional_split(per_step, [1.0] * n, [-(-per_step // n)] * n)
    return None


def saved_global_batch(s: Settings, save_dir: str | None) -> int | None:
    """The global batch of the checkpoint --resume goes on from (its newest readable manifest), or
    None where find_resume will say what is wrong."""
    return saved_manifest(s, save_dir).get("global_batch")


def saved_manifest(s: Settings, save_dir: str | None) -> dict:
    """The newest readable manifest of what --resume goes on from (saved_run), or {} where
    find_resume will say what is wrong."""
    try:
        where, tags = checkpoint.locate(
            save_dir if s.checkpoint.resume == "auto" else s.checkpoint.resume
        )
    except ConfigError:
        return {}
    for tag in tags:
        try:
            return saved_run(where, checkpoint.read_manifest(where, tag))
        except (OSError, ValueError):
            continue
    return {}


def check_resumed_stages(s: Settings, job: Job, save_dir: str | None) -> None:
    """A pipeline resumed with --pipeline-stages that do not divide its ranks (fewer hosts answer):
    refused naming the stage count that divides them, and whether it resumes the checkpoint (the
    engine restages it) or the ranks it needs (exit 3: retry.sh waits for a host)."""
    stages, engine = s.parallel.pipeline_stages, spec(s.parallel.engine)
    if not engine.pipeline or job.world_size % stages == 0:
        return
    fits = max(k for k in range(1, stages + 1) if job.world_size % k == 0)
    saved, said = saved_manifest(s, save_dir), ""
    if saved.get("engine") == engine.name:
        zero = saved.get("zero_stage", 0)
        said = (
            f": --pipeline-stages {fits} resumes its checkpoint on these ranks (restaged)"
            if engine.restages(saved) or saved.get("pipeline_stages") == fits
            else f": its ZeRO-{zero} checkpoint of {saved.get('pipeline_stages')} stages goes on "
            f"only on a multiple of {saved.get('pipeline_stages')} ranks"
        )
    raise CannotGoOn(
        f"--pipeline-stages {stages} does not divide the world size {job.world_size}{said}"
        + ("" if said else f"; --pipeline-stages {fits} does")
    )


def check_global_batch(saved: int | None, batch: Batch, where: str) -> None:
    """A resume that keeps the data order and the LR schedule must keep the global batch."""
    if saved is None or saved == batch.global_size:
        return
    per_accum = batch.micro_batch * batch.dp_size
    hint = (
        f"; pass --grad-accum {saved // per_accum} to keep it"
        if saved % per_accum == 0
        else "; leave out --grad-accum and the resume keeps it"
    )
    raise ConfigError(
        f"{where} was trained with global batch {saved}, this run's is {batch.global_size} "
        f"({batch.arithmetic()}){hint}"
    )
