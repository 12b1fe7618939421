"""plot_logs.py (the command line of vit.reports.charts) on the logs of real 2-rank runs (ZeRO-2 and
the pipeline, CPU and gloo), trained once for the module; and on broken or odd folders."""

import csv
import json
import shutil
import sys

import matplotlib.image
import matplotlib.pyplot as plt
import pytest
from helpers import ROOT, base_env, launch, plugin_env, run_cmd

from vit.reports import charts, runlogs
from vit.run.cli import parser

pytestmark = pytest.mark.ranks  # every test here starts processes

CHARTS = ("loss", "throughput", "resources", "breakdown")
MONITOR_WIRED = "--monitor-interval" in parser().format_help()
# The module's two trainings run inside the first test's time limit.
TIMEOUT = 900


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    common = ["--steps", 20, "--log-interval", 2, "--eval-interval", 10, "--no-save"]
    if MONITOR_WIRED:
        common += ["--monitor-interval", 0.2]
    for name, engine in [
        ("zero2", ["--engine", "zero", "--ds-config", ROOT / "deepspeed_configs" / "zero2.json"]),
        ("pipeline", ["--engine", "pipeline"]),
    ]:
        r = launch([*engine, *common, "--log-dir", root / name], nprocs=2, timeout=400)
        assert r.ok, r
    return {"zero2": root / "zero2", "pipeline": root / "pipeline"}


def plot(*args, timeout=120):
    return run_cmd([sys.executable, str(ROOT / "plot_logs.py"), *map(str, args)], timeout=timeout)


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    pixels = matplotlib.image.imread(path)
    height, width = pixels.shape[:2]
    assert 200 <= height <= 2000 and 400 <= width <= 2000 and pixels.shape[2] in (3, 4), (
        path,
        pixels.shape,
    )
    assert pixels.std() > 0.01, f"{path} is blank"


@pytest.mark.timeout(TIMEOUT)
def test_charts_table_and_report_from_real_runs(runs, tmp_path):
    out = tmp_path / "plots"
    r = plot(runs["zero2"], runs["pipeline"], "--out", out)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in (*CHARTS, "compare"):
        assert_png(out / f"{name}.png")
    with open(out / "comparison.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["run"] for row in rows] == ["zero2", "pipeline"]
    for row, name in zip(rows, ("zero2", "pipeline")):
        s = json.loads((runs[name] / "summary.json").read_text())
        assert row["engine"] == ("zero2" if name == "zero2" else "pipeline (2 stages)")
        assert (
            int(row["chunks (micro-batches = grad_accum)"])
            == s["grad_accum"]
            == (1 if name == "zero2" else 4)
        )
        assert int(row["batch size (global)"]) == s["global_batch"] == 64
        assert float(row["memory per GPU (peak_mem_gib)"]) == pytest.approx(
            s["peak_mem_gib"], abs=1e-3
        )
        assert float(row["images/s"]) == pytest.approx(s["images_per_s"], abs=0.1)
        assert float(row["training time (train_s)"]) == pytest.approx(s["train_s"], abs=0.01)
        assert float(row["top-1 %"]) == pytest.approx(100 * s["top1"], abs=0.01)
        assert (
            float(row["top-5 %"]) == pytest.approx(100 * s["top5"], abs=0.01)
            and s["top5"] >= s["top1"]
        )
    md = (out / "comparison.md").read_text().splitlines()
    assert (
        len(md) == 4
        and md[2].startswith("| zero2 | zero2 | 1 | 64 |")
        and md[3].startswith("| pipeline |")
    )
    html = (out / "report.html").read_text()
    assert html.count("src='data:image/png;base64,") == len(CHARTS) + 1
    # self-contained, with the table
    assert "http" not in html and all(row["images/s"] in html for row in rows)


@pytest.mark.timeout(TIMEOUT)
def test_one_run_default_output_folder(runs, tmp_path):
    run = shutil.copytree(runs["pipeline"], tmp_path / "pipe")
    r = plot(run)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in (run / "plots").iterdir()) == sorted(
        [f"{c}.png" for c in CHARTS] + ["comparison.csv", "comparison.md", "report.html"]
    )
    for name in CHARTS:
        assert_png(run / "plots" / f"{name}.png")
    evals = [rec for rec in runlogs.Run(run).records("eval")]
    assert [rec["step"] for rec in evals] == [10, 20]
    # Every rank appears in the step-time chart.
    assert {rank for rank in runlogs.Run(run).metrics} == {0, 1}


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.skipif(not MONITOR_WIRED, reason="vit/train.py has no --monitor-interval yet")
def test_monitor_logs_of_real_runs(runs):
    for name, run_dir in runs.items():
        run = runlogs.Run(run_dir)
        assert sorted(run.monitor) == [0, 1]
        for rank, records in run.monitor.items():
            assert records and all(
                rec["rank"] == rank and rec["host"] and rec["rss_mib"] > 0 for rec in records
            )
            # the last sample comes after the last step
            assert max(rec["step"] for rec in records) == 20
        gpus, cpus, rss = charts.series(run)
        # one host, two ranks
        assert len(cpus) == 1 and sorted(rss) == [f"{name} rank 0", f"{name} rank 1"]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert [m["rank"] for m in summary["monitor"]] == [0, 1]
        assert all(m["samples"] == len(run.monitor[m["rank"]]) for m in summary["monitor"])
        assert set(summary["gpu_util_mean_per_host"]) == {rec["host"] for rec in run.monitor[0]}


@pytest.mark.timeout(TIMEOUT)
def test_run_killed_mid_write(runs, tmp_path):
    # No summary.json, half a line at the end of the logs: charts still, the table from the config
    # and records.
    run = shutil.copytree(runs["zero2"], tmp_path / "killed")
    (run / "summary.json").unlink()
    for log in run.glob("*_rank1.jsonl"):
        with open(log, "a") as f:
            f.write('{"kind": "train", "step": 22, "lo')
    r = plot(run, "--out", tmp_path / "out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "truncated last line" in r.stderr
    for name in CHARTS:
        assert_png(tmp_path / "out" / f"{name}.png")
    row = next(csv.DictReader(open(tmp_path / "out" / "comparison.csv")))
    assert (
        row["engine"] == "zero2"
        and row["batch size (global)"] == "64"
        and float(row["images/s"]) > 0
    )
    assert row["training time (train_s)"] == ""


@pytest.mark.timeout(TIMEOUT)
def test_run_killed_mid_write_then_resumed(tmp_path):
    # A run that dies at step 4 with half a record at the end of every log, then resumed from its
    # step-2 checkpoint: the resumed run's records start on a line of their own, and the run plots
    # whole.
    run, out = tmp_path / "run", tmp_path / "plots"
    args = ["--steps", 8, "--log-interval", 1, "--save-interval", 2, "--log-dir", run]
    r = launch(args, env=plugin_env(crash_in_save="step4"), timeout=400)
    assert 5 in r.returncodes, r
    for log in run.glob("*_rank*.jsonl"):
        log.write_text(log.read_text()[:-15])
    r = plot(run, "--out", out)
    assert r.returncode == 0 and "truncated last line" in r.stderr, r.stdout + r.stderr
    assert (
        next(csv.DictReader(open(out / "comparison.csv")))["status"]
        == "incomplete (no summary.json)"
    )
    r = launch([*args, "--resume"], timeout=400)
    assert r.ok, r
    r = plot(run, "--out", out)
    assert r.returncode == 0 and "truncated" not in r.stderr, r.stdout + r.stderr
    assert next(csv.DictReader(open(out / "comparison.csv")))["status"] == "complete"
    assert max(rec["step"] for rec in runlogs.Run(run).records("train")) == 8


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.timeout(60)
def test_step_time_breakdown_with_unknown_fields(tmp_path):
    # Records as the pipeline engine will write them, plus a field this script has never heard of.
    run = tmp_path / "pipe-x"
    run.mkdir()
    for rank, send in ((0, 0.010), (1, 0.030)):  # rank 1 waits longer: a straggler
        write_jsonl(
            run / f"metrics_rank{rank}.jsonl",
            [
                {
                    "kind": "train",
                    "step": s,
                    "time": 1.0 * s,
                    "rank": rank,
                    "host": "cn0",
                    "loss": 2.0 - s / 10,
                    "images_per_s": 500.0,
                    "step_time_s": 0.100,
                    "data_s": 0.005,
                    "forward_s": 0.020,
                    "backward_s": 0.040,
                    "optimizer_s": 0.010,
                    "pipe_send_s": send,
                    "pipe_recv_s": 0.005,
                    "allreduce_s": 0.002,
                    "other_s": 0.001,
                    "future_field": [1, 2],
                    "note_s": "x",
                }
                for s in (2, 4, 6)
            ],
        )
    write_jsonl(
        run / "monitor_rank0.jsonl",
        [
            {
                "time": 100.0 + t,
                "host": "cn0",
                "rank": 0,
                "step": t,
                "cpu_percent": 50.0,
                "rss_mib": 900.0,
                "gpus": [
                    {"index": 0, "util_pct": 90.0, "mem_used_mib": 8000.0, "mem_total_mib": 12288.0}
                ],
                "new": True,
            }
            for t in range(3)
        ],
    )
    got, step_s = runlogs.breakdown(runlogs.Run(run).records("train", 1))
    assert list(got) == [
        "data_s",
        "forward_s",
        "backward_s",
        "allreduce_s",
        "optimizer_s",
        "pipe_recv_s",
        "pipe_send_s",
        "other_s",
        "unaccounted",
    ]
    assert got["pipe_send_s"] == pytest.approx(0.030) and got["unaccounted"] == pytest.approx(
        0.0, abs=1e-9
    )
    assert step_s == pytest.approx(0.100)
    assert runlogs.breakdown(runlogs.Run(run).records("train", 0))[0][
        "unaccounted"
    ] == pytest.approx(0.007)
    r = plot(run)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in CHARTS:
        assert_png(run / "plots" / f"{name}.png")
    table = (run / "plots" / "comparison.md").read_text()
    assert "| pipe-x | – | – | – | – | 500.0 | – | – | – | incomplete (no summary.json) |" in table


def freeze_run(folder, freezes):
    """A run's metrics as --freeze writes them: train windows of 2 steps whose images/s rise at each
    freeze."""
    folder.mkdir()
    speed = {
        2: 100.0,
        4: 100.0,
        6: 130.0,
        8: 150.0,
        10: 150.0,
        12: 170.0,
        14: 250.0,
        16: 250.0,
        18: 250.0,
    }
    for rank in (0, 1):
        train = [
            {
                "kind": "train",
                "step": s,
                "time": 1.0 * s,
                "rank": rank,
                "host": "cn0",
                "loss": 2.0 - s / 10,
                "images_per_s": ips,
                "step_time_s": 64 / ips,
            }
            for s, ips in speed.items()
        ]
        marks = [
            {"kind": "freeze", "time": 1.0 * f["step"], "rank": rank, "host": "cn0", **f}
            for f in freezes
        ]
        write_jsonl(
            folder / f"metrics_rank{rank}.jsonl", sorted(train + marks, key=lambda r: r["time"])
        )
    return folder


@pytest.mark.timeout(60)
def test_frozen_layers_and_throughput_per_freeze_phase(tmp_path):
    freezes = [
        {"step": 6, "frozen": 2, "stages": 2, "dp": 1, "cache": False},
        {"step": 12, "frozen": 4, "stages": 1, "dp": 2, "cache": True},
    ]
    run = freeze_run(tmp_path / "autofreeze", freezes)
    phases = runlogs.freeze_phases(runlogs.Run(run))
    assert [
        (p["first"], p["last"], p["frozen"], p["stages"], p["dp"], p["cache"]) for p in phases
    ] == [(0, 6, 0, None, None, None), (6, 12, 2, 2, 1, False), (12, 18, 4, 1, 2, True)]
    assert [p["images_per_s"] for p in phases] == pytest.approx([110.0, 470 / 3, 250.0])
    plain = tmp_path / "plain"  # the same run without its freeze records
    plain.mkdir()
    for log in run.glob("metrics_rank*.jsonl"):
        (plain / log.name).write_text(
            "".join(line + "\n" for line in log.read_text().splitlines() if '"freeze"' not in line)
        )
    r = plot(run, plain, "--out", tmp_path / "out")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in (*CHARTS, "compare", "freeze"):
        assert_png(tmp_path / "out" / f"{name}.png")
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert md.split("throughput per freeze phase")[1].splitlines()[4:] == [
        "| autofreeze | 0-6 | 0 | as started | – | 110.0 |",
        "| autofreeze | 6-12 | 2 | 2 x 1 | off | 156.7 |",
        "| autofreeze | 12-18 | 4 | 1 x 2 | on | 250.0 |",
    ]
    assert "wrote 6 charts" in r.stdout and "| autofreeze | 12-18 |" in r.stdout
    assert (tmp_path / "out" / "report.html").read_text().count("src='data:image/png;base64,") == 6
    # A run that never froze: the charts and table it had before, no freeze.png.
    r = plot(plain, "--out", tmp_path / "plain-out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in (tmp_path / "plain-out").iterdir()) == sorted(
        [f"{c}.png" for c in CHARTS] + ["comparison.csv", "comparison.md", "report.html"]
    )
    assert "freeze" not in (tmp_path / "plain-out" / "comparison.md").read_text()
    # A freeze at step 0 starts the first phase itself.
    run0 = freeze_run(
        tmp_path / "from-start", [{"step": 0, "frozen": 1, "stages": 2, "dp": 1, "cache": False}]
    )
    assert [
        (p["first"], p["last"], p["frozen"]) for p in runlogs.freeze_phases(runlogs.Run(run0))
    ] == [(0, 18, 1)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["empty folder", "missing folder", "corrupt middle line"])
def test_bad_folder_is_one_line_error(tmp_path, case):
    folder = tmp_path / "run"
    if case != "missing folder":
        folder.mkdir()
    if case == "corrupt middle line":
        (folder / "metrics_rank0.jsonl").write_text(
            '{"kind": "train", "step": 1}\n{oops\n{"kind": "train"}\n'
        )
    r = plot(folder)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("plot_logs.py: error: "), r.stderr
    assert {
        "empty folder": "not a run folder",
        "missing folder": "no such folder",
        "corrupt middle line": "metrics_rank0.jsonl:2: not a JSON line",
    }[case] in r.stderr


@pytest.mark.timeout(60)
def test_help():
    r = plot("--help")
    assert r.returncode == 0 and "--out" in r.stdout and "report.html" in r.stdout


@pytest.mark.timeout(120)
def test_compare_script_runs_every_engine_by_default(tmp_path):
    """Without RUNS, compare.sh runs the registry's every run: the async pipeline and diloco, the
    engines the README recommends on 1 GbE, were left out. Open MPI is replaced at its outer
    boundary (MPIRUN) by a script that notes each launch's engine and fails it."""
    from vit.engines.registry import SPECS

    fake, noted = tmp_path / "mpirun", tmp_path / "launches"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {noted}\nexit 1\n')
    fake.chmod(0o755)
    env = {**base_env(), "MPIRUN": str(fake), "OUT": str(tmp_path / "out")}
    r = run_cmd([str(ROOT / "scripts" / "compare.sh")], timeout=100, env=env)
    assert r.returncode == 1 and "compare.sh: every run failed" in r.stderr, r.stderr
    engines = {line.split("--engine ")[1].split()[0] for line in noted.read_text().splitlines()}
    assert engines == set(SPECS) - {"auto"}, engines


@pytest.mark.timeout(60)
def test_compare_script_help_and_bad_input():
    script = str(ROOT / "scripts" / "compare.sh")
    r = run_cmd([script, "--help"], timeout=30)
    assert r.returncode == 0 and "HOSTFILE" in r.stdout and "STEPS" in r.stdout
    r = run_cmd([script, "--steps", "5"], timeout=30)
    assert r.returncode == 2 and "unknown option '--steps' (train options go after --)" in r.stderr
    r = run_cmd(
        [script], env={**base_env(), "RUNS": "zero9", "OUT": "/nonexistent/never"}, timeout=30
    )
    assert r.returncode == 2 and "unknown run 'zero9'" in r.stderr


def plain_run(folder, attempts, summary, freeze=None, monitor_restarts=True):
    """A 2-rank run's logs: `attempts` [(first step, last step, seconds the run was down before)] of
    train records every 2 steps (an attempt may redo steps of the one before: a resume from an
    earlier checkpoint), evals with top-5 100% every 10, monitor samples whose step starts at 0 in
    each attempt (else the train step's), and its summary."""
    folder.mkdir()
    for rank in (0, 1):
        metrics, monitor, t = [], [], 0.0
        for a, (first, last, down) in enumerate(attempts):
            t += down
            for i, s in enumerate(range(first, last + 1, 2)):
                t += 1.0
                base = {"step": s, "time": t, "rank": rank, "host": "cn0"}
                metrics.append(
                    {
                        "kind": "train",
                        **base,
                        "loss": 2.0 - s / 100 + a,
                        "images_per_s": 500.0 + a,
                        "step_time_s": 0.1,
                    }
                )
                metrics += (
                    [{"kind": "eval", **base, "eval_loss": 1.9, "top1": s / 100, "top5": 1.0}]
                    if s % 10 == 0
                    else []
                )
                monitor.append(
                    {
                        **base,
                        "step": 2 * i if monitor_restarts else s,
                        "cpu_percent": 90.0,
                        "rss_mib": 900.0 + rank,
                        "gpus": [{"index": rank, "util_pct": 80.0, "mem_used_mib": 4000.0}],
                    }
                )
        metrics += [
            {"kind": "freeze", "time": t, "rank": rank, "host": "cn0", **f} for f in freeze or []
        ]
        write_jsonl(folder / f"metrics_rank{rank}.jsonl", metrics)
        write_jsonl(folder / f"monitor_rank{rank}.jsonl", monitor)
    (folder / "summary.json").write_text(
        json.dumps(
            {
                "engine": "zero",
                "zero_stage": 2,
                "grad_accum": 1,
                "global_batch": 64,
                "images_per_s": 500.0,
                **summary,
            }
        )
    )
    return folder


def overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.timeout(120)
def test_charts_stay_readable_and_a_resumed_run_is_split_where_it_restarted(tmp_path):
    import numpy as np

    names = [f"zero{k}-20261124-0449{k:02d}" for k in range(5)] + ["resumed-20261124-045536"]
    folders = [
        plain_run(tmp_path / n, [(2, 40, 0)], {"train_s": 4.0 + k}) for k, n in enumerate(names[:4])
    ]
    folders.append(
        plain_run(
            tmp_path / names[4],
            [(2, 40, 0)],
            {"train_s": 5.0},
            freeze=[{"step": 20, "frozen": 2, "stages": 1, "dp": 2, "cache": True}],
        )
    )
    # Died after step 30, resumed from its step-24 checkpoint after 300 s: 2 segments.
    folders.append(
        plain_run(
            tmp_path / names[5],
            [(2, 30, 0), (26, 40, 300)],
            {"train_s": 9.0, "train_s_this_run": 2.5, "segments": 2},
        )
    )
    runs = [runlogs.Run(f) for f in folders]

    train = runs[5].records("train")  # the redone steps 26-30 once, from the attempt that went on
    assert [r["step"] for r in train] == list(range(2, 42, 2)) and train[-1][
        "loss"
    ] == pytest.approx(2.6)
    rss = next(
        line
        for line in charts.plot_resources(runs, None).axes[-1].lines
        if line.get_label() == f"{names[5]} rank 0"
    )
    x = np.asarray(rss.get_xdata(), dtype=float)
    assert (
        np.isnan(x).sum() == 1 and x[np.flatnonzero(np.isnan(x))[0] + 1] - np.nanmax(x[:15]) > 300
    )
    # Resumed from the step it stopped at, 300 s later: the monitor's step does not go back, the
    # pause of 300 usual intervals splits it all the same (a line across the downtime before).
    at_stop = plain_run(tmp_path / "at-stop", [(2, 30, 0), (32, 40, 300)], {}, None, False)
    for line in charts.plot_resources([runlogs.Run(at_stop)], None).axes[-1].lines:
        x = np.asarray(line.get_xdata(), dtype=float)
        assert np.isnan(x).sum() == 1 and x[np.flatnonzero(np.isnan(x))[0] + 1] - x[14] > 300

    for chart in (charts.plot_resources, charts.plot_compare, charts.plot_loss):
        fig = chart(runs, None)
        fig.canvas.draw()
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + fig.legends
        assert legends, chart.__name__
        # beside or under the charts, never over one (the memory panel's, the top-1's)
        for legend in legends:
            box = legend.get_window_extent()
            assert not any(overlaps(box, ax.get_window_extent()) for ax in fig.axes), chart.__name__
        if chart is charts.plot_compare:  # numbered bars; the legend names the runs
            assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [
                "1",
                "2",
                "3",
                "4",
                "5",
                "6",
            ]
            assert [t.get_text() for t in fig.legends[0].get_texts()] == [
                f"{k}  {n} (zero2)" for k, n in enumerate(names, 1)
            ]
        # six runs' top-5 at 100%: one line, said so, below the frame's top
        if chart is charts.plot_loss:
            top5 = [line for line in fig.axes[1].lines if line.get_marker() == "x"]
            assert [line.get_label() for line in top5] == ["top-5, the same for 6 runs"]
            assert fig.axes[1].get_ylim()[1] > 100
        plt.close(fig)

    r = plot(*folders, "--out", tmp_path / "out")
    assert r.returncode == 0, r.stdout + r.stderr
    report = (tmp_path / "out" / "report.html").read_text()
    assert (
        runlogs.PHASE_TITLE in report
        and f"<td>{names[4]}</td><td>20-40</td><td>2</td><td>1 x 2</td>" in report
    )
    row = next(
        row
        for row in csv.DictReader(open(tmp_path / "out" / "comparison.csv"))
        if row["run"] == names[5]
    )
    assert row["training time (train_s)"] == "9.00 (2 segments)"
