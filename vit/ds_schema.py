"""The DeepSpeed JSON checked against what the installed DeepSpeed reads, before any process group starts.

DeepSpeed ignores unknown top-level keys, so a typo such as "zero_optimisation" silently trains
without ZeRO. Here an unknown key is an error that suggests the nearest valid one.
"""
import copy
import difflib
from functools import cache

from vit.errors import ConfigError

# Top-level values DeepSpeed reads without checking their type.
SCALAR_TYPES = {
    "gradient_clipping": (int, float), "steps_per_print": int, "wall_clock_breakdown": bool,
    "memory_breakdown": bool, "prescale_gradients": bool, "gradient_predivide_factor": (int, float),
    "zero_allow_untested_optimizer": bool, "zero_force_ds_cpu_optimizer": bool, "dump_state": bool,
}
MONITORS = {"tensorboard": "tensorboard", "wandb": "wandb", "csv_monitor": "csv", "comet": None}
SECTIONS = ("fp16", "bf16", "zero_optimization", "activation_checkpointing", "flops_profiler", "pipeline",
            "comms_logger", "compile", *MONITORS)


@cache
def top_level_keys() -> frozenset[str]:
    """Every top-level key DeepSpeedConfig looks up, recorded while it parses a minimal config."""
    from deepspeed.runtime.config import DeepSpeedConfig

    seen = set()

    class Keys:
        def __init__(self, d):
            self.d = d

        def __contains__(self, k):
            seen.add(k)
            return dict.__contains__(self.d, k)

        def __iter__(self):
            return iter(dict.keys(self.d))

    class Recording(dict):
        def __getitem__(self, k):
            seen.add(k)
            return super().__getitem__(k)

        def get(self, k, default=None):
            seen.add(k)
            return super().get(k, default)

        def __contains__(self, k):
            seen.add(k)
            return super().__contains__(k)

        def keys(self):
            return Keys(self)

    DeepSpeedConfig(Recording(train_micro_batch_size_per_gpu=1))
    return frozenset(seen | {"sequence_parallel_size"})  # read before parsing, only with a process group


def _autos(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _autos(v, f"{path}.{k}" if path else k)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _autos(v, f"{path}[{i}]")
    elif obj == "auto":
        yield path


def _nearest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _section_keys(section: str) -> set[str]:
    """The keys DeepSpeed's pydantic model of a section accepts (empty for sections without one)."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    models = {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config}
    model = models.get(section)
    if model is None:
        return set()
    return set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


def validate(cfg: dict, name: str) -> None:
    autos = list(_autos(cfg))
    if autos:
        raise ConfigError(f"DeepSpeed config {name}: {autos[0]} is \"auto\"; \"auto\" is filled in by the Hugging "
                          "Face Trainer, not by DeepSpeed: set a value")
    valid = top_level_keys()
    for key in cfg:
        if key not in valid:
            raise ConfigError(f"DeepSpeed config {name}: unknown key '{key}'{_nearest(key, valid)}")
    for key, types in SCALAR_TYPES.items():
        if key in cfg and not _is(cfg[key], types):
            raise ConfigError(f"DeepSpeed config {name}: {key} must be {_type_name(types)}, got {cfg[key]!r}")
    for key in SECTIONS:
        if key in cfg and not isinstance(cfg[key], dict):
            raise ConfigError(f"DeepSpeed config {name}: {key} must be an object, got {cfg[key]!r}")
    for key, tracker in MONITORS.items():
        if key in cfg and cfg[key].get("enabled"):  # DeepSpeed's own monitor would start a second tracker
            use = f"--report-to {tracker}" if tracker else f"--report-to ({', '.join(filter(None, MONITORS.values()))})"
            raise ConfigError(f"DeepSpeed config {name}: \"{key}\" is DeepSpeed's own monitor; remove it and use "
                              f"{use} instead")


def _is(value, types) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    return isinstance(value, types) and (bool in types or not isinstance(value, bool))


def _type_name(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return "a number" if float in types else {int: "an integer", bool: "true or false"}[types[0]]


def deepspeed_parses(cfg: dict, name: str) -> None:
    """Let DeepSpeed's own parser (pydantic models for the sections) have its say, in one line."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    probe = copy.deepcopy(cfg)
    probe.pop("train_batch_size", None)  # without a process group DeepSpeed assumes one rank
    try:
        DeepSpeedConfig(probe)
    except ValidationError as e:
        err = e.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else ""
        section = next((k for k, v in cfg.items() if isinstance(v, dict) and key in v), None)
        where = ".".join([section, *map(str, err["loc"])] if section else map(str, err["loc"]))
        if err["type"] == "extra_forbidden":
            hint = _nearest(key, _section_keys(section)) if section else ""
            raise ConfigError(f"DeepSpeed config {name}: unknown key '{where}'{hint}") from None
        raise ConfigError(f"DeepSpeed config {name}: {where}: {err['msg']}") from None
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"DeepSpeed config {name}: DeepSpeed rejects it: {str(e).splitlines()[0]}") from None
