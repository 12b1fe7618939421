"""Per-rank JSON-lines metrics, rank 0's fixed-format log line, and small JSON writers.

Schema of <log-dir>/metrics_rank<R>.jsonl (one object per line; readers ignore unknown fields):
  {"kind": "train", "step", "time", "rank", "host", "loss", "lr", "images_per_s" (the whole job's),
   "rank_images_per_s" (this rank's data-parallel share), "step_time_s", "mem_gib",
   "skipped_steps", "loss_scale" (fp16's loss scale, else null), and the step-time breakdown in
   seconds per step: "data_s", "forward_s", "backward_s", "optimizer_s", for the pipelines also
   "pipe_send_s", "pipe_recv_s" (the wait for a neighbour: the bubble), "allreduce_s"; the async
   pipeline's "wire_bytes": the bytes of activations and gradients it sent its neighbours per step}
  {"kind": "eval",  "step", "time", "rank", "host", "eval_loss", "top1", "top5"[, "ema_eval_loss",
   "ema_top1", "ema_top5"]}
  {"kind": "skip",  "step", "time", "rank", "host", "skipped_steps", "in_a_row"}: an fp16 step
   skipped on overflow
  {"kind": "freeze", "step", "time", "rank", "host", "frozen", "stages", "dp", "cache",
   "old_engine_freed", "process_groups"[, "parts", "predicted_ms"]}: --freeze rebuilt the engine
   after `step`; "frozen" layers of the list (a prefix: embedding, then blocks) train no more from
   the next step on, laid out as "stages" pipeline stages x "dp" data-parallel copies, "cache"
   (bool) whether the frozen prefix's outputs are read from a cache instead of computed; a
   pipeline's "parts" (stage boundaries) and, re-planned (--freeze-replan) once the layer times
   were measured (a plan of several stages needs them), "predicted_ms" (its slowest stage per
   micro-batch); "old_engine_freed" (bool) whether the old engine's module was gone before the new
   engine was built, "process_groups" the process groups alive after the rebuild (the same at
   every freeze point)
  {"kind": "freeze_decision", "step", "time", "rank", "host", "frozen", "changes", "norms",
   "threshold"}: every --freeze decision point: the frozen layers after it and each freezable
   layer's measure ("changes": settled's weight move as a share of its largest, or grad's and the
   schedule's relative change of the gradient norm, whose "norms" it also gives; null where
   nothing was measured yet)
"""

import json
import os
import resource
import socket
import sys
import time

import torch

from vit.telemetry.jsonl import open_append


def write_json(path: str, obj) -> None:
    """Write JSON through a temporary file, so a reader never sees half of it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
    os.replace(tmp, path)


def peak_mem_gib(device: torch.device) -> float:
    """Peak accelerator memory of this process, or its peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsLog:
    def __init__(self, log_dir: str, rank: int):
        os.makedirs(log_dir, exist_ok=True)
        self.rank, self.host = rank, socket.gethostname()
        self.file = open_append(os.path.join(log_dir, f"metrics_rank{rank}.jsonl"))

    def write(self, kind: str, step: int, **fields) -> None:
        record = {
            "kind": kind,
            "step": step,
            "time": time.time(),
            "rank": self.rank,
            "host": self.host,
            **fields,
        }
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def log_line(
    step: int,
    total: int,
    loss: float,
    lr: float,
    images_per_s: float,
    step_time_s: float,
    mem_gib: float,
    eta_s: float,
) -> str:
    """Rank 0's line on a logging step; eta: the steps left at this run's mean step time so far."""
    width, eta = len(str(total)), round(eta_s)
    return (
        f"step {step:>{width}}/{total} | loss {loss:.4f} | lr {lr:.2e} | {images_per_s:8.1f} img/s"
        f" | step {step_time_s * 1e3:7.1f} ms | mem {mem_gib:.2f} GiB"
        f" | eta {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}"
    )


def progress(step: int, total: int, width: int = 30) -> None:
    """A one-line progress bar, only when stderr is a terminal."""
    if sys.stderr.isatty():
        done = width * step // total
        sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total}")
        sys.stderr.flush()
        if step == total:
            sys.stderr.write("\n")
