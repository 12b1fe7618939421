"""The benchmarks (python -m bench): one real training benchmark end to end (bench train on one
engine, with the reference loop), the all-reduce benchmark under mpirun, and every table and
summary on canned results: each benchmark's runs faked where it launches them (mpirun_train, the
processes of vit.train), with the files a run leaves. No timing assertions: speed targets live in
docs/benchmarks.md, not in tests."""

import json
import re
import shlex
import statistics
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from helpers import MPIRUN, plan_in_process, run_cmd

from vit.planner.auto import family
from vit.planner.cli import calibration as cli_calibration

ENGINES = ["ddp", "zero0", "zero1", "zero2", "zero3", "pipeline", "async-pipeline"]


# The suite's first multi-rank test: on a fresh clone its first engine also builds DeepSpeed's CPU
# op (1-3 min).
@pytest.mark.ranks
@pytest.mark.timeout(480)
def test_train_table_has_the_reference_and_the_engine_with_its_ratio_and_fused_adam(tmp_path):
    """The one real training benchmark: the reference loop and a real 2-rank run of an engine under
    mpirun, both with --fused-adam; every engine's options and layout are checked in-process below,
    the table's format on canned rows."""
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "train",
        "--model",
        "vit_digits",
        "--global-batch",
        16,
        "--ranks",
        2,
        "--steps",
        2,
        "--warmup",
        1,
        "--engines",
        "zero1",
        "--fused-adam",
        "--timeout",
        240,
        "--out",
        tmp_path,
    ]
    r = run_cmd([str(c) for c in cmd], timeout=460)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "train.json").read_text())
    assert result["fused_adam"] is True
    rows = {row["engine"]: row for row in result["rows"]}
    assert list(rows) == ["reference", "zero1"]
    assert rows["reference"]["ratio"] == 1.0
    for row in rows.values():
        assert (
            row["images_per_s"] > 0
            and row["step_time_s"] > 0
            and row["ratio"] > 0
            and row["peak_mem_gib"] > 0
        )
        assert row["ratio"] == pytest.approx(
            row["images_per_s"] / rows["reference"]["images_per_s"]
        )
    assert rows["zero1"]["layout"] == "8 x 1 x 2"  # global batch 16
    assert result["flops_per_image"] > 0
    table = (tmp_path / "train.md").read_text()
    assert "| ratio to ref |" in table and "AdamW fused" in table and table in r.stdout
    body = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [line.split("|")[1].strip() for line in body] == ["reference", "zero1"]
    # the engine ran as a real 2-rank vit.train, with the option
    assert (tmp_path / "logs" / "zero1" / "metrics_rank1.jsonl").exists()
    assert (
        json.loads((tmp_path / "logs" / "zero1" / "config.json").read_text())["args"]["fused_adam"]
        is True
    )


def test_each_engines_run_plans_the_global_batch_in_the_layout_of_its_row(tmp_path, monkeypatch):
    """bench train's vit.train options for every engine, as vit.train plans them on 2 ranks: the
    global batch, the engine and its ZeRO stage, the layout the table reports. That each engine
    trains on 2 ranks is test_train.py's (the ZeRO stages, the pipeline, DDP) and
    test_async_pipeline.py's."""
    from bench.runs import RUN_ENGINES
    from bench.train import engine_args

    layouts = {}
    for name in ENGINES:
        options, layouts[name] = engine_args(
            name, Namespace(ranks=2, pipeline_stages=None, global_batch=16)
        )
        plan = plan_in_process(
            monkeypatch,
            [
                *options,
                "--model",
                "vit_digits",
                "--dataset",
                "synthetic",
                "--synthetic-size",
                2048,
                "--steps",
                3,
                "--no-save",
                "--log-dir",
                tmp_path / name,
            ],
            world_size=2,
        )
        b = plan.batch
        assert (
            b.global_size == 16
            and f"{b.micro_batch} x {b.grad_accum} x {b.dp_size}" == (layouts[name])
        ), name
        assert plan.settings.parallel.engine == RUN_ENGINES[name][0].name, name
        if name.startswith("zero"):
            assert plan.shape["zero_stage"] == int(name[-1]), plan.shape
    assert layouts["pipeline"] == layouts["async-pipeline"] == "4 x 4 x 1"
    assert layouts["ddp"] == layouts["zero0"] == layouts["zero3"] == "8 x 1 x 2"


def test_train_table_has_a_row_and_a_ratio_per_engine_and_names_a_failed_one():
    from bench.train import train_table

    result = {
        "model": "vit_digits",
        "global_batch": 16,
        "precision": "fp32",
        "steps": 2,
        "warmup": 1,
        "repeat": 1,
        "compile": False,
        "fused_adam": True,
        "device": "a CPU",
        "reference_threads": 2,
        "flops_per_image": 1.5e7,
        "peak_tflops": None,
        "cpus": 2,
        "load_avg_before": 1.0,
        "load_avg_after": 2.0,
        "rows": [
            {
                "engine": "reference",
                "ranks": 1,
                "layout": "16 x 1 x 1",
                "images_per_s": 400.0,
                "step_time_s": 0.04,
                "peak_mem_gib": 0.5,
                "mfu": None,
                "ratio": 1.0,
                "others_cores": 0.1,
            },
            {
                "engine": "zero1",
                "ranks": 2,
                "layout": "8 x 1 x 2",
                "images_per_s": 200.0,
                "step_time_s": 0.08,
                "peak_mem_gib": 0.25,
                "mfu": 0.0123,
                "ratio": 0.5,
                "others_cores": 0.2,
            },
            {
                "engine": "pipeline",
                "ranks": 2,
                "layout": "4 x 4 x 1",
                "error": "exit 1",
                "others_cores": 0.3,
            },
        ],
    }
    lines = train_table(result).splitlines()
    assert lines[0].startswith("vit_digits, global batch 16, fp32, 2 timed steps after 1 warm-up")
    assert "AdamW fused" in lines[0] and "0.015 GFLOP/image" in lines[0] and "peak ?" in lines[0]
    assert lines[2] == (
        "| engine | ranks | micro x accum x dp | images/s | step ms | peak mem GiB/rank | MFU % | "
        "ratio to ref | others |"
    )
    assert lines[4:] == [
        "| reference | 1 | 16 x 1 x 1 | 400.0 | 40.0 | 0.50 | - | 1.000 | 0.1 |",
        "| zero1 | 2 | 8 x 1 x 2 | 200.0 | 80.0 | 0.25 | 1.2 | 0.500 | 0.2 |",
        "| pipeline | 2 | 4 x 4 x 1 | failed: exit 1 | | | | | 0.3 |",
    ]


@pytest.mark.ranks
@pytest.mark.timeout(90)
def test_allreduce_under_mpirun_reports_bus_bandwidth(tmp_path):
    cmd = [
        *MPIRUN,
        "-np",
        2,
        sys.executable,
        "-m",
        "bench",
        "allreduce",
        "--max-bytes",
        "16K",
        "--iters",
        3,
        "--warmup",
        1,
        "--timeout",
        60,
        "--out",
        tmp_path,
    ]
    r = run_cmd([str(c) for c in cmd], timeout=80)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "allreduce.json").read_text())
    assert (
        result["world_size"] == 2
        and result["backend"] == "gloo"
        and result["bus_factor"] == 2 * (2 - 1) / 2
    )
    assert [row["bytes"] for row in result["rows"]] == [1024, 2048, 4096, 8192, 16384]
    for row in result["rows"]:
        for way in ("torch", "mpi"):
            m = row[way]
            assert m["time_s"] > 0
            assert m["algbw_gbps"] == pytest.approx(row["bytes"] / m["time_s"] / 1e9)
            assert m["busbw_gbps"] == pytest.approx(m["algbw_gbps"] * 2 * (2 - 1) / 2)
    assert "busbw GB/s" in r.stdout and "16384" in r.stdout


class FakeRuns:
    """A benchmark's mpirun_train, faked: what each launch was asked (`launched`: the vit.train
    options, ranks, mpirun options) and the files a finished run of vit.train leaves in its log
    dir, made by `write(log_dir, options)`; exit `fail(options)` (0 by default) and output.log."""

    def __init__(self, write, fail=lambda options: 0):
        self.write, self.fail, self.launched = write, fail, []

    def __call__(self, train, ranks, log_dir, timeout, mpirun_args="", env=None):
        options = [str(t) for t in train]
        self.launched.append((options, ranks, mpirun_args))
        (log_dir / "output.log").write_text("the run's output\nits last line\n")
        rc = self.fail(options)
        if rc == 0:
            self.write(Path(log_dir), options)
        return rc


def option(options: list[str], name: str) -> str | None:
    return options[options.index(name) + 1] if name in options else None


def records(log_dir: Path, rank: int, steps: int, step_s: float, **fields) -> None:
    """metrics_rankN.jsonl of a run: a train record per step, as vit.train logs them."""
    with open(log_dir / f"metrics_rank{rank}.jsonl", "w") as f:
        for step in range(1, steps + 1):
            rec = {"kind": "train", "step": step, "rank": rank, "step_time_s": step_s, **fields}
            f.write(json.dumps(rec) + "\n")


def test_peaks_are_exact_names_and_mixed_gpus_add_their_own():
    from bench.common import peak_tflops, total_peak_tflops

    assert peak_tflops("NVIDIA GeForce RTX 3090", "bf16") == 71.0
    assert peak_tflops("NVIDIA GeForce RTX 3090 Ti", "bf16") == 80.0  # not the 3090's
    # unknown: no MFU, not a near match
    assert peak_tflops("NVIDIA GeForce RTX 3090 Laptop GPU", "bf16") is None
    mixed = ["NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 3070", "NVIDIA GeForce RTX 3070"]
    assert total_peak_tflops(mixed, "fp32") == pytest.approx(35.6 + 2 * 20.3)
    assert total_peak_tflops([*mixed, "NVIDIA GeForce GTX 1080"], "fp32") is None
    assert total_peak_tflops(mixed, "fp32", per_device=10.0) == 30.0


def test_recipe_table_has_a_row_per_variant_with_the_median_of_its_seeds(
    tmp_path, monkeypatch, capsys
):
    from bench import recipe
    from bench.__main__ import main

    top1 = {"baseline": [0.5, 0.7], "model-ema": [0.6, 0.9]}

    def summary(log_dir: Path, options: list[str]) -> None:
        variant, seed = log_dir.name.split(".seed")
        s = {"top1": top1[variant][int(seed)], "top5": 1.0, "wall_s": 10.0 + int(seed)}
        if "--model-ema" in options:
            s["ema_top1"] = s["top1"] + 0.01
        (log_dir / "summary.json").write_text(json.dumps({**s, "steps": 6}))

    runs = FakeRuns(summary, fail=lambda options: int("--no-aug" in options))
    monkeypatch.setattr(recipe, "mpirun_train", runs)
    base = "--steps 6 --micro-batch-size 8"
    argv = ["recipe", "--variants", "baseline,model-ema,no-aug", "--seeds", "0,1"]
    assert main([*argv, "--base", base, "--out", str(tmp_path)]) == 1  # no-aug failed
    # each seed of each variant: the base options, the variant's, its seed, one run of 2 ranks
    assert [(options[:4], ranks) for options, ranks, _ in runs.launched] == [
        (shlex.split(base), 2)
    ] * 5
    assert [(option(o, "--seed"), " ".join(o[4:-5])) for o, _, _ in runs.launched] == [
        ("0", ""),
        ("1", ""),
        ("0", "--model-ema --model-ema-decay 0.99"),
        ("1", "--model-ema --model-ema-decay 0.99"),
        ("0", "--no-aug"),
    ]
    result = json.loads((tmp_path / "recipe.json").read_text())
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == ["baseline", "model-ema", "no-aug"] and result["seeds"] == [0, 1]
    for name in ("baseline", "model-ema"):
        row = rows[name]
        summaries = [
            json.loads((tmp_path / "logs" / f"{name}.seed{s}" / "summary.json").read_text())
            for s in (0, 1)
        ]
        assert row["all_top1"] == [s["top1"] for s in summaries] == top1[name]
        assert row["top1"] == pytest.approx(sum(row["all_top1"]) / 2)  # the median of two
        assert row["wall_s"] == 10.5
    assert rows["baseline"]["ema_top1"] is None and rows["model-ema"]["ema_top1"] == 0.76
    assert rows["no-aug"]["error"].startswith("exit 1: ")
    table = (tmp_path / "recipe.md").read_text()
    assert table in capsys.readouterr().out
    lines = table.splitlines()
    assert "| model-ema | `--model-ema --model-ema-decay 0.99` |" in table
    assert "| baseline | `-` | 60.00 | 50.00 / 70.00 | – | 10.5 |" in table
    assert (
        "| model-ema | `--model-ema --model-ema-decay 0.99` | 75.00 | 60.00 / 90.00 | 76.00 |"
        in (table)
    )
    assert lines[-1] == "| no-aug | `--no-aug` | failed | | | | | |"


def async_pipeline_run(log_dir: Path, options: list[str]) -> None:
    """What a run of bench async-pipeline leaves: config.json's global batch 64; each rank's records
    at 0.5 s a step, of which 0.25 s computing (its waits and sends aside), with the bytes an
    async-pipeline rank 0 sends at its wire dtype; the accuracy runs' summary (top-1 by seed and
    --weight-prediction)."""
    ranks = int(option(options, "--pipeline-stages"))
    (log_dir / "config.json").write_text(json.dumps({"global_batch": 64}))
    wire = option(options, "--pipe-wire-dtype") or "fp32"
    asynchronous = option(options, "--engine") == "async-pipeline"
    for rank in range(ranks):
        sent = {"wire_bytes": {"fp32": 4e6, "bf16": 2e6}[wire]} if asynchronous else {}
        records(
            log_dir,
            rank,
            int(option(options, "--steps")),
            0.5,
            forward_s=0.1,
            backward_s=0.15,
            pipe_send_s=0.1,
            pipe_recv_s=0.15,
            **sent,
        )
    seed = int(option(options, "--seed") or 0)
    prediction = {None: 0.0, "none": 0.01, "msnag": 0.02}[option(options, "--weight-prediction")]
    top1 = 0.5 + 0.1 * seed + prediction
    (log_dir / "summary.json").write_text(json.dumps({"top1": top1, "steps": 3, "wall_s": 20.0}))


def test_async_pipeline_table_has_both_pipelines_their_ideals_and_the_accuracy_per_seed(
    tmp_path, monkeypatch, capsys
):
    from bench import async_pipeline
    from bench.__main__ import main

    runs = FakeRuns(async_pipeline_run)
    monkeypatch.setattr(async_pipeline, "mpirun_train", runs)
    argv = ["async-pipeline", "--steps", "4", "--warmup", "1", "--repeats", "1", "--seeds", "0,1"]
    assert main([*argv, "--extra", "--steps 3 --micro-batch-size 8", "--out", str(tmp_path)]) == 0
    # the speed runs: one stage on one rank, then both pipelines on 2; the accuracy runs, 2 seeds
    assert [(option(o, "--engine"), ranks) for o, ranks, _ in runs.launched] == [
        ("async-pipeline", 1),
        ("pipeline", 2),
        ("async-pipeline", 2),
    ] + [("pipeline", 2)] * 2 + [("async-pipeline", 2)] * 4
    assert [option(o, "--weight-prediction") for o, _, _ in runs.launched[3:]] == [
        None,
        None,
        "none",
        "none",
        "msnag",
        "msnag",
    ]
    assert [option(o, "--seed") for o, _, _ in runs.launched[3:]] == ["0", "1"] * 3
    assert all(o[-4:] == ["--steps", "3", "--micro-batch-size", "8"] for o, _, _ in runs.launched)
    result = json.loads((tmp_path / "async_pipeline.json").read_text())
    assert [row["run"] for row in result["speed"]] == ["pipeline (DeepSpeed)", "async-pipeline"]
    for row in [*result["speed"], result["one_stage"]]:
        assert row["images_per_s"] == 128 and row["each"] == [128]  # 64 images in 0.5 s
    assert all(row["ideal_images_per_s"] == 256 for row in result["speed"])  # in 0.25 s
    assert result["ideal_images_per_s"] == pytest.approx(2 * result["one_stage"]["images_per_s"])
    assert [row["run"] for row in result["accuracy"]] == [
        "pipeline (sync, DeepSpeed)",
        "async, no prediction",
        "async, msnag",
    ]
    for row, gain in zip(result["accuracy"], (0.0, 0.01, 0.02)):
        assert row["each"] == pytest.approx([0.5 + gain, 0.6 + gain]) and row["steps"] == 3
        assert row["top1"] == pytest.approx(sum(row["each"]) / 2)  # the median of two
    table = (tmp_path / "async_pipeline.md").read_text()
    assert table in capsys.readouterr().out and "median (seeds 0, 1)" in table
    assert "| async-pipeline | 128 (128) | 1.00 | 256 | 0.50 | 0.50 | 4 |" in table
    assert "| async, msnag | 57.00 (52.00, 62.00) | 3 | 20 |" in table


def test_async_pipeline_wire_dtypes_make_one_run_each_with_its_bytes(tmp_path, monkeypatch):
    """One async-pipeline speed run per --wire-dtypes, each with its --pipe-wire-dtype and the bytes
    of its own records (that a bf16 wire halves them is test_async_pipeline.py's, on real runs)."""
    from bench import async_pipeline
    from bench.__main__ import main

    runs = FakeRuns(async_pipeline_run)
    monkeypatch.setattr(async_pipeline, "mpirun_train", runs)
    argv = ["async-pipeline", "--steps", "4", "--warmup", "1", "--repeats", "1", "--no-accuracy"]
    assert main([*argv, "--wire-dtypes", "fp32,bf16", "--out", str(tmp_path)]) == 0
    assert [option(o, "--pipe-wire-dtype") for o, _, _ in runs.launched] == [
        None,
        None,
        "fp32",
        "bf16",
    ]  # no accuracy runs
    result = json.loads((tmp_path / "async_pipeline.json").read_text())
    rows = {row["run"]: row for row in result["speed"]}
    assert list(rows) == [
        "pipeline (DeepSpeed)",
        "async-pipeline, fp32 wire",
        "async-pipeline, bf16 wire",
    ]
    assert (
        rows["async-pipeline, bf16 wire"]["wire_bytes"] * 2
        == rows["async-pipeline, fp32 wire"]["wire_bytes"]
        > 0
    )
    assert rows["pipeline (DeepSpeed)"]["wire_bytes"] is None and result["accuracy"] == []
    # its ratio to fp32's
    table = (tmp_path / "async_pipeline.md").read_text()
    assert "async-pipeline, bf16 wire: 1.00x the fp32 wire's images/s" in table
    assert "| async-pipeline, bf16 wire | 128 (128) | 1.00 | 256 | 0.50 | 0.50 | 2 |" in table


def test_gpu_acceptance_refuses_a_machine_without_cuda_and_judges_its_rows(tmp_path, capsys):
    """Its refusals in-process, as `python -m bench gpu` ends with them: sys.exit(MESSAGE) prints
    MESSAGE as stderr's one line and exits 1; argparse's error exits 2."""
    from bench.__main__ import main
    from bench.gpu import learns, table

    def refusal(argv) -> SystemExit:
        with pytest.raises(SystemExit) as e:
            main(argv)
        return e.value

    if not torch.cuda.is_available():
        e = refusal(["gpu", "--out", str(tmp_path)])
        assert e.code == (
            "bench gpu: no CUDA device here; "
            "--device cpu runs the "
            "checks that mean something on a CPU"
        )
        assert capsys.readouterr().err == ""
        assert not list(tmp_path.iterdir())
    e = refusal(["gpu", "--device", "cpu", "--checks", "engines,syncs", "--out", str(tmp_path)])
    said = "bench gpu: --checks syncs need a GPU; on a CPU only local-steps,engines,overflow run"
    assert e.code == said
    assert capsys.readouterr().err == ""
    e = refusal(["gpu", "--checks", "engines,nope"])
    assert e.code == 2 and "unknown check 'nope'; choose from local-steps,engines,overflow," in (
        capsys.readouterr().err
    )
    assert not list(tmp_path.iterdir())
    assert learns([2.3, 2.2, 2.0, 1.9, 1.5]) and not learns([2.0, 2.1, 2.2, 2.3, 2.4])
    assert not learns([2.3, float("nan"), 1.0, 0.5, 0.1]) and not learns([])
    rows = [
        {"check": "zero2 bf16", "ok": True, "detail": "loss 2.3 -> 1.9"},
        {"check": "async-pipeline fp16", "ok": None, "detail": "refused"},
        {"check": "ddp fp16", "ok": False, "detail": "exit 1"},
    ]
    md = table(
        {
            "device": "d",
            "host": "h",
            "torch": "t",
            "deepspeed": "x",
            "load_avg_before": 0.1,
            "load_avg_after": 0.2,
            "rows": rows,
        }
    )
    assert (
        "| zero2 bf16 | pass |" in md
        and "| async-pipeline fp16 | not run |" in md
        and "| ddp fp16 | FAIL |" in md
    )


@pytest.mark.ranks
@pytest.mark.timeout(400)
def test_planner_measures_the_choice_and_a_forced_family_in_the_layout_predicted(tmp_path):
    """Real runs: the only test of $VIT_ENGINE_AUTO_PICK (a forced --engine auto run trains the
    family asked for, in the layout its own planning predicts)."""
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "planner",
        "--ranks",
        2,
        "--top",
        2,
        "--steps",
        2,
        "--warmup",
        1,
        "--condition",
        "one host",
        "--out",
        tmp_path,
    ]
    r = run_cmd([str(c) for c in cmd], timeout=380)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((tmp_path / "planner.json").read_text())
    rows, record = result["rows"], result["record"]
    assert sum(row["auto"] for row in rows) == 1 and 2 <= len(rows) <= 3
    for i, row in enumerate(rows):
        assert row["measured_ms"] > 0 and row["error"] == pytest.approx(
            row["predicted_ms"] / row["measured_ms"] - 1
        )
        # a forced run trained the family it was asked for, as its own record says
        if not row["auto"]:
            forced = json.loads((tmp_path / "logs" / str(i) / "config.json").read_text())[
                "engine_auto"
            ]["choice"]
            assert family(forced) == row["family"] != family(record["choice"]), (
                row,
                forced["candidate"],
            )
    assert record["choice"]["candidate"] in (tmp_path / "planner.md").read_text()


def test_the_calibration_fit_puts_each_engines_cost_where_the_model_charges_it():
    from bench.planner import fit

    used = {"step_s": 0.002, "micro_s": 0.0005, "engine_micro_s": {"pipeline": 0.001}}
    # data parallel: fixed 4 ms = step 2 ms + 2 micro-batches x 1 ms; 10 ms more than predicted
    rows = [
        {
            "calibration_key": "ddp",
            "engine_key": "ddp",
            "stages": 1,
            "slots": 2,
            "grad_accum": 2,
            "measured_ms": 30.0,
            "predicted_ms": 20.0,
            "fixed_ms": 4.0,
        },
        # the bf16 hook's casts: 20 ms more than predicted, a key of its own
        {
            "calibration_key": "ddp bf16",
            "engine_key": "ddp",
            "stages": 1,
            "slots": 2,
            "grad_accum": 2,
            "measured_ms": 40.0,
            "predicted_ms": 20.0,
            "fixed_ms": 4.0,
        },
        # a pipeline's cost is in each of its 5 slots (4 micro-batches, 2 stages): 10 ms more over 5
        # slots
        {
            "calibration_key": "pipeline",
            "engine_key": "pipeline",
            "stages": 2,
            "slots": 5,
            "grad_accum": 4,
            "measured_ms": 60.0,
            "predicted_ms": 50.0,
            "fixed_ms": 2.0,
        },
        # the async pipeline had the default 0.5 ms; 2 ms less than predicted over its 4 slots
        {
            "calibration_key": "async-pipeline",
            "engine_key": "async-pipeline",
            "stages": 2,
            "slots": 4,
            "grad_accum": 4,
            "measured_ms": 48.0,
            "predicted_ms": 50.0,
            "fixed_ms": 2.0,
        },
    ]
    assert fit([(rows, used)]) == {
        "ddp": 0.006,
        "ddp bf16": 0.011,
        "pipeline": 0.003,
        "async-pipeline": 0.0,
    }
    # several runs: the median per key, each run's residual from the calibration it used. ddp bf16:
    # 11 ms (run 1), 12 ms (run 2, whose prediction held 11 ms already: 2 ms more than predicted),
    # 21 ms (run 3): 12 ms. async-pipeline wire-bf16 (1 ms more a slot than predicted in each run)
    # on what each run used: the engine's 2 ms (run 1), its own 4 ms (run 2), its own 10 ms (run 3):
    # 3, 5 and 11 ms, the median 5 ms.
    wire = {
        "calibration_key": "async-pipeline wire-bf16",
        "engine_key": "async-pipeline",
        "stages": 2,
        "slots": 4,
        "grad_accum": 4,
        "measured_ms": 54.0,
        "predicted_ms": 50.0,
        "fixed_ms": 2.0,
    }
    runs = [
        ([rows[1], wire], {**used, "engine_micro_s": {"async-pipeline": 0.002}}),
        (
            [{**rows[1], "predicted_ms": 38.0, "fixed_ms": 24.0}, wire],
            {**used, "engine_micro_s": {"ddp bf16": 0.011, "async-pipeline wire-bf16": 0.004}},
        ),
        (
            [{**rows[1], "measured_ms": 60.0}, wire],
            {**used, "engine_micro_s": {"async-pipeline wire-bf16": 0.01}},
        ),
    ]
    fitted = fit(runs)
    assert (fitted["ddp bf16"], fitted["async-pipeline wire-bf16"]) == (0.012, 0.005), fitted
    # measured compressed only: the engines' own keys from those rows, not the default
    assert (fitted["ddp"], fitted["async-pipeline"]) == (0.012, 0.005), fitted


def test_bench_calibrate_fits_several_runs_and_refuses_what_is_not_a_result(tmp_path):
    from bench.__main__ import main

    used = {"step_s": 0.002, "micro_s": 0.0005, "engine_micro_s": {}}
    # 6, 8 and 16 ms a micro-batch: the median is 8
    for i, measured in enumerate((30.0, 34.0, 50.0)):
        rows = [
            {
                "calibration_key": "zero1 comm-bf16",
                "engine_key": "zero1",
                "stages": 1,
                "slots": 2,
                "grad_accum": 2,
                "measured_ms": measured,
                "predicted_ms": 20.0,
                "fixed_ms": 4.0,
            }
        ]
        (tmp_path / f"{i}.json").write_text(
            json.dumps({"rows": rows, "record": {"calibration": used}})
        )
    out = tmp_path / "calibration.json"
    assert main(["calibrate", str(out), *(str(tmp_path / f"{i}.json") for i in range(3))]) == 0
    assert json.loads(out.read_text()) == {
        "engine_micro_s": {"zero1 comm-bf16": 0.008, "zero1": 0.008}
    }
    # what auto reads
    assert cli_calibration(str(out)).engine_micro_s == {"zero1 comm-bf16": 0.008, "zero1": 0.008}
    (tmp_path / "bad.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "odd.json").write_text(
        json.dumps({"rows": [{**rows[0], "grad_accum": 0}], "record": {"calibration": used}})
    )
    for args, error in (
        (
            [str(tmp_path / "new.json"), str(tmp_path / "bad.json")],
            "bad.json: not a bench planner result (KeyError: 'record')",
        ),
        (
            [str(tmp_path / "new.json"), str(tmp_path / "odd.json")],
            "odd.json: not a bench planner result (ZeroDivisionError",
        ),
        (
            [str(tmp_path), str(tmp_path / "0.json")],
            f"bench calibrate: {tmp_path}: cannot write a file there (a folder)",
        ),
    ):
        with pytest.raises(SystemExit, match=re.escape(error)):
            main(["calibrate", *args])
    assert not (tmp_path / "new.json").exists()


def test_every_benchmark_refuses_a_file_as_its_out_folder_before_it_runs(tmp_path, capsys):
    from bench.__main__ import main

    taken = tmp_path / "results.md"
    taken.write_text("kept")
    for command in ("freeze", "train", "planner"):
        with pytest.raises(SystemExit) as e:
            main([command, "--out", str(taken)])
        assert (
            e.value.code == 2 and f"--out {taken}: a file, not a folder" in capsys.readouterr().err
        )
    assert taken.read_text() == "kept"


def test_freeze_table_compares_each_configuration_with_its_baseline_and_refuses_unknown_names():
    from bench.freeze import run as freeze_run
    from bench.freeze import table as freeze_table

    def row(case, config, top1s, walls, frozen):
        runs = [
            {"top1": t, "wall_s": w, "load": 1.5, "frozen": f}
            for t, w, f in zip(top1s, walls, frozen)
        ]
        return {
            "case": case,
            "config": config,
            "slow": "",
            "runs": runs,
            "top1": sorted(top1s)[1],
            "wall_s": sorted(walls)[1],
        }

    result = {
        "device": "a CPU",
        "seeds": [0, 1, 2],
        "load_before": 1.0,
        "load_after": 2.0,
        "engine_options": "--engine diloco",
        "rows": [
            row("finetune", "baseline", [0.99, 0.98, 0.97], [30.0, 28.0, 29.0], [0, 0, 0]),
            row("finetune", "settled 0.7", [0.98, 0.97, 0.96], [20.0, 21.0, 22.0], [5, 5, 4]),
            row("scratch", "baseline", [0.60, 0.65, 0.70], [25.0, 26.0, 27.0], [0, 0, 0]),
            row("scratch", "settled 0.7", [0.60, 0.65, 0.70], [26.0, 26.0, 26.0], [0, 0, 0]),
        ],
    }
    lines = freeze_table(result).splitlines()
    assert lines[0].startswith("a CPU, 2 ranks, --engine diloco; seeds [0, 1, 2]"), lines[0]
    # each configuration against its own case's baseline: 29/21 and 26/26, the medians' difference
    # in points
    assert (
        "| finetune | settled 0.7 | as is | 97.00 | 98.00 / 97.00 / 96.00 | -1.00 | 21.0 | 1.38x | "
        "5 / 5 / 4 |"
        " 1.5, 1.5, 1.5 |" in lines
    ), lines
    assert (
        "| scratch | settled 0.7 | as is | 65.00 | 60.00 / 65.00 / 70.00 | +0.00 | 26.0 | 1.00x | "
        "0 / 0 / 0 |"
        " 1.5, 1.5, 1.5 |" in lines
    ), lines
    good = {
        "seeds": "0",
        "configs": "baseline,settled 0.7",
        "cases": "finetune",
        "slow": "",
        "epochs": None,
        "timeout": 10,
        "out": None,
        "engine_options": "--engine ddp",
    }
    for bad, message in [
        ({"configs": "baseline,settled 0.75"}, "baseline among them (unknown: settled 0.75)"),
        ({"configs": "settled 0.7"}, "(no baseline)"),
        (
            {"cases": "finetune,cifar"},
            "--cases finetune,cifar: each of finetune, "
            "undertrained, "
            "scratch, timm32 (unknown: cifar)",
        ),
        ({"seeds": "0,one"}, "--seeds '0,one': comma-separated whole numbers"),
    ]:
        with pytest.raises(SystemExit) as e:
            freeze_run(Namespace(**{**good, **bad}))
        assert (
            str(e.value).startswith("bench freeze: ")
            and message in str(e.value)
            and "\n" not in str(e.value)
        )


def test_compare_pairs_seeds_gives_the_mean_difference_with_its_error_and_reuses_runs(
    tmp_path, monkeypatch, capsys
):
    from bench import compare
    from bench.__main__ import main

    top1 = {"ddp": [0.90, 0.92, 0.91], "diloco": [0.89, 0.90, 0.905]}
    loss = {"ddp": [0.40, 0.38, 0.39], "diloco": [0.42, 0.41, 0.40]}

    def summary(log_dir: Path, options: list[str]) -> None:
        engine, seed = option(options, "--engine"), int(option(options, "--seed"))
        s = {"top1": top1[engine][seed], "eval_loss": loss[engine][seed], "wall_s": 100.0 + seed}
        (log_dir / "summary.json").write_text(json.dumps(s))

    runs = FakeRuns(summary)
    monkeypatch.setattr(compare, "mpirun_train", runs)
    argv = ["compare", "--base", "--steps 6", "--b", "--engine diloco", "--seeds", "0,1,2"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    # seed by seed, A then B, each the base, its options, the seed, one run of 2 ranks
    assert [(o[:4], option(o, "--seed"), ranks) for o, ranks, _ in runs.launched] == [
        (["--steps", "6", "--engine", e], str(s), 2) for s in range(3) for e in ("ddp", "diloco")
    ]
    result = json.loads((tmp_path / "compare.json").read_text())
    diffs = [-0.01, -0.02, -0.005]
    se = statistics.stdev(diffs) / 3**0.5
    assert result["top1"]["diffs"] == pytest.approx(diffs)
    assert result["top1"]["mean"] == pytest.approx(sum(diffs) / 3)
    assert result["top1"]["se"] == pytest.approx(se)
    assert result["top1"]["ci95"] == pytest.approx(se * 4.30)  # Student's t, 2 degrees of freedom
    assert result["loss"]["mean"] == pytest.approx((0.02 + 0.03 + 0.01) / 3)
    table = (tmp_path / "compare.md").read_text()
    assert table in capsys.readouterr().out
    assert "| 1 | 92.00 | 90.00 | -2.00 | 0.3800 | 0.4100 | +0.0300 | 101 | 101 |" in table
    assert f"top-1, B - A: -1.17 +- {100 * se:.2f} points (standard error; 95% interval" in table
    # again with another B: A's runs are read, not run again
    top1["zero"], loss["zero"] = top1["ddp"], loss["ddp"]
    runs.launched.clear()
    assert main(["compare", "--base", "--steps 6", "--b", "--engine zero", "--seeds", "0,1,2",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    assert [option(o, "--engine") for o, _, _ in runs.launched] == ["zero"] * 3
    assert "top-1, B - A: +0.00 +- 0.00 points" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="at least two seeds"):
        main([*argv[:-1], "0"])
