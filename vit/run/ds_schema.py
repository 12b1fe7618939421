"""The DeepSpeed JSON checked against what the installed DeepSpeed reads, before any process group
starts.

DeepSpeed ignores unknown top-level keys, so a typo such as "zero_optimisation" silently trains
without ZeRO. Here an unknown key is an error that suggests the nearest valid one.

Values are read as written. DeepSpeed reads some keys from the raw dict (fp16.enabled: "false" is a
true string there) and its pydantic models coerce others ("12" becomes 12), so every value of a
section DeepSpeed has a pydantic model for is checked against that model's field types and bounds,
strictly: a boolean is a JSON boolean, a number a JSON number. Top-level scalars have no model: they
are typed here.
"""

import copy
import difflib
import enum
import importlib
import operator
import types
import typing
from functools import cache

import annotated_types as at
import pydantic

from vit.core.errors import ConfigError

# Top-level values DeepSpeed reads without checking their type or range (no pydantic model).
SCALAR_TYPES = {
    "gradient_clipping": typing.Annotated[float, at.Ge(0)],
    "steps_per_print": typing.Annotated[int, at.Gt(0)],
    "wall_clock_breakdown": bool,
    "memory_breakdown": bool,
    "prescale_gradients": bool,
    "gradient_predivide_factor": typing.Annotated[float, at.Gt(0)],
    "zero_allow_untested_optimizer": bool,
    "zero_force_ds_cpu_optimizer": bool,
    "dump_state": bool,
}
# Top-level dtypes DeepSpeed lower-cases and maps itself (runtime/config.py:216-230): any other
# string is a ValueError and a non-string an AttributeError there. communication_data_type: the
# dtype of the gradient all-reduce and reduce-scatter of the DeepSpeed engines
# (runtime/engine.py:1719-1730 and 3795-3820; ZeRO 1-2: runtime/zero/stage_1_and_2.py:1420,
# 1590-1720, 2361-2389); default: the training precision.
DTYPE_KEYS, DTYPE_NAMES = (
    ("communication_data_type", "seq_parallel_communication_data_type"),
    ("fp16", "bf16", "fp32"),
)
# Each section and DeepSpeed's pydantic model of it (None: DeepSpeed has none; only "an object" is
# checked).
SECTIONS = {
    "fp16": "deepspeed.runtime.precision_config:DeepSpeedFP16Config",
    "bf16": "deepspeed.runtime.precision_config:DeepSpeedBF16Config",
    "zero_optimization": "deepspeed.runtime.zero.config:DeepSpeedZeroConfig",
    "comms_logger": "deepspeed.comm.config:CommsLoggerConfig",
    "tensorboard": "deepspeed.monitor.config:TensorBoardConfig",
    "wandb": "deepspeed.monitor.config:WandbConfig",
    "csv_monitor": "deepspeed.monitor.config:CSVConfig",
    "compile": "deepspeed.compile.config:CompileConfig",
    "activation_checkpointing": None,
    "flops_profiler": None,
    "pipeline": None,
}
# DeepSpeed's own monitors, and the --report-to tracker that replaces each.
MONITORS = {"tensorboard": "tensorboard", "wandb": "wandb", "csv_monitor": "csv", "comet": None}
# Bounds DeepSpeed's models leave out, where a value outside them breaks training (a zero bucket, a
# loss scale window of 0, a negative scale power).
EXTRA_BOUNDS = {
    "fp16.loss_scale": at.Ge(0),
    "fp16.initial_scale_power": at.Ge(0),
    "fp16.loss_scale_window": at.Gt(0),
    "fp16.hysteresis": at.Gt(0),
    "fp16.min_loss_scale": at.Gt(0),
    "zero_optimization.allgather_bucket_size": at.Gt(0),
    "zero_optimization.stage3_prefetch_bucket_size": at.Gt(0),
    "zero_optimization.sub_group_size": at.Gt(0),
}


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
    # read before parsing, only with a process group
    return frozenset(seen | {"sequence_parallel_size"})


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


def _model(section: str):
    where = SECTIONS.get(section)
    if where is None:
        return None
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


def _fields(model) -> dict:
    """A pydantic model's fields by every name a JSON file may use (name and alias)."""
    return {**model.model_fields, **{f.alias: f for f in model.model_fields.values() if f.alias}}


def _section_keys(section: str) -> set[str]:
    """The keys DeepSpeed's pydantic model of a section accepts (empty for sections without one)."""
    model = _model(section)
    return set(_fields(model)) if model else set()


def _kind(annotation, value) -> str | None:
    """What `value` should be but is not, for a field of this type; None when it fits (or the type
    is one DeepSpeed's own parser checks well: strings, lists, literals)."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        wants = [_kind(a, value) for a in options]
        return None if None in wants else wants[0]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is bool:
        return None if isinstance(value, bool) else "true or false"
    if annotation is int:  # 5e8 is how people write bucket sizes; JSON reads it as a float
        return None if number and float(value).is_integer() else "an integer"
    if annotation is float:
        return None if number else "a number"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        allowed = [e.value for e in annotation]
        ok = any(value == a and type(value) is type(a) for a in allowed)
        return None if ok else " or ".join(", ".join(map(repr, allowed)).rsplit(", ", 1))
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return None if isinstance(value, dict) else "an object"
    return None


def _bounds(annotation, field_metadata) -> list:
    extra = (
        list(typing.get_args(annotation)[1:])
        if typing.get_origin(annotation) is typing.Annotated
        else []
    )
    return [m for m in [*field_metadata, *extra] if isinstance(m, (at.Gt, at.Ge, at.Lt, at.Le))]


def _outside(value, bound) -> str | None:
    for kind, attr, sign, ok in (
        (at.Gt, "gt", ">", operator.gt),
        (at.Ge, "ge", ">=", operator.ge),
        (at.Lt, "lt", "<", operator.lt),
        (at.Le, "le", "<=", operator.le),
    ):
        if isinstance(bound, kind):
            limit = getattr(bound, attr)
            return None if ok(value, limit) else f"must be {sign} {limit}"
    return None


def check_value(path: str, annotation, value, metadata=()) -> None:
    """Raise ValueError("<path> must be ..., got ...") unless value fits the type and its bounds."""
    want = _kind(annotation, value)
    if want is not None:
        raise ValueError(f"{path} must be {want}, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        extra = [EXTRA_BOUNDS[path]] if path in EXTRA_BOUNDS else []
        for bound in [*_bounds(annotation, metadata), *extra]:
            problem = _outside(value, bound)
            if problem:
                raise ValueError(f"{path} {problem}, got {value!r}")


def check_section(path: str, model, section: dict) -> None:
    """Every value of a section against DeepSpeed's pydantic model of it, nested models included."""
    fields = _fields(model)
    for key, value in section.items():
        field = fields.get(key)
        if field is None:
            # unknown keys: DeepSpeed's parser names them, with a suggestion (deepspeed_parses)
            continue
        check_value(f"{path}.{key}", field.annotation, value, field.metadata)
        inner = [
            a
            for a in (field.annotation, *typing.get_args(field.annotation))
            if isinstance(a, type) and issubclass(a, pydantic.BaseModel)
        ]
        if inner and isinstance(value, dict):
            check_section(f"{path}.{key}", inner[0], value)


def validate(cfg: dict, name: str) -> None:
    autos = list(_autos(cfg))
    if autos:
        raise ConfigError(
            f'DeepSpeed config {name}: {autos[0]} is "auto"; "auto" is filled in by the Hugging '
            "Face Trainer, not by DeepSpeed: set a value"
        )
    valid = top_level_keys()
    for key in cfg:
        if key not in valid:
            raise ConfigError(f"DeepSpeed config {name}: unknown key '{key}'{_nearest(key, valid)}")
    refuse_monitors(cfg, name)
    try:
        for key, annotation in SCALAR_TYPES.items():
            if key in cfg:
                check_value(key, annotation, cfg[key])
        for key in DTYPE_KEYS:
            if cfg.get(key) is not None and (
                not isinstance(cfg[key], str) or cfg[key].lower() not in DTYPE_NAMES
            ):
                raise ValueError(f"{key} must be 'fp16', 'bf16' or 'fp32', got {cfg[key]!r}")
        for key in SECTIONS:
            if key in cfg and not isinstance(cfg[key], dict):
                raise ValueError(f"{key} must be an object, got {cfg[key]!r}")
            if key in cfg and _model(key) is not None:
                check_section(key, _model(key), cfg[key])
    except ValueError as e:
        raise ConfigError(f"DeepSpeed config {name}: {e}") from None


def refuse_monitors(cfg: dict, name: str) -> None:
    """DeepSpeed's own monitor would start a second tracker, on every rank; --report-to is rank
    0's."""
    for key, tracker in MONITORS.items():
        # "true" as a string: the schema says so
        if isinstance(cfg.get(key), dict) and cfg[key].get("enabled") is True:
            use = (
                f"--report-to {tracker}"
                if tracker
                else f"--report-to ({', '.join(filter(None, MONITORS.values()))})"
            )
            raise ConfigError(
                f'DeepSpeed config {name}: "{key}" is DeepSpeed\'s own monitor; '
                f"remove it and use {use} instead"
            )


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
        raise ConfigError(
            f"DeepSpeed config {name}: DeepSpeed rejects it: {str(e).splitlines()[0]}"
        ) from None
