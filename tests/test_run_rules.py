"""What a run may and may not do to the folders it is given, with real processes (and in-process
where vit.train decides before any process group, vit.run.plan): a resume never trains over a
checkpoint, a finished run stays finished, two runs never share a folder, output folders are checked
before any process group starts, and a --data-path is never ignored."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    Ranks,
    base_env,
    last_step,
    launch,
    plan_in_process,
    run_cmd,
    stop_group,
    wait_for,
)

from vit.core.errors import ConfigError


def tree_digest(folder: Path) -> dict:
    """Every file under folder with its sha256: what "touching nothing" is checked against."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def one_process(args, **env) -> subprocess.CompletedProcess:
    """vit.train as a single process; with WORLD_SIZE in env, as one rank of a bigger job that never
    starts (every check here happens before the process group)."""
    extra = {"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9", **env} if env else {}
    return run_cmd(
        [sys.executable, "-m", "vit.train", *map(str, args)], env=base_env(**extra), timeout=150
    )


def last_line(r) -> str:
    return r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""


def refusal(monkeypatch, args, world_size: int = 1) -> str:
    """What vit.train refuses `args` with before any process group (vit.run.plan, in-process):
    the line it prints after "entry_cn.sh: error: " and exits 2 with (test_train.py's end-to-end
    case)."""
    with pytest.raises(ConfigError) as e:
        plan_in_process(monkeypatch, args, world_size)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished ZeRO-2 run on 2 ranks: checkpoints at steps 5 and 10, its summary."""
    d = tmp_path_factory.mktemp("finished")
    r = launch(
        [
            "--steps",
            10,
            "--save-interval",
            5,
            "--log-interval",
            5,
            "--monitor-interval",
            0,
            "--log-dir",
            d,
        ],
        timeout=300,
    )
    assert r.ok, r
    return d


@pytest.mark.ranks
@pytest.mark.timeout(400)
def test_resume_at_or_before_the_newest_checkpoint_is_refused_and_touches_nothing(finished_run):
    before = tree_digest(finished_run)
    r = launch(["--steps", 5, "--resume", "--log-dir", finished_run], timeout=200)
    assert r.returncodes == [2, 2], r
    assert (
        "checkpoint" in r.outputs[0]
        and "step10 is already at step 10, and this run ends at step 5" in r.outputs[0]
    )
    assert tree_digest(finished_run) == before


@pytest.mark.ranks
@pytest.mark.timeout(400)
def test_a_finished_run_resumed_is_complete_and_untouched(finished_run):
    before = tree_digest(finished_run)
    r = launch(["--steps", 10, "--resume", "--log-dir", finished_run], timeout=200)
    assert r.ok, r
    assert "the run is complete" in r.outputs[0] and "nothing to do" in r.outputs[0], r
    assert tree_digest(finished_run) == before


@pytest.mark.ranks  # finished_run
@pytest.mark.timeout(200)
def test_resume_from_an_older_checkpoint_into_the_same_folder_is_refused(finished_run, monkeypatch):
    before = tree_digest(finished_run)
    message = refusal(
        monkeypatch,
        [
            "--steps",
            20,
            "--resume",
            finished_run / "checkpoints" / "step5",
            "--log-dir",
            finished_run,
        ],
        world_size=2,
    )
    assert "also holds newer checkpoints (step10) that this run would overwrite" in message
    assert tree_digest(finished_run) == before


@pytest.mark.ranks  # finished_run
@pytest.mark.timeout(400)
def test_a_new_run_into_a_folder_that_holds_a_run_is_refused_and_touches_nothing(
    finished_run, tmp_path, monkeypatch
):
    """Without --resume, a run must not mix its records and checkpoints with a finished run's (it
    once appended its metrics, overwrote summary.json and config.json, and left the old step10 for
    --resume to pick). A folder without a summary or a complete checkpoint is taken:
    test_a_second_run_in_the_same_folder_is_refused_naming_ the_first reuses a killed run's, and
    retry.sh starts such a run over (test_scripts.py)."""
    before = tree_digest(finished_run)
    assert refusal(monkeypatch, ["--steps", 4, "--log-dir", finished_run]) == (
        f"--log-dir {finished_run} already holds a run "
        f"(summary.json; "
        "checkpoints step10, step5); continue it with --resume, or use another "
        "--log-dir"
    )
    ckpts = finished_run / "checkpoints"
    assert refusal(
        monkeypatch,
        ["--steps", 4, "--log-dir", tmp_path / "new", "--save-dir", ckpts],
        world_size=2,
    ) == (
        f"--save-dir {ckpts} already "
        f"holds a run's "
        "checkpoints (step10, step5); continue it with "
        "--resume, or use "
        "another --save-dir"
    )
    assert tree_digest(finished_run) == before and not (tmp_path / "new").exists()


def test_export_targets_are_checked_before_anything_starts(tmp_path, monkeypatch):
    """A bad --export once trained to the end, then failed (IsADirectoryError) leaving .tmp files
    and no summary."""
    folder, a_file, sub = tmp_path / "folder", tmp_path / "file", tmp_path / "sub"
    (sub / "m.json").mkdir(parents=True)
    folder.mkdir()
    a_file.write_text("x")
    cases = [
        (
            folder,
            f"--export {folder}: {folder} is a folder; name the file to write, e.g. "
            f"{folder}/model.safetensors",
        ),
        (f"{tmp_path}/new/", f"--export {tmp_path}/new/: {tmp_path}/new/ is a folder"),
        (sub / "m", f"--export {sub}/m: {sub}/m.json is a folder"),
        (
            a_file / "m.safetensors",
            f"--export {a_file}/m.safetensors: {a_file} is a file, not a folder",
        ),
        ("/proc/m.safetensors", "--export /proc/m.safetensors: /proc: "),
    ]
    for export, message in cases:
        got = refusal(
            monkeypatch,
            ["--steps", 2, "--export", export, "--log-dir", tmp_path / "run"],
            world_size=2,
        )
        assert message in got, (export, got)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder", "sub"]
    assert not any(folder.iterdir())


@pytest.mark.ranks
@pytest.mark.timeout(400)
def test_ddp_resume_on_fewer_ranks_keeps_the_global_batch_or_is_refused(tmp_path, monkeypatch):
    r = launch(
        [
            "--engine",
            "ddp",
            "--steps",
            4,
            "--save-interval",
            4,
            "--monitor-interval",
            0,
            "--log-dir",
            tmp_path / "a",
        ],
        timeout=200,
    )
    assert r.ok, r
    args = [
        "--engine",
        "ddp",
        "--steps",
        8,
        "--resume",
        tmp_path / "a" / "checkpoints",
        "--log-dir",
        tmp_path / "b",
    ]
    # a batch option that changes the global batch is refused, naming the one that keeps it
    assert (
        "was trained with global batch 64, this run's is 32 (global batch 32 = micro-batch 32 "
        "x grad accum 1 x "
        "data-parallel 1); pass --grad-accum 2 to keep it"
    ) in refusal(monkeypatch, [*args, "--grad-accum", 1])
    assert not (tmp_path / "b").exists()
    # none given: the gradient accumulation follows, and a line says so
    r = one_process(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step4" in r.stdout
    assert (
        "--resume: the checkpoint's global batch 64 kept on 1 data-parallel ranks: "
        "micro-batch 32 x grad accum 2 (32 x 1 would make 32)"
    ) in r.stdout + r.stderr
    # the batch the resume chose itself is no "other setting" (it warned that it was)
    assert "was written with other settings" not in r.stdout + r.stderr


@pytest.mark.ranks
@pytest.mark.timeout(400)
def test_a_second_run_in_the_same_folder_is_refused_naming_the_first(tmp_path):
    first = Ranks(
        [
            "--steps",
            100000,
            "--log-interval",
            1,
            "--no-save",
            "--monitor-interval",
            0,
            "--log-dir",
            tmp_path,
        ]
    )
    try:
        wait_for(lambda: last_step(tmp_path, 0) >= 1, 200, "the first run's first step")
        before = (tmp_path / "metrics_rank0.jsonl").stat().st_size
        r = one_process(["--steps", 2, "--no-save", "--log-dir", tmp_path])
        assert r.returncode == 2, r.stdout + r.stderr
        assert (
            f"--log-dir {tmp_path} is in use by another run (pid {first.procs[0].pid} on "
            in last_line(r)
        ), r.stderr
        # still the first run's
        assert json.loads((tmp_path / "config.json").read_text())["world_size"] == 2
    finally:
        for p in first.procs:
            stop_group(p)
        first.wait(timeout=30)
    assert (tmp_path / "metrics_rank0.jsonl").stat().st_size >= before
    # A kill releases the lock: the folder can be used again.
    r = one_process(["--steps", 1, "--no-save", "--monitor-interval", 0, "--log-dir", tmp_path])
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture
def read_only_dir(tmp_path):
    """A real read-only file system (a tmpfs mounted read-only): needs root."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True
        ).returncode
    ):
        pytest.skip("needs root and tmpfs mounts for a read-only file system")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_output_folders_are_checked_before_anything_starts(tmp_path, read_only_dir, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        (["--log-dir", a_file], f"--log-dir {a_file} is a file, not a folder"),
        (
            ["--log-dir", a_file / "run"],
            f"--log-dir {a_file / 'run'}: {a_file} is a file, not a folder",
        ),
        (["--log-dir", read_only_dir / "run"], f"{read_only_dir} is on a read-only file system"),
        (
            ["--log-dir", tmp_path / "run", "--save-dir", read_only_dir / "ckpt"],
            f"--save-dir {read_only_dir / 'ckpt'}: {read_only_dir} is on a read-only file system",
        ),
    ]
    for args, message in cases:
        got = refusal(monkeypatch, ["--steps", 2, *args], world_size=2)
        assert message in got, (args, got)
    assert not (tmp_path / "run").exists()


def write_images(root: Path, splits: dict[str, int], classes=("cat", "dog")) -> None:
    from PIL import Image

    for split, n in splits.items():
        for c, cls in enumerate(classes):
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.new("RGB", (12, 10), (40 * c + 5 * i, 90, 200 - 60 * c)).save(
                    root / split / cls / f"{i}.png"
                )


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_data_path_is_used_or_refused_never_ignored(tmp_path, monkeypatch):
    images = tmp_path / "images"
    write_images(images, {"train": 8, "val": 2})
    assert "--dataset digits reads no files" in refusal(
        monkeypatch,
        ["--data-path", images, "--dataset", "digits", "--log-dir", tmp_path / "x"],
        world_size=2,
    )
    r = one_process(
        [
            "--data-path",
            images,
            "--img-size",
            8,
            "--steps",
            1,
            "--micro-batch-size",
            4,
            "--no-save",
            "--monitor-interval",
            0,
            "--log-dir",
            tmp_path / "run",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        f"--data-path {images} holds imagefolder: training on it (--dataset imagefolder)"
        in r.stdout
    )
    assert (
        json.loads((tmp_path / "run" / "config.json").read_text())["args"]["dataset"]
        == "imagefolder"
    )
    empty = tmp_path / "empty"
    for split in ("train", "val"):
        (empty / split / "cat").mkdir(parents=True)
    assert refusal(
        monkeypatch,
        ["--dataset", "imagefolder", "--data-path", empty, "--log-dir", tmp_path / "y"],
        world_size=2,
    ).startswith("imagefolder: ")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.ranks
@pytest.mark.timeout(600)
def test_resume_compares_the_model_and_the_length_and_keeps_the_checkpoints_weights(
    tmp_path, monkeypatch
):
    run, step4 = tmp_path / "run", tmp_path / "run" / "checkpoints" / "step4"
    r = one_process(
        [
            "--steps",
            4,
            "--save-interval",
            2,
            "--log-interval",
            1,
            "--monitor-interval",
            0,
            "--log-dir",
            run,
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads((run / "summary.json").read_text())
    assert first["segments"] == 1 and first["train_s"] == first["train_s_this_run"] > 0
    assert json.loads((step4 / "manifest.json").read_text())["train_s"] == pytest.approx(
        first["train_s"]
    )
    # Another model: one line naming both, before any engine is built; nothing touched.
    before = tree_digest(run)
    assert refusal(
        monkeypatch, ["--model", "vit_tiny_cifar", "--steps", 8, "--resume", "--log-dir", run]
    ) == (
        f"checkpoint {run / 'checkpoints'}/step4 was "
        f"written by --model "
        "vit_digits, this run uses --model vit_tiny_cifar; resume with --model "
        "vit_digits"
    )
    assert tree_digest(run) == before
    # Longer, another --lr (default 0.002), starting weights: a warning each, the checkpoint's
    # weights, and the time of both segments.
    r = one_process(
        [
            "--steps",
            8,
            "--lr",
            0.001,
            "--pretrained-path",
            run / "checkpoints" / "step2",
            "--resume",
            "--log-interval",
            1,
            "--monitor-interval",
            0,
            "--log-dir",
            run,
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    at = f"checkpoint {run / 'checkpoints'}/step4"
    assert (
        r.stdout.count(
            f"warning: {at} belongs to a run of 4 steps, this one has 8 (--steps or "
            f"--epochs): the LR "
            "schedule is recomputed over 8 steps, so the learning rate from step 5 "
            "on"
        )
        == 1
    ), r.stdout
    assert r.stdout.count(f"warning: {at} was written with other settings") == 1, r.stdout
    # no --save-interval: the run's own 2 (it saved only at the end, a hand-made resume too)
    assert "--resume: a checkpoint every 2 steps, as the run saved them" in r.stdout
    assert (run / "checkpoints" / "step6" / "manifest.json").is_file()
    assert (
        r.stdout.count(
            f"--pretrained-path {run / 'checkpoints' / 'step2'}: not loaded; the run "
            f"resumes from its "
            "checkpoint's weights"
        )
        == 1
    ), r.stdout
    assert "every tensor fits" not in r.stdout and "resumed from step4" in r.stdout
    second = json.loads((run / "summary.json").read_text())
    assert second["segments"] == 2 and second["steps_this_run"] == 4
    assert second["train_s"] == pytest.approx(first["train_s"] + second["train_s_this_run"])


def test_the_model_of_an_older_checkpoint_is_read_from_the_runs_config(tmp_path, monkeypatch):
    # A manifest written before manifests recorded the model (its ZeRO stage would be refused next):
    # the run's config.json beside checkpoints/ names the model, and the refusal names it.
    (tmp_path / "checkpoints" / "step10").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step10" / "manifest.json").write_text(
        json.dumps(
            {
                "step": 10,
                "files": {},
                "engine": "zero",
                "world_size": 2,
                "data_parallel_size": 2,
                "pipeline_stages": 1,
                "zero_stage": 9,
                "config_hash": "x",
            }
        )
    )
    (tmp_path / "config.json").write_text(
        json.dumps({"args": {"model": "vit_tiny_cifar"}, "total_steps": 10})
    )
    assert refusal(
        monkeypatch, ["--steps", 20, "--resume", "--log-dir", tmp_path], world_size=2
    ) == (
        f"checkpoint {tmp_path / 'checkpoints'}/step10 was "
        f"written by --model "
        "vit_tiny_cifar, this run uses --model vit_digits; resume with --model "
        "vit_tiny_cifar"
    )


def test_a_pipeline_given_fewer_micro_batches_than_stages_is_warned_of(monkeypatch):
    """pipeline.json's 4 micro-batches through 5 stages: DeepSpeed's 1F1B takes 4 + 4 = 8 slots,
    each stage busy half the step (the documented command once ran so). The async pipeline has no
    flush."""
    five = ["--engine", "pipeline", "--pipeline-stages", 5, "--synthetic-size", 512]
    notes = plan_in_process(monkeypatch, [*five, "--dataset", "synthetic"], world_size=5).notes
    assert notes == [
        "warning: --pipeline-stages 5 with 4 micro-batches a step: 1F1B takes 4 + 4 = 8 slots for "
        "them, each stage busy 50% of the step; --grad-accum 10 (at least 5) fills the pipeline"
    ]
    full = [*five, "--dataset", "synthetic", "--grad-accum", 10]
    assert plan_in_process(monkeypatch, full, world_size=5).notes == []
    no_flush = ["--engine", "async-pipeline", *five[2:], "--dataset", "synthetic"]
    assert plan_in_process(monkeypatch, no_flush, world_size=5).notes == []
