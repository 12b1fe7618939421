"""Run folders written by vit.train, as plot_logs.py reads them: the logs' schema
(metrics_rank<R>.jsonl, monitor_rank<R>.jsonl, summary.json, config.json), never stdout, and the
tables made of them (the comparison and the freeze phases). Fields it does not know are ignored and
optional ones may be missing (older runs, CPU runs, runs killed mid-write)."""

import json
import re
import sys
from pathlib import Path

from vit.engines.registry import SPECS
from vit.telemetry import jsonl  # the one reader of our logs

# Step phases of the train records in stacking order; then pipe_*_s, other_s, and the unaccounted
# rest.
PHASES = ("data_s", "forward_s", "backward_s", "allreduce_s", "optimizer_s")
COLUMNS = (
    "run",
    "engine",
    "chunks (micro-batches = grad_accum)",
    "batch size (global)",
    "memory per GPU (peak_mem_gib)",
    "images/s",
    "training time (train_s)",
    "top-1 %",
    "top-5 %",
    "status",
)
TIME = COLUMNS.index("training time (train_s)")
PHASE_TITLE = "throughput per freeze phase (layout: pipeline stages x data-parallel copies)"
PHASE_COLUMNS = ("run", "steps", "frozen layers", "layout", "cache", "images/s")


class LogError(Exception):
    """A folder or file that cannot be read as a run: one line, exit 1."""


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSON-lines file (vit.telemetry.jsonl's rule); a truncated last line (a run
    killed mid-write) is dropped."""

    def note(p):
        # plot_logs.py, or the trackers' charts
        print(f"note: {p}: ignoring a truncated last line", file=sys.stderr)

    try:
        return jsonl.read_jsonl(path, on_torn_tail=note)
    except jsonl.JsonlError as e:
        raise LogError(str(e)) from None


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LogError(f"{path}: invalid JSON ({e})") from None
    return obj if isinstance(obj, dict) else {}


def per_rank(folder: Path, prefix: str) -> dict[int, list[dict]]:
    files = {}
    for p in folder.glob(f"{prefix}_rank*.jsonl"):
        m = re.fullmatch(rf"{prefix}_rank(\d+)\.jsonl", p.name)
        if m:
            files[int(m.group(1))] = read_jsonl(p)
    return dict(sorted(files.items()))


def latest_attempts(records: list[dict]) -> list[dict]:
    """A metrics file's records with those of steps a later attempt (a resume from an earlier
    checkpoint) trained again left out: a train record whose step is not past the previous one
    starts an attempt."""
    kept, last = [], 0
    for r in records:
        step = r.get("step")
        if r.get("kind") == "train" and isinstance(step, (int, float)):
            if step <= last:
                kept = [
                    k
                    for k in kept
                    if not (isinstance(k.get("step"), (int, float)) and k["step"] >= step)
                ]
            last = step
        kept.append(r)
    return kept


class Run:
    def __init__(self, folder: str):
        self.path = Path(folder)
        if not self.path.is_dir():
            raise LogError(f"{folder}: no such folder")
        self.metrics = {
            rank: latest_attempts(recs) for rank, recs in per_rank(self.path, "metrics").items()
        }
        self.monitor = per_rank(self.path, "monitor")
        self.summary = read_json(self.path / "summary.json")
        self.config = read_json(self.path / "config.json")
        if not self.metrics and not self.summary:
            raise LogError(
                f"{folder}: no metrics_rank*.jsonl or summary.json; not a run folder of vit.train"
            )
        self.name = self.path.resolve().name

    def records(self, kind: str, rank: int | None = None) -> list[dict]:
        """Records of one kind from `rank` (default: the lowest rank that logged), in step order."""
        if not self.metrics:
            return []
        recs = self.metrics.get(min(self.metrics) if rank is None else rank, [])
        return sorted(
            (r for r in recs if r.get("kind") == kind and isinstance(r.get("step"), (int, float))),
            key=lambda r: r["step"],
        )

    def row(self) -> dict:
        """One line of the comparison table; the config and the logs stand in for a missing
        summary.json."""
        s, ds = self.summary, self.config.get("deepspeed", {})
        engine = s.get("engine") or self.config.get("args", {}).get("engine")
        stage = s.get("zero_stage", ds.get("zero_optimization", {}).get("stage") if ds else None)
        known = SPECS.get(engine)  # None: an engine this version does not know
        if known and known.pipeline and s.get("pipeline_stages"):
            engine = f"{engine} ({s['pipeline_stages']} stages)"
        elif known and stage is not None:
            engine = known.key(stage)  # with the ZeRO stage where its DeepSpeed JSON sets it: zero2
        ips = s.get("images_per_s")
        if ips is None:  # killed before the summary: the mean of the logged windows
            values = [
                r["images_per_s"]
                for r in self.records("train")
                if isinstance(r.get("images_per_s"), (int, float))
            ]
            ips = sum(values) / len(values) if values else None
        return dict(
            zip(
                COLUMNS,
                (
                    self.name,
                    engine,
                    s.get("grad_accum", ds.get("gradient_accumulation_steps")),
                    s.get("global_batch", self.config.get("global_batch")),
                    s.get("peak_mem_gib"),
                    ips,
                    s.get("train_s"),
                    percent(s.get("top1")),
                    percent(s.get("top5")),
                    self.status,
                ),
            )
        )

    def sync_steps(self) -> list[int]:
        """The steps at which the run's workers synced, as its engine's spec reads config.json;
        [] for an engine whose ranks meet every step, or a run that does not say."""
        args = self.config.get("args", {})
        known, total = SPECS.get(args.get("engine")), self.config.get("total_steps")
        return known.sync_steps(args, total) if known and isinstance(total, int) else []

    @property
    def status(self) -> str:
        """A run writes summary.json last: without it, the run was killed, failed or is still
        going."""
        return "complete" if self.summary else "incomplete (no summary.json)"


def percent(fraction):
    return 100 * fraction if isinstance(fraction, (int, float)) else None


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(runs: list[Run]) -> tuple[str, list[list[str]]]:
    rows = [
        [fmt(v, d) for v, d in zip(run.row().values(), (0, 0, 0, 0, 3, 1, 2, 2, 2, 0))]
        for run in runs
    ]
    # a resumed run's training time sums its segments: say how many
    for run, row in zip(runs, rows):
        if (
            isinstance(run.summary.get("segments"), int)
            and run.summary["segments"] > 1
            and row[TIME]
        ):
            row[TIME] += f" ({run.summary['segments']} segments)"
    md = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    md += ["| " + " | ".join(c or "–" for c in row) + " |" for row in rows]
    return "\n".join(md) + "\n", rows


def breakdown(recs: list[dict]) -> tuple[dict[str, float], float | None]:
    """({phase: mean seconds per step}, mean step_time_s) over the train records, the first logging
    window (warm-up) left out when there are others. "unaccounted" is the part of the step no logged
    phase covers."""
    recs = [r for r in recs if isinstance(r.get("step_time_s"), (int, float))]
    recs = recs[1:] if len(recs) > 1 else recs
    if not recs:
        return {}, None
    found = {k for r in recs for k, v in r.items() if isinstance(v, (int, float))}
    names = [p for p in PHASES if p in found]
    names += sorted(k for k in found if k.startswith("pipe_") and k.endswith("_s"))
    names += [k for k in ("other_s",) if k in found]
    mean = {n: sum(r.get(n) or 0.0 for r in recs) / len(recs) for n in names}
    step = sum(r["step_time_s"] for r in recs) / len(recs)
    mean["unaccounted" if names else "step (no breakdown logged)"] = max(
        0.0, step - sum(mean.values())
    )
    return mean, step


def freeze_phases(run: Run) -> list[dict]:
    """Training phases between the freeze records ({"kind": "freeze", "step", "frozen", "stages",
    "dp", "cache"}: from that step on, `frozen` layers are frozen on a stages x dp layout): steps
    (first, last], the record's fields and the mean images/s of the train records logged in the
    phase. [] for a run without freeze records."""
    marks = run.records("freeze")
    if not marks:
        return []
    train = [r for r in run.records("train") if isinstance(r.get("images_per_s"), (int, float))]
    last = max([r["step"] for r in train] + [m["step"] for m in marks])
    # before the first freeze: nothing frozen, the layout the run started with
    if marks[0]["step"] > 0:
        marks = [{"step": 0, "frozen": 0}, *marks]
    phases = []
    for k, mark in enumerate(marks):
        end = marks[k + 1]["step"] if k + 1 < len(marks) else last
        ips = [r["images_per_s"] for r in train if mark["step"] < r["step"] <= end]
        phases.append(
            {
                "first": mark["step"],
                "last": end,
                "frozen": mark.get("frozen"),
                "stages": mark.get("stages"),
                "dp": mark.get("dp"),
                "cache": mark.get("cache"),
                "images_per_s": sum(ips) / len(ips) if ips else None,
            }
        )
    return phases


def layout_and_cache(p: dict) -> tuple[str, str]:
    layout = f"{fmt(p['stages'])} x {fmt(p['dp'])}" if p["stages"] is not None else "as started"
    return layout, {True: "on", False: "off"}.get(p["cache"], fmt(p["cache"])) or "–"


def phase_rows(runs: list[Run]) -> list[list[str]]:
    """Throughput per freeze phase (PHASE_COLUMNS), for the runs that froze layers ([] when none
    did)."""
    rows = []
    for run in runs:
        for p in freeze_phases(run):
            layout, cache = layout_and_cache(p)
            rows.append(
                [
                    run.name,
                    f"{p['first']}-{p['last']}",
                    fmt(p["frozen"]),
                    layout,
                    cache,
                    fmt(p["images_per_s"], 1) or "–",
                ]
            )
    return rows


def phase_table(runs: list[Run]) -> str:
    """Markdown: phase_rows under their title ('' when no run froze layers)."""
    rows = phase_rows(runs)
    if not rows:
        return ""
    md = [
        "",
        PHASE_TITLE,
        "",
        "| " + " | ".join(PHASE_COLUMNS) + " |",
        "|" + "---|" * len(PHASE_COLUMNS),
    ]
    return "\n".join(md + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"
