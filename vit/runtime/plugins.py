"""Plugins: modules named in VIT_PLUGINS (comma-separated, found on PYTHONPATH) that every rank
imports at start, and the few hooks they may add functions to; and VIT_ENGINES, modules that each
declare an engine's SPEC, which vit.engines.registry adds to its rows (engine_modules). The tests
inject faults into real runs this way (tests/plugins/), and add an engine from outside vit/
(tests/engines/), so that no library module reads a test's environment variable or names its
engine.

A plugin calls `add(hook, fn)` when it is imported; the library calls each hook's functions in the
order added:
- "start": fn(rank, watchdog), once the process group and the watchdog (vit.runtime.faults) run,
  before the census;
- "census": fn(report), this rank's census report (a dict, vit.planner.census.capabilities) before
  it is gathered, which fn may change;
- "checkpoint_written": fn(tag), this rank has written a checkpoint's files and the manifest is not
  yet written;
- "async_forward": fn(engine, k, weights), the async pipeline forwarded micro-batch k on `weights`
  (by name);
- "async_backward": fn(engine, k, inflight, weights), and backwarded it (inflight:
  vit.engines.async_pipeline.engine's InFlight record of its forward)."""

import importlib
import os
from collections.abc import Callable

from vit.core.errors import ConfigError

HOOKS: dict[str, list[Callable]] = {
    name: []
    for name in ("start", "census", "checkpoint_written", "async_forward", "async_backward")
}


def load() -> list[str]:
    """Import the modules VIT_PLUGINS names; their names. One that cannot be imported is a
    ConfigError."""
    names = _listed("VIT_PLUGINS")
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"VIT_PLUGINS: cannot import {name}: {e}") from None
    return names


def engine_modules() -> list[str]:
    """The modules VIT_ENGINES names (comma-separated, found on PYTHONPATH): each holds an engine's
    folder, laid out as vit/engines/<engine>/ (a SPEC in its __init__.py)."""
    return _listed("VIT_ENGINES")


def _listed(variable: str) -> list[str]:
    """The module names a comma-separated environment variable lists."""
    return [n.strip() for n in os.environ.get(variable, "").split(",") if n.strip()]


def add(hook: str, fn: Callable) -> None:
    if hook not in HOOKS:
        raise ValueError(f"no plugin hook {hook!r}; the hooks are {', '.join(HOOKS)}")
    HOOKS[hook].append(fn)


def call(hook: str, *args) -> None:
    for fn in HOOKS[hook]:
        fn(*args)
