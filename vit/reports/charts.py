"""Charts, a comparison table and one self-contained report.html from run folders written by
vit.train (plot_logs.py is its command line; vit.telemetry.tracking gives the charts to the
trackers). Reads only the logs' schema (vit.reports.runlogs: the records and the tables), never
stdout."""

import base64
import csv
import html
import io
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from PIL import Image  # noqa: E402  (installed with matplotlib)

from vit.reports.runlogs import (  # noqa: E402
    COLUMNS,
    PHASE_COLUMNS,
    PHASE_TITLE,
    PHASES,
    Run,
    breakdown,
    freeze_phases,
    layout_and_cache,
    phase_rows,
    phase_table,
    table,
)

MEASURES = COLUMNS[4:7]  # the numbers compare.png charts
DPI = 80
GAP = 5  # a rank's monitor samples this many usual intervals apart: the run was down between


def empty(ax, message: str) -> None:
    ax.text(
        0.5,
        0.5,
        message,
        ha="center",
        va="center",
        transform=ax.transAxes,
        fontsize=9,
        color="gray",
    )


def finish(fig, axes, path: Path | None):
    """Each chart's legend beside it, never over its lines, and the PNG; with no path, the figure
    (for tests)."""
    for ax in axes:
        if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        ax.grid(alpha=0.3)
    fig.set_layout_engine("constrained")  # makes room for the legends
    if path is None:
        return fig
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    # A chart has few colours: 256 of them keep it exact and make the file (and report.html) ~4x
    # smaller.
    Image.open(buf).convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE).save(
        path, optimize=True
    )


def plot_loss(runs: list[Run], path: Path | None):
    fig, (ax_loss, ax_top1) = plt.subplots(1, 2, figsize=(12, 4))
    # a top-5 curve -> the colours of the runs that have it: runs alike (often all at 100%) share a
    # line
    top5 = {}
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        train = [r for r in run.records("train") if isinstance(r.get("loss"), (int, float))]
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], color=color)
        for k, step in enumerate(run.sync_steps()):  # diloco: where the workers synced
            label = f"{run.name}: syncs" if k == 0 else None
            ax_loss.axvline(step, color=color, alpha=0.25, lw=0.8, label=label)
        evals = run.records("eval")
        ev = [r for r in evals if isinstance(r.get("eval_loss"), (int, float))]
        ax_loss.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o--", color=color)
        top = [r for r in evals if isinstance(r.get("top1"), (int, float))]
        ax_top1.plot(
            [r["step"] for r in top],
            [100 * r["top1"] for r in top],
            "o-",
            color=color,
            label=run.name,
        )
        curve = tuple(
            (r["step"], 100 * r["top5"]) for r in evals if isinstance(r.get("top5"), (int, float))
        )
        top5.setdefault(curve, []).append(color)
    for curve, colors in top5.items():
        if curve:
            ax_top1.plot(
                *zip(*curve),
                "x:",
                color=colors[0] if len(colors) == 1 else "black",
                label=f"top-5, the same for {len(colors)} runs" if len(colors) > 1 else None,
            )
    ax_loss.set(title="loss (line: train, dots: eval)", xlabel="step", ylabel="cross-entropy")
    ax_top1.set(title="eval top-1 (o) and top-5 (x)", xlabel="step", ylabel="%", ylim=(0, 105))
    if not any(len(line.get_xdata()) for line in ax_loss.lines):
        empty(ax_loss, "no train records")
    if not any(len(line.get_xdata()) for line in ax_top1.lines):
        empty(ax_top1, "no eval records")
    return finish(fig, (ax_loss, ax_top1), path)


def plot_throughput(runs: list[Run], path: Path | None):
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, run in enumerate(runs):
        recs = [r for r in run.records("train") if isinstance(r.get("images_per_s"), (int, float))]
        ax.plot(
            [r["step"] for r in recs],
            [r["images_per_s"] for r in recs],
            ".-",
            color=f"C{i % 10}",
            label=run.name,
        )
    if not any(len(line.get_xdata()) for line in ax.lines):
        empty(ax, "no train records")
    ax.set(title="throughput (rank 0's timing)", xlabel="step", ylabel="images/s")
    return finish(fig, (ax,), path)


def series(run: Run):
    """(label, seconds since the run's first sample, record or GPU entry) lines of the monitor
    files: one per host and GPU, CPU % one per host, RSS one per rank. A GPU or host seen by several
    ranks is plotted once. Where a resumed run's next attempt starts (its step goes back, or the
    rank's samples pause for over GAP times their usual interval: a resume from the step it
    stopped at), each line gets a break, (nan, None)."""
    first = min(
        (r["time"] for recs in run.monitor.values() for r in recs if "time" in r), default=0.0
    )
    gpus, cpus, rss = {}, {}, {}
    for rank, recs in run.monitor.items():
        times = [r["time"] for r in recs if "time" in r]
        usual = statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 2 else 0
        last_step, last_t = 0, None
        for r in recs:
            if "time" not in r:
                continue
            t, host = r["time"] - first, r.get("host", "?")
            paused = last_t is not None and usual > 0 and t - last_t > GAP * usual
            last_t = t
            went_back = isinstance(r.get("step"), (int, float)) and r["step"] < last_step
            if isinstance(r.get("step"), (int, float)):
                last_step = r["step"]
            if went_back or paused:  # a new attempt: no line across the time the run was down
                for pts in (
                    *(p for k, p in gpus.values() if k == rank),
                    *(p for k, p in cpus.values() if k == rank),
                    rss.get(rank, []),
                ):
                    pts.append((float("nan"), None))
            for g in r.get("gpus") or []:
                key = (host, g.get("index"))
                if gpus.setdefault(key, (rank, []))[0] == rank:
                    gpus[key][1].append((t, g))
            if cpus.setdefault(host, (rank, []))[0] == rank:
                cpus[host][1].append((t, r))
            rss.setdefault(rank, []).append((t, r))
    return (
        {f"{run.name} {h} gpu{i}": pts for (h, i), (_, pts) in gpus.items()},
        {f"{run.name} {h}": pts for h, (_, pts) in cpus.items()},
        {f"{run.name} rank {k}": pts for k, pts in rss.items()},
    )


def plot_resources(runs: list[Run], path: Path | None):
    parts = [series(run) for run in runs]
    has_gpu = any(gpus for gpus, _, _ in parts)
    panels = (
        [(0, "util_pct", "GPU utilisation", "%"), (0, "mem_used_mib", "GPU memory used", "MiB")]
        if has_gpu
        else []
    ) + [(1, "cpu_percent", "host CPU", "%"), (2, "rss_mib", "process resident memory", "MiB")]
    # legends at the right
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.8 * len(panels)), squeeze=False)
    axes = axes.ravel()
    for ax, (which, field, title, unit) in zip(axes, panels):
        for i, part in enumerate(parts):
            for j, (label, pts) in enumerate(part[which].items()):
                pts = [
                    (t, e[field] if e else t)
                    for t, e in pts
                    # (nan, None): a break
                    if e is None or isinstance(e.get(field), (int, float))
                ]
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=f"C{i % 10}",
                    linestyle=("-", "--", ":", "-.")[j % 4],
                    label=label,
                )
        if not ax.lines:
            empty(ax, "no monitor_rank*.jsonl (monitor off?)")
        ax.set(title=title, xlabel="seconds since the first sample", ylabel=unit)
        # lines clear of the frame
        ax.set_ylim(0, 105 if unit == "%" else 1.08 * max(ax.dataLim.y1, 0) or None)
    return finish(fig, axes, path)


def plot_breakdown(runs: list[Run], path: Path | None):
    bars = [
        (f"{run.name} rank {rank}", *breakdown(run.records("train", rank)))
        for run in runs
        for rank in run.metrics
    ]
    bars = [bar for bar in bars if bar[1]]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(bars) + 3), 4.5))
    seen = {p for _, b, _ in bars for p in b}
    order = [
        *PHASES,
        *sorted(p for p in seen if p.startswith("pipe_")),
        "other_s",
        "unaccounted",
        "step (no breakdown logged)",
    ]
    phases = [p for p in order if p in seen]
    bottom = [0.0] * len(bars)
    for k, phase in enumerate(phases):
        heights = [1e3 * b.get(phase, 0.0) for _, b, _ in bars]
        ax.bar(
            range(len(bars)),
            heights,
            bottom=bottom,
            label=phase,
            color="lightgray" if phase == "unaccounted" else f"C{k}",
        )
        bottom = [b + h for b, h in zip(bottom, heights)]
    top = max([*bottom, *(1e3 * step for _, _, step in bars)], default=0.0)
    if bars:  # phases that overlap (communication hidden behind compute) stack above this mark
        ax.scatter(
            range(len(bars)),
            [1e3 * step for _, _, step in bars],
            marker="_",
            s=600,
            color="black",
            label="step_time_s",
            zorder=3,
        )
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    else:
        empty(ax, "no train records")
    ax.set_xticks(
        range(len(bars)), [label for label, _, _ in bars], fontsize=8, rotation=30, ha="right"
    )
    ax.set_ylim(0, 1.08 * top or None)
    ax.set(title="step time per rank", ylabel="ms per step (mean; first logged window left out)")
    return finish(fig, (ax,), path)


def plot_compare(runs: list[Run], path: Path | None):
    """A bar per run, numbered; the legend below names them (run names under the bars overlap)."""
    rows = [run.row() for run in runs]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4), layout="constrained")
    numbers, colors = range(1, len(rows) + 1), [f"C{i % 10}" for i in range(len(rows))]
    titles = ("peak memory per GPU (GiB; RSS on CPU)", "images/s", "training time (s)")
    for ax, col, title in zip(axes, MEASURES, titles):
        values = [r[col] if isinstance(r[col], (int, float)) else 0.0 for r in rows]
        ax.bar(numbers, values, color=colors)
        ax.set_xticks(numbers)
        ax.set(title=title, xlabel="run")
    names = [
        f"{k}  {r['run']}" + ("" if r["engine"] in (None, r["run"]) else f" ({r['engine']})")
        for k, r in zip(numbers, rows)
    ]
    fig.legend(
        [matplotlib.patches.Patch(color=c) for c in colors],
        names,
        loc="outside lower center",
        ncol=min(3, len(rows)),
        fontsize=8,
    )
    return finish(fig, axes, path)


def plot_freeze(runs: list[Run], path: Path | None):
    """Frozen layers over the steps (a step line per run) and each phase's images/s (a bar per
    phase)."""
    fig, (ax_frozen, ax_ips) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars = []
    for i, run in enumerate(runs):
        phases = freeze_phases(run)
        if not phases:
            continue
        steps = [p["first"] for p in phases] + [phases[-1]["last"]]
        frozen = [p["frozen"] for p in phases]
        ax_frozen.step(
            steps, frozen + frozen[-1:], where="post", color=f"C{i % 10}", label=run.name
        )
        for p in phases:
            layout, cache = layout_and_cache(p)
            bars.append(
                (
                    f"{run.name}\nsteps {p['first']}-{p['last']}\n{p['frozen']} "
                    f"frozen\n{layout}, cache {cache}",
                    p["images_per_s"] or 0.0,
                    i,
                )
            )
    ax_frozen.set(title="frozen layers", xlabel="step", ylabel="layers frozen (prefix)")
    ax_frozen.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax_ips.bar(range(len(bars)), [b[1] for b in bars], color=[f"C{b[2] % 10}" for b in bars])
    ax_ips.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=6)
    ax_ips.set(title="throughput per freeze phase (mean of the logged windows)", ylabel="images/s")
    return finish(fig, (ax_frozen, ax_ips), path)


def html_table(columns, rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def report(out: Path, runs: list[Run], charts: list[Path], rows: list[list[str]]) -> None:
    phases = phase_rows(runs)
    phases = (
        f"<h2>{html.escape(PHASE_TITLE)}</h2>{html_table(PHASE_COLUMNS, phases)}" if phases else ""
    )
    imgs = "".join(
        f"<h2>{p.stem}</h2><img alt='{p.stem}' src='data:image/png;base64,"
        f"{base64.b64encode(p.read_bytes()).decode()}'>"
        for p in charts
    )
    sources = ", ".join(html.escape(str(run.path)) for run in runs)
    (out / "report.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>training report</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}img{max-width:100%}</style>"
        f"</head><body><h1>training report</h1><p>runs: {sources}</p>"
        f"{html_table(COLUMNS, rows)}{phases}{imgs}</body></html>\n"
    )


def write(runs: list[Run], out: Path) -> tuple[str, list[Path]]:
    """Every chart, comparison.md, comparison.csv and report.html into `out`: the markdown table and
    the charts. Raises vit.reports.runlogs.LogError (a log that cannot be read) or OSError."""
    out.mkdir(parents=True, exist_ok=True)
    charts = [
        out / "loss.png",
        out / "throughput.png",
        out / "resources.png",
        out / "breakdown.png",
    ]
    plot_loss(runs, charts[0])
    plot_throughput(runs, charts[1])
    plot_resources(runs, charts[2])
    plot_breakdown(runs, charts[3])
    if len(runs) > 1:
        charts.append(out / "compare.png")
        plot_compare(runs, charts[-1])
    if any(run.records("freeze") for run in runs):
        charts.append(out / "freeze.png")
        plot_freeze(runs, charts[-1])
    md, rows = table(runs)
    md += phase_table(runs)
    (out / "comparison.md").write_text(md)
    with open(out / "comparison.csv", "w", newline="") as f:
        csv.writer(f).writerows([COLUMNS, *rows])
    report(out, runs, charts, rows)
    return md, charts


def for_trackers(log_dir: str) -> list[Path]:
    """The run's charts (into <log-dir>/plots), for the trackers to keep beside the curves."""
    try:
        return sorted(write([Run(log_dir)], Path(log_dir) / "plots")[1])
    except Exception as e:  # the charts are an extra: the run and its curves stand without them
        print(
            f"warning: no charts for the trackers: {type(e).__name__}: {e}",
            file=sys.stderr,
            flush=True,
        )
        return []
