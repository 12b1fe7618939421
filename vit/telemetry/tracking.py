"""Experiment trackers (--report-to): TensorBoard, Weights & Biases and CSV behind one interface,
`log(metrics, step)` and `close()`, on rank 0 only. They are fed the records of metrics_rank0.jsonl
as they are written, so they show the same numbers, plus every host's latest monitor sample (GPU and
CPU utilisation, memory)."""

import csv
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from vit.core.errors import ConfigError
from vit.runtime.dist_env import rank0_decides
from vit.telemetry.metrics import MetricsLog

RENAMES = {"eval_loss": "loss"}  # eval/loss beside train/loss


def scalars(kind: str, fields: dict) -> dict[str, float]:
    """A metrics record as tracker scalars, '<kind>/<field>' for each number: train/loss,
    train/forward_s, eval/top1, skip/in_a_row, ..."""
    return {
        f"{kind}/{RENAMES.get(k, k)}": float(v)
        for k, v in fields.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def host_scalars(samples: list) -> dict[str, float]:
    """Every rank's latest monitor sample (None where the monitor is off) as per-host scalars."""
    out = {}
    for s in filter(None, samples):
        host = f"monitor/{s['host']}"
        if s["cpu_percent"] is not None:  # host-wide already
            out[f"{host}/cpu_percent"] = s["cpu_percent"]
        out[f"{host}/ranks_rss_mib"] = out.get(f"{host}/ranks_rss_mib", 0.0) + s["rss_mib"]
        for gpu in s["gpus"]:
            for field in ("util_pct", "mem_used_mib"):
                if gpu[field] is not None:
                    out[f"{host}/gpu{gpu['index']}/{field}"] = gpu[field]
    return out


class TensorBoardSink:
    def __init__(self, log_dir: str, hparams: dict, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run writes into the same folder; purge_step makes TensorBoard drop what an
        # earlier attempt logged after the checkpoint this run starts from, so no step shows twice.
        self.writer = SummaryWriter(
            os.path.join(log_dir, "tensorboard"), purge_step=start_step + 1 if start_step else None
        )
        for name, value in hparams.items():
            self.writer.add_text(name, _fenced(value), start_step)

    def log(self, metrics: dict, step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a crashed run keeps its curves (logging steps only)

    def close(self, summary: dict | None = None, charts: list[Path] = ()) -> None:
        from matplotlib.image import imread

        step = (summary or {}).get("steps", 0)
        if summary:
            self.writer.add_text("summary", _fenced(summary), step)
        for chart in charts:
            self.writer.add_image(f"plots/{chart.stem}", imread(chart), step, dataformats="HWC")
        self.writer.close()


def _fenced(value) -> str:
    return "```\n" + json.dumps(value, indent=2, sort_keys=True, default=str) + "\n```"


def wandb_run_id(log_dir: str) -> str:
    """The log dir's W&B run id: made on its first run, read back on every resume, so they are one
    W&B run."""
    path = os.path.join(log_dir, "wandb_run_id")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    run_id = secrets.token_hex(4)  # W&B's own ids are 8 lowercase letters and digits too
    with open(path, "w") as f:
        f.write(run_id + "\n")
    return run_id


def check_wandb() -> None:
    """Before anything is written, on every rank: W&B runs offline or disabled (WANDB_MODE, `wandb
    offline`), or has an API key (WANDB_API_KEY, `wandb login`'s .netrc, its settings file). Asks no
    server."""
    import wandb

    settings = wandb.setup(wandb.Settings(silent=True)).settings  # silent: login's own notes
    if settings.mode in ("offline", "dryrun", "disabled") or wandb.login(
        verify=False, prompt=False
    ):
        return
    raise ConfigError(
        "--report-to wandb: no W&B API key here; log in with `wandb login` (or set WANDB_API_KEY), "
        "or set WANDB_MODE=offline to log without network (`wandb sync` uploads it later)"
    )


class WandbSink:
    """A W&B run named after the log dir, its files in <log-dir>/wandb; WANDB_MODE=offline needs no
    network (`wandb sync <log-dir>/wandb/offline-run-*` uploads it later), WANDB_PROJECT names the
    project."""

    def __init__(self, log_dir: str, hparams: dict, verbose: bool):
        import wandb

        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "vit-cluster"),
                name=os.path.basename(os.path.normpath(log_dir)),
                id=wandb_run_id(log_dir),
                resume="allow",
                dir=log_dir,
                config=hparams,
                settings=wandb.Settings(console="off", silent=not verbose),
            )
        except wandb.errors.Error as e:  # not logged in, no network: the user's to fix
            raise ConfigError(
                f"--report-to wandb: {str(e).splitlines()[0]} (log in with `wandb login`, or set "
                "WANDB_MODE=offline to log without network)"
            ) from None
        if self.run.settings.mode == "offline":
            print(
                f"wandb: offline run {self.run.id}; upload it later with: wandb sync "
                f"{os.path.dirname(self.run.dir)}",
                flush=True,
            )

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self, summary: dict | None = None, charts: list[Path] = ()) -> None:
        import wandb

        if summary:
            self.run.summary.update({k: v for k, v in summary.items() if k != "monitor"})
        if charts:
            artifact = wandb.Artifact(f"plots-{self.run.id}", type="plots")
            for chart in charts:
                artifact.add_file(str(chart))
            self.run.log_artifact(artifact)
        self.run.finish()


class CsvSink:
    """<log-dir>/tracking.csv: one row per scalar (step, name, value), appended to on resume."""

    def __init__(self, log_dir: str):
        path = os.path.join(log_dir, "tracking.csv")
        new = not os.path.exists(path)
        self.file = open(path, "a", newline="")
        self.writer = csv.writer(self.file)
        if new:
            self.writer.writerow(["step", "name", "value"])

    def log(self, metrics: dict, step: int) -> None:
        self.writer.writerows([step, name, value] for name, value in metrics.items())
        self.file.flush()

    def close(self, summary: dict | None = None, charts: list[Path] = ()) -> None:
        self.file.close()


class TrackedMetrics(MetricsLog):
    """MetricsLog that also hands each record to rank 0's trackers. Before a "train" record (every
    rank writes one on each logging step), every rank's latest monitor sample is gathered: a
    collective on logging steps only, and only when trackers are on."""

    def __init__(
        self, log_dir: str, rank: int, sinks: list, monitor, charts: Callable[[str], list[Path]]
    ):
        super().__init__(log_dir, rank)
        self.log_dir, self.sinks, self.monitor, self.charts = log_dir, sinks, monitor, charts

    def write(self, kind: str, step: int, **fields) -> None:
        super().write(kind, step, **fields)
        metrics = scalars(kind, fields)
        if kind == "train":
            samples = [None] * dist.get_world_size()
            dist.all_gather_object(samples, self.monitor.last)
            metrics.update(host_scalars(samples))
        for sink in self.sinks:
            sink.log(metrics, step)

    def close(self) -> None:
        super().close()
        summary = _read_json(os.path.join(self.log_dir, "summary.json")) if self.sinks else None
        charts = (
            self.charts(self.log_dir)
            if summary and any(not isinstance(s, CsvSink) for s in self.sinks)
            else []
        )
        for sink in self.sinks:
            sink.close(summary, charts)


def _read_json(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def metrics_log(
    log_dir: str,
    rank: int,
    report_to: str,
    monitor,
    *,
    start_step: int,
    verbose: bool,
    charts: Callable[[str], list[Path]],
) -> MetricsLog:
    """The run's metrics log: plain, or with the trackers --report-to names (opened on rank 0, after
    config.json and cluster.json are written: they are the run's hyperparameters). `charts`(log
    dir): the run's charts at its end, for the trackers to keep (vit.reports.charts.for_trackers).
    """
    if report_to == "none":
        return MetricsLog(log_dir, rank)
    sinks = []

    def open_sinks():  # on rank 0; a tracker that cannot start stops every rank alike
        hparams = {
            name: _read_json(os.path.join(log_dir, f"{name}.json"))
            for name in ("config", "cluster")
        }
        opened = {
            "tensorboard": lambda: TensorBoardSink(log_dir, hparams, start_step),
            "wandb": lambda: WandbSink(log_dir, hparams, verbose),
            "csv": lambda: CsvSink(log_dir),
        }
        sinks.extend(opened[name]() for name in report_to.split(","))

    rank0_decides(open_sinks)
    return TrackedMetrics(log_dir, rank, sinks, monitor, charts)
