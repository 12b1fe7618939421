"""Every engine, one row each: its spec (what it supports, what it holds, what its step costs, its
names), declared in its own folder under vit/engines/. The checks between engines and options
(vit.config.compat) and every other module read these specs, never an engine's name. Importable
without torch: the command line and the plan read it before anything heavy is imported; build()
imports the engine's torch module on first use."""

import importlib

from vit.core.spec import EngineSpec
from vit.engines import async_pipeline, ddp, diloco, pipeline, zero

SPECS: dict[str, EngineSpec] = {
    e.SPEC.name: e.SPEC for e in (zero, pipeline, async_pipeline, ddp, diloco)
}
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
