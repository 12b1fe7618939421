"""The DeepSpeed JSON read as written (in-process): booleans are JSON booleans, numbers are numbers,
values in range; types and bounds come from DeepSpeed's own pydantic models of the sections; every
error names the file and the key path."""

import json

import pytest

from vit.core.errors import ConfigError
from vit.core.settings import ParallelSettings
from vit.run.ds_config import precision_of, resolve


def resolve_file(tmp_path, **cfg):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, **cfg}))
    return resolve(ParallelSettings(engine="zero", ds_config=str(path)), 2)


@pytest.mark.parametrize(
    "cfg,message",
    [
        ({"fp16": {"enabled": "false"}}, "fp16.enabled must be true or false, got 'false'"),
        ({"bf16": {"enabled": "no"}}, "bf16.enabled must be true or false, got 'no'"),
        ({"bf16": {"enabled": 0}}, "bf16.enabled must be true or false, got 0"),
        (
            {"fp16": {"enabled": True, "initial_scale_power": "12"}},
            "fp16.initial_scale_power must be an integer, got '12'",
        ),
        (
            {"fp16": {"enabled": True, "initial_scale_power": 12.5}},
            "fp16.initial_scale_power must be an integer, got 12.5",
        ),
        (
            {"fp16": {"enabled": True, "initial_scale_power": -1}},
            "fp16.initial_scale_power must be >= 0, got -1",
        ),
        ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale must be >= 0, got -1"),
        (
            {"fp16": {"enabled": True, "loss_scale_window": 0}},
            "fp16.loss_scale_window must be > 0, got 0",
        ),
        (
            {"fp16": {"enabled": True, "min_loss_scale": 0}},
            "fp16.min_loss_scale must be > 0, got 0",
        ),
        ({"gradient_clipping": -1.0}, "gradient_clipping must be >= 0, got -1.0"),
        ({"gradient_clipping": True}, "gradient_clipping must be a number, got True"),
        ({"steps_per_print": 0}, "steps_per_print must be > 0, got 0"),
        (
            {"wall_clock_breakdown": "true"},
            "wall_clock_breakdown must be true or false, got 'true'",
        ),
        (
            {"zero_optimization": {"stage": True}},
            "zero_optimization.stage must be 0, 1, 2 or 3, got True",
        ),
        (
            {"zero_optimization": {"stage": 2, "overlap_comm": "false"}},
            "zero_optimization.overlap_comm must be true or false, got 'false'",
        ),
        (
            {"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}},
            "zero_optimization.reduce_bucket_size must be > 0, got 0",
        ),
        (
            {"zero_optimization": {"stage": 2, "allgather_bucket_size": 0}},
            "zero_optimization.allgather_bucket_size must be > 0, got 0",
        ),
        (
            {"zero_optimization": {"stage": 2, "reduce_bucket_size": "5e8"}},
            "zero_optimization.reduce_bucket_size must be an integer, got '5e8'",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "offload_optimizer": {"device": "cpu", "pin_memory": "yes"},
                }
            },
            "zero_optimization.offload_optimizer.pin_memory must be true or false, got 'yes'",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
            "zero_optimization.offload_optimizer.device must be 'none', 'cpu' or 'nvme', got 'gpu'",
        ),
        (
            {"tensorboard": {"enabled": "false"}},
            "tensorboard.enabled must be true or false, got 'false'",
        ),
    ],
    ids=lambda v: None if isinstance(v, str) else json.dumps(v)[:60],
)
def test_values_are_read_as_written(tmp_path, cfg, message):
    with pytest.raises(ConfigError) as e:
        resolve_file(tmp_path, **cfg)
    assert str(e.value) == f"DeepSpeed config {tmp_path / 'ds.json'}: {message}"


@pytest.mark.parametrize(
    "cfg",
    [
        # 5e8 is a float
        {
            "zero_optimization": {
                "stage": 2,
                "reduce_bucket_size": 5e8,
                "allgather_bucket_size": 2e8,
            }
        },
        {"fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 12}},
        {"gradient_clipping": 1},  # an integer is a number
        {
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
            }
        },
    ],
)
def test_what_deepspeed_users_write_is_accepted(tmp_path, cfg):
    resolve_file(tmp_path, **cfg)


def test_disabled_precision_stays_off(tmp_path):
    cfg, _ = resolve_file(tmp_path, fp16={"enabled": False}, bf16={"enabled": False})
    assert precision_of(cfg) == "fp32"
