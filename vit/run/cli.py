"""The command line: the parser generated from the settings' fields (vit.engines.registry.Settings:
vit.core.settings' groups and the engines' own; flags, types, choices, help), the checks that span
options, `parse(argv)` and `defaults()` (the settings of a run with no options, for tools and
tests)."""

import argparse
import importlib.util
import math
import sys
import typing
from dataclasses import fields, replace
from pathlib import Path

from vit.core.errors import ConfigError
from vit.core.hostfile import hostfile_slots
from vit.core.paths import ROOT
from vit.core.settings import TRACKERS
from vit.engines.registry import AUTO, NAMES, SPECS, Settings, spec
from vit.run.compat import (
    PROVISIONAL,
    auto_may_choose_local_steps,
    check_auto,
    check_auto_given,
    check_auto_local_steps,
    check_settings,
    needs_of,
)

PROG = "entry_cn.sh"  # the launcher users run: the usage and the training's messages name it


def flag(f) -> tuple[str, ...]:
    given = f.metadata["cli"].get("flag")
    if given:
        return given if isinstance(given, tuple) else (given,)
    return ("--" + f.name.replace("_", "-"),)


def _base_type(f):
    args = [t for t in typing.get_args(f.type) if t is not type(None)]
    return args[0] if args else f.type


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except where there is none to show."""

    def _get_help_string(self, action):
        if action.default in (None, False, ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + error
        raise ConfigError(message)


def from_registry(name: str, cli: dict, help: str) -> tuple[dict, str]:
    """What the settings' types cannot know (vit.core sits below the engines): --engine's choices
    and --ds-config's default per engine."""
    if name == "engine":
        return {**cli, "choices": (*NAMES, AUTO)}, help
    if name == "ds_config":
        return cli, help + ", ".join(f"{e.default_ds_config} for {e.name}" for e in SPECS.values())
    return cli, help


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Train a Vision Transformer with DeepSpeed ZeRO, a DeepSpeed pipeline, or "
        "plain PyTorch DDP. With no options: the tiny ViT on the embedded digits data set.",
        formatter_class=HelpFormatter,
    )
    for cls, title in Settings.sections.values():
        group, exclusive = p.add_argument_group(title), {}
        for f in fields(cls):
            cli = {k: v for k, v in f.metadata["cli"].items() if k not in ("flag", "exclusive")}
            if "exclusive" in f.metadata["cli"]:
                name = f.metadata["cli"]["exclusive"]
                if name not in exclusive:
                    exclusive[name] = group.add_mutually_exclusive_group()
                target = exclusive[name]
            else:
                target = group
            if f.type is bool:
                cli.setdefault("action", "store_true")
            elif "const" not in cli:
                cli.setdefault("type", _base_type(f))
            cli, text = from_registry(f.name, cli, f.metadata["help"])
            target.add_argument(*flag(f), dest=f.name, default=f.default, help=text, **cli)
    return p


def _check(f, value) -> None:
    if value is None or isinstance(value, bool):
        return
    name = flag(f)[0]
    values = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in values):
        raise ConfigError(f"{name} must be a finite number, got {' '.join(map(str, values))}")
    check = f.metadata["check"]
    if check == "positive" and value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    if check == "non_negative" and value < 0:
        raise ConfigError(f"{name} must not be negative, got {value}")
    if check == "probability" and not 0 <= value <= 1:
        raise ConfigError(f"{name} must be between 0 and 1, got {value}")
    if check == "below_one" and not 0 <= value < 1:
        raise ConfigError(f"{name} must be at least 0 and below 1, got {value}")


def from_namespace(ns: argparse.Namespace) -> Settings:
    groups = {}
    for name, (cls, _) in Settings.sections.items():
        values = {f.name: getattr(ns, f.name) for f in fields(cls)}
        for f in fields(cls):
            _check(f, values[f.name])
        groups[name] = cls(**values)
    return Settings(**groups)


def validate(s: Settings) -> Settings:
    """Checks between options, and the defaults that depend on others filled in."""
    par, opt = s.parallel, s.optim
    if par.engine == AUTO:  # checked as the engine it is planned as until vit.planner.auto chooses
        check_auto(s)
        provisional = s.with_(engine=PROVISIONAL, auto_allow="")
        if auto_may_choose_local_steps(s):
            check_auto_local_steps(s)
            provisional = replace(provisional, local=type(s.local)())
        checked = validate(provisional)
        return replace(checked.with_(engine=AUTO, auto_allow=par.auto_allow), local=s.local)
    if opt.min_lr > opt.lr:
        raise ConfigError(f"--min-lr {opt.min_lr:g} is above --lr {opt.lr:g}")
    if par.partition not in ("uniform", "parameters", "balanced") and not par.partition.startswith(
        "type:"
    ):
        raise ConfigError(
            "--partition must be uniform, parameters, balanced or "
            f"type:REGEX, got '{par.partition}'"
        )
    if s.recipe.scale and not 0 < s.recipe.scale[0] <= s.recipe.scale[1] <= 1:
        raise ConfigError(
            f"--scale MIN MAX: a share of the image's area, 0 < MIN <= MAX <= 1, got "
            f"{' '.join(map(str, s.recipe.scale))}"
        )
    if opt.nesterov and (opt.opt != "sgd" or opt.momentum == 0):
        raise ConfigError("--nesterov needs --opt sgd with a --momentum above 0")
    if s.cluster.hostfile and not Path(s.cluster.hostfile).is_file():
        raise ConfigError(f"--hostfile {s.cluster.hostfile}: no such file")
    if s.cluster.hostfile:
        hostfile_slots(s.cluster.hostfile)  # its slots: whole numbers, and a host at least
    if s.checkpoint.resume == "auto" and not (s.checkpoint.save_dir or s.log.log_dir):
        raise ConfigError("--resume needs the run's --log-dir (or --save-dir), or --resume PATH")
    if s.freeze.freeze_alpha > 1:
        raise ConfigError(f"--freeze-alpha must be at most 1, got {s.freeze.freeze_alpha:g}")
    check_settings(s)
    check_effect(s)
    report_to = report_trackers(s.log.report_to)
    ds_config = par.ds_config or str(
        ROOT / "deepspeed_configs" / spec(par.engine).default_ds_config
    )
    return replace(
        s,
        parallel=replace(par, ds_config=ds_config),
        log=replace(s.log, report_to=",".join(report_to) or "none"),
    )


def check_effect(s: Settings) -> None:
    """Refuse an option given (changed from its default) where it has no effect."""
    for name, (cls, _) in s.sections.items():
        group = getattr(s, name)
        for f in fields(cls):
            needs = f.metadata["needs"] and needs_of(f.metadata["needs"], name)
            if needs and getattr(group, f.name) != f.default and not needs[0](s):
                raise ConfigError(f"{flag(f)[0]} has no effect without {needs[1]}")


def report_trackers(value: str) -> tuple[str, ...]:
    """--report-to as the trackers it names, in order ('none' alone: none)."""
    names = [n.strip() for n in value.split(",")]
    if names == ["none"]:
        return ()
    for n in names:
        if n == "none":
            raise ConfigError(f"--report-to {value}: 'none' cannot be combined with trackers")
        if n not in TRACKERS:
            raise ConfigError(
                f"--report-to: unknown tracker '{n}'; choose none or from {', '.join(TRACKERS)}"
            )
        if importlib.util.find_spec(n) is None:
            raise ConfigError(
                f"--report-to {n}: the {n} package is not installed "
                f"(scripts/bootstrap.sh installs it)"
            )
    return tuple(dict.fromkeys(names))


def given(argv: list[str]) -> set[str]:
    """The options the command line names (by field name), defaults or not."""
    p = parser()
    for action in p._actions:  # noqa: SLF001 (argparse's list of arguments)
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def parse(argv=None) -> Settings:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    settings = from_namespace(parser().parse_args(argv))
    if settings.parallel.engine == AUTO:
        check_auto_given(given(argv))
    return validate(settings)


def defaults() -> Settings:
    """The settings of a run with no options (its defaults filled in), for tools and tests."""
    return validate(Settings())
