"""Which options work with which engine: every engine x feature check, read from the engines' specs
(vit.engines.registry), all before any process group starts. With vit/engines/, the only code that
may name an engine (tests/test_architecture.py holds the rest to that). Each refusal is one line
(ConfigError)."""

import sys

from vit.core.errors import ConfigError
from vit.engines.registry import AUTO, NAMES, SPECS, spec


def _engines(has) -> str:
    """'--engine a, b or c': the engines whose spec has it."""
    names = [n for n in NAMES if has(spec(n))]
    return "--engine " + (
        " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"
    )


# What an option with `needs` (vit.core.settings.option) has no effect without: (whether the
# settings have it, how to say it).
NEEDS = {
    "auto": (lambda s: s.parallel.engine == AUTO, f"--engine {AUTO}"),
    "async": (
        lambda s: spec(s.parallel.engine).async_schedule,
        _engines(lambda e: e.async_schedule),
    ),
    "freeze": (lambda s: s.freeze.freeze != "none", "--freeze schedule, settled or grad"),
    "powersgd": (lambda s: s.comm.comm_hook == "powersgd", "--comm-hook powersgd"),
    "diloco": (
        lambda s: spec(s.parallel.engine).local_steps,
        _engines(lambda e: e.local_steps) + f" (or --engine {AUTO} --auto-allow diloco)",
    ),
    "pipeline freeze": (
        lambda s: (
            s.freeze.freeze != "none"
            and spec(s.parallel.engine).pipeline
            and spec(s.parallel.engine).freeze
        ),
        f"--freeze schedule, settled or grad on {_engines(lambda e: e.pipeline and e.freeze)}",
    ),
}


def needs_of(needs: str, group: str):
    """NEEDS' row for an option of settings group `group`; "engine": the engines whose spec
    declares the group (vit.core.spec.EngineSpec.option_groups)."""
    if needs != "engine":
        return NEEDS[needs]
    return (
        lambda s: group in spec(s.parallel.engine).option_groups,
        _engines(lambda e: group in e.option_groups),
    )


def splits_batches(engine) -> bool:
    """Whether the engine takes unequal micro-batches on its data-parallel ranks (--batch-split
    proportional): a pipeline's stages pass micro-batches of one size; DiLoCo's workers each
    average their own batch in their inner steps, and its syncs weigh the workers by steps, not
    samples."""
    return not engine.pipeline and not engine.local_steps


def check_settings(s) -> None:
    """The command line's options against its --engine (vit.run.cli.validate)."""
    par, engine = s.parallel, spec(s.parallel.engine)
    if par.micro_batch_size == "auto" and (not engine.micro_batch_auto or s.checkpoint.resume):
        raise ConfigError(
            f"--micro-batch-size auto applies to {_engines(lambda e: e.micro_batch_auto)}, and not "
            "to --resume (pass the micro-batch the run chose: its config.json says)"
        )
    if par.partition == "balanced" and not engine.pipeline:
        raise ConfigError(f"--partition balanced applies to {_engines(lambda e: e.pipeline)}")
    if par.batch_split == "proportional" and not splits_batches(engine):
        raise ConfigError(
            f"--batch-split proportional applies to {_engines(splits_batches)} (a pipeline "
            "balances its stages with --partition balanced; DiLoCo's inner steps in "
            "proportion to speed: --local-steps)"
        )
    engine.check_options(s)
    if s.comm.comm_hook != "none" and not engine.comm_hooks:
        raise ConfigError(
            f"--comm-hook applies to {_engines(lambda e: e.comm_hooks)} (torch's DDP communication "
            f"hooks), not --engine {engine.name}"
        )
    if s.freeze.freeze != "none" and engine.pipeline and engine.freeze and s.recipe.model_ema:
        raise ConfigError(
            "--model-ema does not follow a pipeline whose stages --freeze re-plans; "
            f"use {_engines(lambda e: e.freeze and not e.pipeline)}"
        )


def check_zero_stage(engine_name: str, stage: int, config_name: str) -> None:
    """The DeepSpeed JSON's ZeRO stage against the engine (vit.run.ds_config.resolve)."""
    engine = spec(engine_name)
    if stage in engine.zero_stages:
        return
    if engine.pipeline:
        raise ConfigError(
            f"DeepSpeed config {config_name}: ZeRO stage {stage} does not work with the pipeline "
            "engine (DeepSpeed pipelines accept ZeRO 0 or 1)"
        )
    print(
        f"warning: --engine {engine_name} ignores zero_optimization "
        f"(stage {stage}) in {config_name}",
        file=sys.stderr,
    )


def check_comm_dtype(engine_name: str, cfg: dict, config_name: str) -> None:
    """communication_data_type in the DeepSpeed JSON: only DeepSpeed's engines reduce gradients with
    it."""
    engine = spec(engine_name)
    if cfg.get("communication_data_type") is None or engine.deepspeed:
        return
    instead = " (this engine compresses with --comm-hook fp16 or bf16)" if engine.comm_hooks else ""
    raise ConfigError(
        f"DeepSpeed config {config_name}: communication_data_type applies to "
        f"{_engines(lambda e: e.deepspeed)} (DeepSpeed's gradient all-reduce), not "
        f"--engine {engine_name}{instead}"
    )


def check_precision(requested: str | None, engine_name: str) -> None:
    """Before the process group: a precision the engine cannot train in at all."""
    spec(engine_name).check_precision(requested)


def check_freeze(s, ds_config: dict) -> None:
    """--freeze against the engine and its DeepSpeed JSON (vit.run.plan)."""
    engine = spec(s.parallel.engine)
    if s.freeze.freeze == "none":
        return
    if not engine.freeze:
        able = [n for n in NAMES if spec(n).freeze]
        raise ConfigError(
            f"--freeze works with --engine {', '.join(able[:-1])} and {able[-1]}, not {engine.name}"
        )
    if engine.deepspeed and (
        engine.zero_stage_of(ds_config) == 3
        or ds_config.get("zero_optimization", {}).get("offload_optimizer")
    ):
        raise ConfigError(
            "--freeze works with ZeRO stages 0-2 without optimizer offload (it moves the optimizer "
            "state into the rebuilt engine itself); use such a --ds-config or "
            f"{_engines(lambda e: e.freeze and not e.deepspeed)}"
        )


# What --engine auto chooses; given by hand, each is refused rather than silently replaced: (group,
# option).
AUTO_CHOOSES = (
    ("parallel", "ds_config"),
    ("parallel", "pipeline_stages"),
    ("parallel", "partition"),
    ("parallel", "batch_split"),
    ("comm", "comm_hook"),
    ("asynchrony", "pipe_wire_dtype"),
)
# The engine an --engine auto run is planned as until it chooses (its batch arithmetic sets the
# global batch).
PROVISIONAL = next(e.name for e in SPECS.values() if not e.pipeline and e.micro_batch_auto)


def check_auto_given(names: set[str]) -> None:
    """--engine auto with an option it chooses, given on the command line even at its default: a
    user who says --comm-hook none must not get compression."""
    for _, name in AUTO_CHOOSES:
        if name in names:
            raise ConfigError(
                f"--engine {AUTO} chooses --{name.replace('_', '-')} itself; "
                "leave it out, or name an engine"
            )


# what --auto-allow may name: a candidate's engine or compression that changes what is learned
LEARNING_CHANGES = ("async-pipeline", "diloco", "powersgd")


def check_auto_local_steps(s) -> None:
    """--engine auto --auto-allow diloco: the options of the engines with local steps it may
    choose, checked as theirs."""
    for e in SPECS.values():
        if e.local_steps:
            e.check_options(s)


def auto_may_choose_local_steps(s) -> bool:
    """--engine auto --auto-allow diloco: the options of the diloco it may choose go on to it."""
    return s.parallel.engine == AUTO and "diloco" in auto_allowed(s)


def auto_allowed(s) -> set[str]:
    return {n.strip() for n in s.parallel.auto_allow.split(",") if n.strip()}


def check_auto(s) -> None:
    """--engine auto against the options it decides itself (vit.run.cli.validate)."""
    from dataclasses import fields

    unknown = sorted(auto_allowed(s) - set(LEARNING_CHANGES))
    if unknown:
        raise ConfigError(
            f"--auto-allow {s.parallel.auto_allow}: {', '.join(unknown)} is not one of "
            f"{', '.join(LEARNING_CHANGES)}"
        )

    for group, name in AUTO_CHOOSES:
        default = next(f.default for f in fields(getattr(s, group)) if f.name == name)
        if getattr(getattr(s, group), name) != default:
            raise ConfigError(
                f"--engine {AUTO} chooses --{name.replace('_', '-')} itself; "
                "leave it out, or name an engine"
            )
    if s.parallel.micro_batch_size == AUTO:
        raise ConfigError(
            f"--engine {AUTO} chooses the micro-batch within the global batch; "
            "leave out --micro-batch-size auto (--micro-batch-size N and --grad-accum A set the "
            "global batch: N x A x ranks)"
        )
    if s.freeze.freeze != "none":
        raise ConfigError(
            f"--engine {AUTO} does not plan freeze training yet; name an engine with --freeze"
        )
