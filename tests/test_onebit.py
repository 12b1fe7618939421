"""DeepSpeed's 1-bit optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB) are refused in one line, asked
for by --opt or by the JSON's optimizer section, because the pinned DeepSpeed no longer has them
(vit/core/onebit.py cites its source; the first test checks that the installed one still lacks
them). communication_data_type in the DeepSpeed JSON is read as DeepSpeed reads it and applies only
to DeepSpeed's engines."""

import importlib.util
import json

import pytest
from helpers import plan_in_process

from vit.core.errors import ConfigError
from vit.core.settings import ParallelSettings
from vit.engines.registry import NAMES, spec
from vit.run.cli import parse
from vit.run.ds_config import resolve

ALTERNATIVES = (
    "for smaller gradients use --engine ddp --comm-hook fp16, bf16 or powersgd, or "
    "communication_data_type "
    "fp16 or bf16 in the DeepSpeed JSON (docs/ethernet.md)"
)


def removed(what: str, kind: str) -> str:
    return (
        f"DeepSpeed's {what} (optimizer type {kind}) was removed from DeepSpeed "
        f"(deepspeedai/DeepSpeed#8490): the "
        f"pinned 0.19.8 would refuse it at deepspeed.initialize ('not a supported DeepSpeed "
        f"Optimizer'); "
        f"{ALTERNATIVES}"
    )


def resolve_file(tmp_path, engine="zero", **cfg):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, **cfg}))
    return resolve(ParallelSettings(engine=engine, ds_config=str(path)), 2)[0]


def test_the_installed_deepspeed_has_no_onebit_optimizers():
    """What vit/core/onebit.py says of DeepSpeed 0.19.8: should an upgrade bring them back, this
    fails first."""
    from deepspeed.runtime import config
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert not {"onebitadam", "zerooneadam", "onebitlamb"} & set(config.DEEPSPEED_OPTIMIZERS)
    for kind in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb"):  # what deepspeed.initialize asserts on
        assert not DeepSpeedEngine._is_supported_optimizer(None, kind)  # noqa: SLF001
    for module in (
        "deepspeed.runtime.fp16.onebit",
        "deepspeed.runtime.comm.nccl",
        "deepspeed.runtime.comm.mpi",
        "deepspeed.runtime.comm.compressed",
        "deepspeed.runtime.comm.hccl",
    ):
        assert importlib.util.find_spec(module) is None, module


DEEPSPEED = [n for n in NAMES if spec(n).deepspeed]  # the engines that read the JSON's sections


@pytest.mark.parametrize(
    "name,what,kind",
    [
        ("onebitadam", "1-bit Adam", "OneBitAdam"),
        ("zerooneadam", "0/1 Adam", "ZeroOneAdam"),
        ("onebitlamb", "1-bit LAMB", "OneBitLamb"),
        ("OneBitAdam", "1-bit Adam", "OneBitAdam"),
    ],
)
def test_opt_names_a_removed_optimizer_in_one_line(name, what, kind):
    for argv in (["--opt", name], ["--engine", "pipeline", "--opt", name]):
        with pytest.raises(ConfigError) as e:
            parse(argv)
        assert str(e.value) == f"argument --opt: {name}: {removed(what, kind)}"


def test_other_opt_names_are_unchanged():
    assert parse(["--opt", "sgd"]).optim.opt == "sgd" and parse([]).optim.opt == "adamw"
    with pytest.raises(
        ConfigError,
        match=r"^argument --opt: invalid choice: 'lamb' \(choose from "
        r"'adamw', 'sgd'\)$",
    ):
        parse(["--opt", "lamb"])


@pytest.mark.parametrize(
    "kind,what",
    [("OneBitAdam", "1-bit Adam"), ("zerooneadam", "0/1 Adam"), ("OneBitLamb", "1-bit LAMB")],
)
@pytest.mark.parametrize("engine", DEEPSPEED)
def test_a_json_onebit_optimizer_is_refused_with_the_reason(tmp_path, kind, what, engine):
    section = {
        "type": kind,
        "params": {"lr": 1e-3, "freeze_step": 100, "comm_backend_name": "nccl"},
    }
    with pytest.raises(ConfigError) as e:
        resolve_file(tmp_path, engine, optimizer=section, fp16={"enabled": True})
    assert str(e.value) == (
        f"DeepSpeed config {tmp_path / 'ds.json'}: optimizer {kind!r}: "
        f"{removed(what, kind.replace('zerooneadam', 'ZeroOneAdam'))}"
    )


def test_any_other_json_optimizer_is_still_refused(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"remove 'optimizer'; the optimizer \(AdamW\) and the LR "
        r"schedule come ",
    ):
        resolve_file(tmp_path, optimizer={"type": "Adam", "params": {"lr": 1e-3}})


@pytest.mark.parametrize("value", ["fp16", "bf16", "fp32", "BF16"])
@pytest.mark.parametrize("engine", DEEPSPEED)
def test_communication_data_type_is_taken_by_the_deepspeed_engines(tmp_path, value, engine):
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = resolve_file(
        tmp_path, engine, communication_data_type=value, zero_optimization={"stage": 1}
    )
    assert cfg["communication_data_type"] == value
    read = DeepSpeedConfig(
        {k: v for k, v in cfg.items() if k != "train_batch_size"}
    ).communication_data_type
    assert (
        read
        == {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[value.lower()]
    )


@pytest.mark.parametrize("value", ["int8", "half16", 16, True])
def test_communication_data_type_is_read_as_deepspeed_reads_it(tmp_path, value):
    with pytest.raises(ConfigError) as e:
        resolve_file(tmp_path, communication_data_type=value)
    assert str(e.value) == (
        f"DeepSpeed config {tmp_path / 'ds.json'}: communication_data_type "
        f"must be 'fp16', 'bf16' "
        f"or 'fp32', got {value!r}"
    )


@pytest.mark.parametrize(
    "engine,instead",
    [("ddp", " (this engine compresses with --comm-hook fp16 or bf16)"), ("async-pipeline", "")],
)
def test_communication_data_type_is_refused_where_deepspeed_does_not_reduce(
    tmp_path, engine, instead
):
    with pytest.raises(ConfigError) as e:
        resolve_file(tmp_path, engine, communication_data_type="bf16")
    assert str(e.value) == (
        f"DeepSpeed config {tmp_path / 'ds.json'}: communication_data_type "
        f"applies to --engine "
        f"zero or pipeline (DeepSpeed's gradient all-reduce), not --engine "
        f"{engine}{instead}"
    )


def test_refusals_stop_before_the_process_group(tmp_path, monkeypatch):
    """Where vit.train refuses them, before any process group (in-process; test_train.py runs one
    refusal through the command a user runs: exit 2, the reason as the last line, no traceback):
    the reason in one line, nothing written."""
    ds = tmp_path / "onebit.json"
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 8,
                "fp16": {"enabled": True},
                "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 10}},
            }
        )
    )
    for argv, last in (
        (
            ["--opt", "onebitadam"],
            f"argument --opt: onebitadam: {removed('1-bit Adam', 'OneBitAdam')}",
        ),
        (
            ["--ds-config", ds],
            f"DeepSpeed config {ds}: optimizer 'OneBitAdam': {removed('1-bit Adam', 'OneBitAdam')}",
        ),
    ):
        with pytest.raises(ConfigError) as e:
            plan_in_process(monkeypatch, [*argv, "--log-dir", tmp_path / "run"])
        assert str(e.value) == last
        assert not (tmp_path / "run").exists()
