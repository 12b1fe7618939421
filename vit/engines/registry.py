"""Every engine, one row each: its spec (what it supports, what it holds, what its step costs, its
names, its options), declared in its own folder under vit/engines/, and the modules VIT_ENGINES
names (vit.runtime.plugins.engine_modules: an engine kept outside vit/, as the tests' is). The
checks between engines and options (vit.run.compat) and every other module read these specs,
never an engine's name. Settings is the run's settings type: the groups every run has and each
engine's own. Importable without torch: the command line and the plan read it before anything heavy
is imported; build() imports the engine's torch module on first use."""

import importlib
import sys
from dataclasses import field, make_dataclass

from vit.core import settings
from vit.core.errors import ConfigError
from vit.core.spec import EngineSpec
from vit.engines import async_pipeline, ddp, diloco, pipeline, zero
from vit.runtime.plugins import engine_modules


def _specs() -> dict[str, EngineSpec]:
    rows = [e.SPEC for e in (zero, pipeline, async_pipeline, ddp, diloco)]
    for name in engine_modules():
        try:
            rows.append(importlib.import_module(name).SPEC)
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                f"VIT_ENGINES: cannot take an engine's SPEC from {name}: {e}"
            ) from None
    specs = {}
    for e in rows:
        if specs.setdefault(e.name, e) is not e:
            raise ConfigError(f"VIT_ENGINES: --engine {e.name} is registered twice")
    return specs


def _settings_type(specs: dict[str, EngineSpec]) -> type:
    """vit.core.settings.Settings with every engine's option groups, in --help after the
    parallel group (one group declared by several engines, as a subclass inherits it, is added
    once)."""
    own: dict[str, tuple[type, str]] = {}
    for e in specs.values():
        for name, group in e.option_groups.items():
            if own.setdefault(name, group)[0] is not group[0] or name in settings.GROUPS:
                raise ConfigError(f"--engine {e.name}: its settings group {name} is taken")
    common = list(settings.GROUPS.items())
    at = list(settings.GROUPS).index("parallel") + 1
    return make_dataclass(
        "Settings",
        [(name, cls, field(default_factory=cls)) for name, (cls, _) in own.items()],
        bases=(settings.Settings,),
        frozen=True,
        namespace={
            "sections": dict([*common[:at], *own.items(), *common[at:]]),
            "__module__": __name__,
            "__doc__": "The run's settings: the groups every run has and every engine's own.",
        },
    )


try:
    SPECS = _specs()
    Settings = _settings_type(SPECS)
except ConfigError as e:
    # at import, before any command's own error handling (vit.train, vit.planner, plot_logs and
    # bench import this first): one line and exit 2, not a traceback
    sys.stderr.write(f"error: {e}\n")
    raise SystemExit(2) from None
NAMES = tuple(SPECS)
# --engine auto: vit.planner.auto picks one of NAMES and its settings once the process group runs
AUTO = "auto"


def spec(name: str) -> EngineSpec:
    """The spec of --engine `name` (the command line allows only NAMES)."""
    return SPECS[name]


def planner_inputs(args: dict) -> dict[str, object]:
    """Every engine's planner_input from a run's options (config.json's names), for
    vit.core.costs.Workload.inputs."""
    inputs = {name: e.planner_input(args) for name, e in SPECS.items()}
    return {name: i for name, i in inputs.items() if i is not None}


def build(name: str, ctx):
    """The engine `name`, built from a vit.engines.base.EngineContext."""
    return importlib.import_module(SPECS[name].module).build(ctx)
