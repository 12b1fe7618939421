"""The training core with real processes: DeepSpeed engines and DDP on gloo, compared with a plain
single-process PyTorch loop; resume; bad input (in-process, and once through the entry point)."""

import functools
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from helpers import (
    MPIRUN,
    ROOT,
    base_env,
    free_port,
    launch,
    plan_in_process,
    read_jsonl,
    run_cmd,
    train_losses,
)

from bench.runs import RUN_ENGINES
from vit.core.errors import ConfigError
from vit.run.cli import defaults
from vit.training.reference import reference_losses

STEPS = 6
CONFIGS = ROOT / "deepspeed_configs"


@functools.cache  # the recipe's takes seconds; several tests compare with the same losses
def reference(global_batch: int, steps: int = STEPS, **recipe) -> list[float]:
    return reference_losses(defaults().with_(**recipe), global_batch, steps, clip=1.0)


def assert_matches_reference(log_dir, global_batch: int, rel: float = 2e-4, **recipe):
    got = train_losses(log_dir)
    want = reference(global_batch, **recipe)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(want[step - 1], rel=rel), (step, got, want)
    assert want[-1] < want[0]  # it learns


# timm's augmentation (random-resized-crop, flip, RandAugment, random erasing), Mixup/CutMix with
# label smoothing into soft targets, and layer-wise LR decay: the engines take each augmented, mixed
# global batch apart (data-parallel ranks, micro-steps, pipeline stages) and must still train as the
# single-process loop does on the whole global batches.
RECIPE = dict(
    scale=(0.6, 1.0),
    hflip=0.5,
    aa="rand-m9-mstd0.5",
    reprob=0.25,
    mixup=0.8,
    cutmix=1.0,
    smoothing=0.1,
    layer_decay=0.8,
)
RECIPE_ARGS = (
    "--scale 0.6 1.0 --hflip 0.5 --aa rand-m9-mstd0.5 --reprob 0.25 --mixup 0.8 --cutmix 1.0 "
    "--smoothing 0.1 --layer-decay 0.8"
)


def train(log_dir, args: str, *paths, nprocs: int = 2, timeout: float = 240):
    """`nprocs` ranks of `vit.train ARGS PATHS` (ARGS as typed on a command line) for STEPS steps, a
    loss logged at every step and no checkpoint, into log_dir; they must succeed."""
    command = [*shlex.split(args), *paths, "--steps", STEPS, "--log-interval", 1, "--no-save"]
    r = launch([*command, "--log-dir", log_dir], nprocs=nprocs, timeout=timeout)
    assert r.ok, r
    return r


# One run per engine whose step is the plain synchronous one, each compared with the single-process
# loop once: the benchmarks' runs from the registry (bench.runs: ZeRO once per stage), so a new
# engine joins it (the async pipeline and DiLoCo train otherwise: each brings its own emulator,
# tests/test_async_pipeline.py and tests/test_diloco.py). The recipe is on where the data path
# differs: ZeRO's data-parallel ranks (ZeRO-2, the default, and ZeRO-3, whose partitioned parameters
# take layer_decay's groups), DDP's own micro-step loop, and the pipeline (its first stage reads the
# augmented images, its last the mixed soft targets); ZeRO-0 and ZeRO-1 train on the digits' default
# crop. Micro-steps (16 x 2) on every data-parallel engine but ZeRO-0, which keeps the default
# 32 x 1; the pipeline accumulates 4 micro-batches of 16 (pipeline.json). A new engine: both on.
PLAIN = {"zero0": (False, False), "zero1": (False, True), "pipeline": (True, False)}
MATRIX = {
    name: (engine.name, config, *PLAIN.get(name, (True, True)))
    for name, (engine, config) in RUN_ENGINES.items()
    if not engine.async_schedule and not engine.local_steps
}


@pytest.mark.ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", MATRIX)
def test_two_ranks_match_single_process_reference(tmp_path, case):
    engine, config, recipe, micro_steps = MATRIX[case]
    micro = "--micro-batch-size 16 --grad-accum 2" if micro_steps else ""
    args = f"--engine {engine} {micro} {RECIPE_ARGS if recipe else ''}"
    train(tmp_path, args, "--ds-config", CONFIGS / config)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["global_batch"] == 64
    assert_matches_reference(tmp_path, 64, **(RECIPE if recipe else {}))
    for rank in (0, 1):  # every rank logs its own records with its host
        records = read_jsonl(tmp_path / f"metrics_rank{rank}.jsonl")
        assert {rec["rank"] for rec in records} == {rank} and all(rec["host"] for rec in records)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["engine"] == engine and summary["world_size"] == 2 and summary["steps"] == STEPS
    assert 0.0 <= summary["top1"] <= 1.0 and summary["images_per_s"] > 0 and summary["wall_s"] > 0
    if recipe:
        # The recipe is in effect: it trains differently from the run without augmentation (a
        # single step's losses may come close by chance: with the digits' default crop two of them
        # differed by 6e-5 at step 4).
        assert (
            max(abs(a - b) for a, b in zip(reference(64, **RECIPE), reference(64, no_aug=True)))
            > 1e-3
        )


@pytest.mark.ranks
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["zero", "ddp"])
def test_compiled_engines_match_the_reference(tmp_path, engine):
    # --compile (inductor's C++ backend on CPU) fuses and reorders float work, so the losses agree
    # with the uncompiled single-process loop to a tolerance, not bit for bit: 1e-3 relative over
    # the steps (measured: equal to 4 decimals).
    train(tmp_path, f"--engine {engine} --compile", timeout=540)
    assert json.loads((tmp_path / "config.json").read_text())["args"]["compile"] is True
    assert_matches_reference(tmp_path, 64, rel=1e-3)


@pytest.mark.ranks
@pytest.mark.timeout(420)
def test_pipe_x_data_four_ranks(tmp_path):
    # 2 stages x 2 data-parallel copies: global batch = 16 x 4 micro-batches x 2.
    train(tmp_path, "--engine pipeline --pipeline-stages 2", nprocs=4, timeout=360)
    assert json.loads((tmp_path / "config.json").read_text())["data_parallel_size"] == 2
    assert_matches_reference(tmp_path, 128)


@pytest.mark.ranks
@pytest.mark.timeout(480)
@pytest.mark.parametrize("engine", ["zero", "ddp"])
def test_resume_continues_like_uninterrupted_run(tmp_path, engine):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    # The EMA is saved with the checkpoint: the resumed run's average ends where the uninterrupted
    # one's does.
    common = shlex.split(f"--engine {engine} --steps 8 --log-interval 1 --model-ema")
    common += ["--model-ema-decay", 0.9]
    r = launch([*common, "--save-interval", 4, "--log-dir", full], timeout=200)
    assert r.ok, r
    assert (full / "checkpoints" / "latest").read_text().strip() == "step8"
    r = launch(
        [*common, "--resume", full / "checkpoints" / "step4", "--log-dir", resumed], timeout=200
    )
    assert r.ok, r
    want, got = train_losses(full), train_losses(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-7), (step, got, want)
    ema = [
        [r for r in read_jsonl(d / "metrics_rank0.jsonl") if r["kind"] == "eval"][-1]
        for d in (full, resumed)
    ]
    assert ema[0]["ema_eval_loss"] == pytest.approx(ema[1]["ema_eval_loss"], rel=1e-6)
    assert ema[0]["ema_eval_loss"] != pytest.approx(ema[0]["eval_loss"], rel=1e-3)
    # --resume without a path: the newest checkpoint of the run in --log-dir.
    r = launch(
        [*common[:2], "--steps", 10, "--log-interval", 1, "--resume", "--log-dir", full],
        timeout=200,
    )
    assert r.ok, r
    assert "resumed from step8" in r.outputs[0]
    assert sorted(s for s in train_losses(full) if s > 8) == [9, 10]
    # the step line says how long the steps left take at this run's pace: none left at the last
    lines = [x for x in r.outputs[0].splitlines() if x.startswith("step ")]
    assert re.search(r"\| eta \d+:\d\d:\d\d$", lines[0]) and lines[-1].endswith("| eta 0:00:00")


def test_the_step_line_gives_the_time_left():
    from vit.telemetry.metrics import log_line

    line = log_line(10, 880, 2.2695, 4.55e-4, 338.4, 0.1891, 1.16, eta_s=3725.4)
    assert line == (
        "step  10/880 | loss 2.2695 | lr 4.55e-04 |    338.4 img/s | step   189.1 ms | "
        "mem 1.16 GiB | eta 1:02:05"
    )


@pytest.mark.ranks
@pytest.mark.timeout(240)
def test_mpirun_launch_discovers_ranks(tmp_path):
    hostfile = tmp_path / "hosts.txt"

    def on_slots(slots: int):
        hostfile.write_text(f"localhost slots={slots}\n")
        args = shlex.split("-np 2 ./entry_cn.sh --steps 3 --no-save")
        return run_cmd([*MPIRUN, *args, "--log-dir", tmp_path, "--hostfile", hostfile], timeout=200)

    r = on_slots(1)
    assert (
        r.returncode == 2
        and "preflight: world size 2 is more than the hostfile's 1 slots" in r.stderr
    ), r.stderr
    r = on_slots(2)
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["launcher"] == "Open MPI" and cfg["world_size"] == 2
    assert cfg["master"].startswith("127.0.0.1:")  # both ranks on one host
    assert (tmp_path / "metrics_rank1.jsonl").exists()


@pytest.mark.ranks
@pytest.mark.timeout(240)
def test_torchrun_launch(tmp_path):
    torchrun = str(Path(sys.executable).parent / "torchrun")
    entry = shlex.split("--no-python ./entry_cn.sh --engine ddp --steps 3 --no-save")
    cmd = [torchrun, "--nproc-per-node", 2, "--master-port", free_port(), *entry]
    r = run_cmd([*cmd, "--log-dir", tmp_path], timeout=200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["launcher"] == "torchrun" and cfg["world_size"] == 2
    assert [r["rank"] for r in read_jsonl(tmp_path / "metrics_rank1.jsonl")][:1] == [1]


def bad_json(tmp_path) -> str:
    p = tmp_path / "bad.json"
    p.write_text('{"train_micro_batch_size_per_gpu": 8,,}')
    return str(p)


def inconsistent_batch(tmp_path) -> str:
    p = tmp_path / "batch.json"
    p.write_text(
        json.dumps(
            {
                "train_batch_size": 100,
                "train_micro_batch_size_per_gpu": 32,
                "gradient_accumulation_steps": 1,
            }
        )
    )
    return str(p)


def one_class_folder(tmp_path) -> str:
    from PIL import Image

    for split in ("train", "val"):
        (tmp_path / "one" / split / "only").mkdir(parents=True)
        Image.new("RGB", (32, 32)).save(tmp_path / "one" / split / "only" / "a.png")
    return str(tmp_path / "one")


BAD_INPUT = {
    "missing config": (
        lambda t: ["--ds-config", str(t / "nope.json")],
        {},
        "nope.json: no such file",
    ),
    "invalid json": (lambda t: ["--ds-config", bad_json(t)], {}, "invalid JSON"),
    "unknown model": (
        lambda t: ["--model", "vit_smal_patch16_224"],
        {},
        "unknown model 'vit_smal_patch16_224'; nearest: vit_small_patch16_224",
    ),
    "an image folder of one class": (
        lambda t: [
            "--dataset",
            "imagefolder",
            "--data-path",
            one_class_folder(t),
            "--model",
            "vit_tiny_cifar",
        ],
        {},
        "holds 1 class folder (only); a classifier needs at least two",
    ),
    "not a ViT": (
        lambda t: ["--model", "resnet50"],
        {},
        "is a timm resnet model, not a VisionTransformer; supported",
    ),
    "unknown dataset": (
        lambda t: ["--dataset", "mnist"],
        {},
        "argument --dataset: invalid choice: 'mnist'",
    ),
    "image size vs patch": (
        lambda t: ["--model", "vit_tiny_cifar", "--dataset", "synthetic", "--img-size", "30"],
        {},
        "image size 30 is not divisible by the patch size 4",
    ),
    "stages do not divide world": (
        lambda t: ["--engine", "pipeline", "--pipeline-stages", "2"],
        {"WORLD_SIZE": "3"},
        "--pipeline-stages 2 does not divide the world size 3",
    ),
    "stages exceed layers": (
        lambda t: ["--engine", "pipeline", "--pipeline-stages", "8"],
        {"WORLD_SIZE": "8"},
        "exceeds the 6 layers of vit_digits",
    ),
    "batch arithmetic": (
        lambda t: ["--ds-config", inconsistent_batch(t)],
        {"WORLD_SIZE": "2"},
        "train_batch_size 100 != train_micro_batch_size_per_gpu 32 x "
        "gradient_accumulation_steps 1 "
        "x data-parallel size 2 (= 64",
    ),
    "zero-2 pipeline": (
        lambda t: ["--engine", "pipeline", "--ds-config", str(CONFIGS / "zero2.json")],
        {},
        "ZeRO stage 2 does not work with the pipeline engine",
    ),
    "resume from empty folder": (
        lambda t: ["--resume", str(t)],
        {},
        "no complete checkpoint there",
    ),
    "negative steps": (lambda t: ["--steps", "-3"], {}, "--steps must be positive"),
    "compile with slowdown": (
        lambda t: ["--compile", "--simulate-slowdown", "1=2"],
        {"WORLD_SIZE": "2"},
        "--compile cannot run with --simulate-slowdown",
    ),
    "missing hostfile": (
        lambda t: ["--hostfile", str(t / "hosts.txt")],
        {},
        "hosts.txt: no such file",
    ),
    "EMA decay of 1 or more": (
        lambda t: ["--model-ema", "--model-ema-decay", "1.5"],
        {},
        "--model-ema-decay must be at least 0 and below 1, got 1.5",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_refused_naming_it_and_writes_nothing(tmp_path, monkeypatch, case):
    """Checked in-process where vit.train checks it, in parse and make_plan, before any process
    group (a rank of a bigger job that never starts, where WORLD_SIZE is given); that such an error
    ends the run with exit 2 and one line is the end-to-end test below."""
    make_args, env, message = BAD_INPUT[case]
    log_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_in_process(
            monkeypatch,
            [*make_args(tmp_path), "--log-dir", log_dir],
            int(env.get("WORLD_SIZE", 1)),
        )
    assert not log_dir.exists()


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_bad_input_through_the_entry_point_is_one_clear_line_and_writes_nothing(tmp_path):
    """The one end-to-end case of BAD_INPUT (and of the refusals the other files check in-process):
    one rank of two that never meets the other (a check made after the process group starts would
    hang), through ./entry_cn.sh: exit 2, the error as stderr's one line, no traceback, no log
    folder."""
    make_args, env, message = BAD_INPUT["batch arithmetic"]
    log_dir = tmp_path / "run"
    r = run_cmd(
        ["./entry_cn.sh", *make_args(tmp_path), "--log-dir", str(log_dir)],
        env=base_env(RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="9", **env),
        timeout=100,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # that line alone
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("entry_cn.sh: error: ") and message in last, r.stderr
    assert "Traceback" not in r.stderr
    assert not log_dir.exists()


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_help_lists_the_options():
    r = run_cmd([str(ROOT / "entry_cn.sh"), "--help"], timeout=50)
    assert r.returncode == 0
    for option in (
        "--engine",
        "--ds-config",
        "--pipeline-stages",
        "--model",
        "--dataset",
        "--data-path",
        "--steps",
        "--epochs",
        "--precision",
        "--log-dir",
        "--resume",
        "--seed",
    ):
        assert option in r.stdout


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_a_usage_error_under_mpirun_is_said_once():
    """Every rank parses the same arguments: rank 0 says the error, the others exit 2 after it,
    so mpirun names rank 0 and the line is not repeated once per rank."""
    r = run_cmd([*MPIRUN, "-np", "2", "./entry_cn.sh", "--engine", "nope"], timeout=100)
    said = "entry_cn.sh: error: argument --engine: invalid choice: 'nope'"
    assert r.returncode == 2 and (r.stdout + r.stderr).count(said) == 1, r


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_the_entry_point_loads_without_collecting_garbage_and_turns_collection_back_on():
    """`python -m vit.train` disables the cyclic collector while torch, timm and DeepSpeed load (a
    rank's CPU-seconds of imports) and main() turns it back on, frozen, before anything runs."""
    probe = (
        "import atexit, gc, runpy, sys\n"
        "atexit.register(lambda: print('collections', gc.get_stats()[0]['collections'],"
        " 'enabled', gc.isenabled(), 'frozen', gc.get_freeze_count() > 100000))\n"
        "sys.argv = ['vit.train', '--help']\n"
        "runpy.run_module('vit.train', run_name='__main__', alter_sys=True)\n"
    )
    r = run_cmd([sys.executable, "-c", probe], env=base_env(), timeout=100)
    assert r.returncode == 0, r.stdout + r.stderr
    words = r.stdout.splitlines()[-1].split()
    assert words[0] == "collections" and int(words[1]) < 100, words  # thousands with collection on
    assert words[2:] == ["enabled", "True", "frozen", "True"], words
