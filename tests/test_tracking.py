"""--report-to (TensorBoard, W&B offline, CSV) read back with the trackers' own readers and compared
with metrics_rank0.jsonl, a resumed run continuing the same W&B run and TensorBoard folder,
DeepSpeed's own monitor sections refused, and the default job's quiet console."""

import csv
import json
import os
import re
import sys
from pathlib import Path

import pytest
from helpers import MPIRUN, ROOT, base_env, launch, read_jsonl, run_cmd

from vit.core.errors import ConfigError
from vit.run import ds_schema
from vit.run.cli import parse

FAKE_BIN = ROOT / "tests" / "fake_bin"
TRAIN = [
    "--log-interval",
    5,
    "--eval-interval",
    10,
    "--monitor-interval",
    0.1,
    "--report-to",
    "tensorboard,wandb,csv",
    "--monitor-backend",
    "gputil",
]
# Each tracker scalar and the field of metrics_rank0.jsonl it must equal.
FIELDS = {
    "train/loss": ("train", "loss"),
    "train/lr": ("train", "lr"),
    "train/images_per_s": ("train", "images_per_s"),
    "train/step_time_s": ("train", "step_time_s"),
    "train/forward_s": ("train", "forward_s"),
    "train/backward_s": ("train", "backward_s"),
    "train/optimizer_s": ("train", "optimizer_s"),
    "train/data_s": ("train", "data_s"),
    "train/mem_gib": ("train", "mem_gib"),
    "train/skipped_steps": ("train", "skipped_steps"),
    "eval/loss": ("eval", "eval_loss"),
    "eval/top1": ("eval", "top1"),
}


def expected(log_dir) -> dict[str, dict[int, float]]:
    records = read_jsonl(Path(log_dir) / "metrics_rank0.jsonl")
    return {
        name: {r["step"]: r[field] for r in records if r["kind"] == kind}
        for name, (kind, field) in FIELDS.items()
    }


def tensorboard_scalars(folder) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={SCALARS: 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        assert len({e.step for e in events}) == len(events), (
            f"{tag}: a step twice: {[e.step for e in events]}"
        )
        out[tag] = {e.step: e.value for e in events}
    return out


def tensorboard_images(folder) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={IMAGES: 0})
    acc.Reload()
    return acc.Tags()["images"]


def wandb_records(path) -> list:
    """The records of an offline run's .wandb file: W&B's LevelDB-style log (32 KiB blocks, each
    chunk behind a 7-byte header: crc32c, length, type), each record one wandb_internal_pb2.Record.
    """
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunks, records = Path(path).read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # the padding at a block's end
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def wandb_history(records) -> dict[str, dict[int, float]]:
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            for item in r.history.item:
                out.setdefault(item.key or "/".join(item.nested_key), {})[r.history.step.num] = (
                    json.loads(item.value_json)
                )
    return out


def wandb_runs(log_dir) -> list[Path]:
    return sorted((Path(log_dir) / "wandb").glob("offline-run-*/run-*.wandb"))


def track(log_dir, *extra, steps=20):
    """A 2-rank run reporting to every tracker, W&B offline, with the fake nvidia-smi's GPUs in the
    monitor."""
    args = [*TRAIN, "--steps", steps, "--log-dir", log_dir, *extra]
    env = {"WANDB_MODE": "offline", "PATH": f"{FAKE_BIN}:{os.environ['PATH']}"}
    r = launch(args, env=env, timeout=300)
    assert r.ok, r
    return r


@pytest.mark.ranks
@pytest.mark.timeout(360)
def test_trackers_hold_what_the_metrics_log_holds(tmp_path):
    log_dir = tmp_path / "run-a"
    r = track(log_dir, "--no-save")
    want = expected(log_dir)
    assert sorted(want["train/loss"]) == [5, 10, 15, 20] and sorted(want["eval/top1"]) == [10, 20]

    tb = tensorboard_scalars(log_dir / "tensorboard")
    for name, steps in want.items():
        assert tb[name] == pytest.approx(steps, rel=1e-6), name  # TensorBoard keeps float32
    # The fake nvidia-smi's two GPUs, per host, from the monitor.
    host = read_jsonl(log_dir / "monitor_rank0.jsonl")[0]["host"]
    assert set(tb[f"monitor/{host}/gpu0/util_pct"].values()) == {87.0}
    assert set(tb[f"monitor/{host}/gpu1/mem_used_mib"].values()) == {1024.0}
    assert f"monitor/{host}/cpu_percent" in tb

    # plot_logs.py's charts of one run, kept by both
    charts = {"loss", "throughput", "resources", "breakdown"}
    assert {f"plots/{c}" for c in charts} <= set(tensorboard_images(log_dir / "tensorboard")), (
        "charts in TensorBoard"
    )

    [run_file] = wandb_runs(log_dir)
    records = wandb_records(run_file)
    history = wandb_history(records)
    for name, steps in want.items():
        assert history[name] == steps, name
    [artifact] = [rec.artifact for rec in records if rec.WhichOneof("record_type") == "artifact"]
    assert artifact.type == "plots" and {e.path for e in artifact.manifest.contents} >= {
        f"{c}.png" for c in charts
    }
    assert history[f"monitor/{host}/gpu0/util_pct"] == tb[f"monitor/{host}/gpu0/util_pct"]
    [run] = [rec.run for rec in records if rec.WhichOneof("record_type") == "run"]
    assert (
        run.display_name == "run-a" and run.run_id == (log_dir / "wandb_run_id").read_text().strip()
    )
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["config"]["args"]["report_to"] == "tensorboard,wandb,csv"
    assert config["cluster"] == json.loads((log_dir / "cluster.json").read_text())
    assert f"wandb sync {run_file.parent}" in r.outputs[0]

    with open(log_dir / "tracking.csv") as f:
        rows = list(csv.DictReader(f))
    for name, steps in want.items():
        assert {
            int(row["step"]): float(row["value"]) for row in rows if row["name"] == name
        } == steps, name


@pytest.mark.ranks
@pytest.mark.timeout(480)
def test_a_resumed_run_continues_the_same_wandb_run_and_tensorboard_folder(tmp_path):
    log_dir = tmp_path / "run-b"
    track(log_dir, steps=10)
    track(log_dir, "--resume", steps=20)
    run_id = (log_dir / "wandb_run_id").read_text().strip()
    runs = wandb_runs(log_dir)
    # one W&B run, written by two attempts
    assert [p.name for p in runs] == [f"run-{run_id}.wandb"] * 2
    history = {}
    for path in runs:
        for name, steps in wandb_history(wandb_records(path)).items():
            history.setdefault(name, {}).update(steps)
    assert history["train/loss"] == expected(log_dir)["train/loss"]
    assert sorted(history["train/loss"]) == [5, 10, 15, 20]
    assert len(list((log_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert tensorboard_scalars(log_dir / "tensorboard")["train/loss"] == pytest.approx(
        history["train/loss"]
    )


def test_report_to_is_checked_before_anything_starts():
    assert parse(["--report-to", "csv, tensorboard,csv"]).log.report_to == "csv,tensorboard"
    assert parse([]).log.report_to == "none"
    with pytest.raises(
        ConfigError, match="--report-to: unknown tracker 'mlflow'; choose none or from tensorboard"
    ):
        parse(["--report-to", "tensorboard,mlflow"])
    with pytest.raises(ConfigError, match="'none' cannot be combined"):
        parse(["--report-to", "none,wandb"])


@pytest.mark.parametrize(
    "section,hint",
    [
        ("tensorboard", "--report-to tensorboard"),
        ("wandb", "--report-to wandb"),
        ("csv_monitor", "--report-to csv"),
        ("comet", "--report-to (tensorboard"),
    ],
)
def test_deepspeed_monitor_sections_are_refused(section, hint):
    cfg = {"train_micro_batch_size_per_gpu": 4, section: {"enabled": True}}
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f'x.json: "{section}" is DeepSpeed\'s own monitor; remove it and use {hint}'
        ),
    ):
        ds_schema.validate(cfg, "x.json")
    ds_schema.validate({**cfg, section: {"enabled": False}}, "x.json")  # off: nothing would start


THIRD_PARTY = re.compile(
    r"\[WARNING\]|Warning:|warnings\.warn|cpp_extension|built "
    r"successfully|DeepSpeed|"
    r"^\s+return func|monitor rank [1-9]"
)


@pytest.mark.ranks
@pytest.mark.timeout(600)
def test_default_job_console_is_quiet_and_verbose_shows_the_rest(tmp_path):
    """The default job as `make run` starts it (2 ranks under mpirun), short."""
    log_dir = tmp_path / "default"
    r = run_cmd(
        [*MPIRUN, "-np", "2", "./entry_cn.sh", "--steps", "20", "--log-dir", str(log_dir)],
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = (r.stdout + r.stderr).splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    assert first_step <= 15, "\n".join(lines[:first_step])
    assert not [line for line in lines if THIRD_PARTY.search(line)], "\n".join(lines)
    hidden = (log_dir / "warnings_rank0.log").read_text()
    assert "Setting accelerator to CPU" in hidden and "built successfully" in hidden
    assert "library messages: " in "\n".join(lines[:first_step])

    verbose = launch(
        ["--steps", 2, "--log-dir", tmp_path / "verbose", "--verbose", "--no-save"], timeout=300
    )
    assert verbose.ok, verbose
    assert all("Setting accelerator to CPU" in out for out in verbose.outputs)
    assert "monitor rank 1: no GPU data" in verbose.outputs[1]
    assert not (tmp_path / "verbose" / "warnings_rank0.log").exists()


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_wandb_without_a_login_is_refused_before_anything_is_written(tmp_path):
    # A clean home: no .netrc, no W&B settings, no WANDB_* variables (W&B's own sources of an API
    # key).
    env = {
        k: v
        for k, v in base_env().items()
        if not k.startswith("WANDB_") and k not in ("NETRC", "XDG_CONFIG_HOME")
    }
    env["HOME"] = str(tmp_path / "home")
    args = ["--report-to", "wandb", "--steps", 2, "--log-dir", tmp_path / "run"]
    r = run_cmd([sys.executable, "-m", "vit.train", *map(str, args)], env=env, timeout=100)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "entry_cn.sh: error: --report-to wandb: no W&B API key here; log in with `wandb login` (or "
        "set "
        "WANDB_API_KEY), or set WANDB_MODE=offline to log without network (`wandb sync` uploads it "
        "later)"
    )
    assert not (tmp_path / "run").exists()
