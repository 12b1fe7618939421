"""Per-step statistics, kept without host syncs and written on logging steps: the timing windows,
the step-time breakdown, fp16 skipped steps and the non-finite-loss check. Time spent evaluating or
saving is kept out."""

import contextlib
import sys
import time
from dataclasses import dataclass

import torch

from vit.core.errors import NonFiniteLoss
from vit.runtime.gpu import wait_for_queued
from vit.telemetry.metrics import log_line, peak_mem_gib, progress


class PhaseTimer:
    """Seconds spent per phase of the training steps since the last read.

    CUDA events on a GPU, read only when asked (on logging steps, after the loss already
    synchronised), so timing adds no host sync to the step; the wall clock on a CPU. Laps taken
    while paused count nowhere.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = {}
        self.pending: list = []  # (phase, start event, end event) not yet read
        self.mark = None
        self.active = True

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        if self.active:
            self.mark = self._now()

    def lap(self, phase: str) -> None:
        """The time since the last start or lap belongs to `phase`."""
        if not self.active:
            return
        now = self._now()
        if self.cuda:
            self.pending.append((phase, self.mark, now))
        else:
            self.totals[phase] = self.totals.get(phase, 0.0) + now - self.mark
        self.mark = now

    @contextlib.contextmanager
    def paused(self):
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def read(self, steps: int) -> dict[str, float]:
        """Mean seconds per step of each phase since the last read; starts over."""
        if self.pending:
            self.pending[-1][2].synchronize()
            for phase, a, b in self.pending:
                self.totals[phase] = self.totals.get(phase, 0.0) + a.elapsed_time(b) / 1e3
        out = {phase: total / steps for phase, total in self.totals.items()}
        self.totals, self.pending = {}, []
        return out


@dataclass(frozen=True)
class StepImages:
    """The images one step trains, before the engine's trained_share(): the job's (the global
    batch) and this rank's."""

    job: int
    rank: int


class StepStats:
    """stats.record(engine, step, loss, lr) after every step; `if stats.should_log(step):
    stats.log(engine, step)`; evaluation and saving inside `with stats.paused():`; stats.totals()
    for the summary. The engine is passed at each call, so a rebuilt one (--freeze) is simply the
    next one passed."""

    def __init__(
        self,
        engine,
        metrics,
        *,
        images: StepImages,
        total_steps: int,
        log_interval: int,
        max_skipped_steps: int | None,
        is_main: bool,
        earlier: dict | None = None,
    ):
        """max_skipped_steps: in fp16, the overflow-skipped steps in a row that stop the run past
        them; None in another precision. earlier: the training time and segments recorded in the
        checkpoint a resumed run starts from."""
        self.device, self.metrics, self.is_main = engine.device, metrics, is_main
        # images per step, times the engine's trained_share() at each step
        self.global_batch, self.rank_images = images.job, images.rank
        self.images = 0.0  # trained in this run
        self.total_steps, self.log_interval, self.max_skipped = (
            total_steps,
            log_interval,
            max_skipped_steps,
        )
        # fp16 overflows are the loss scaler's to skip; any other non-finite loss stops the run. The
        # first bad step is kept on the device and read on logging steps, to add no host sync per
        # step.
        self.check_finite = max_skipped_steps is None
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=engine.device)
        first = engine.scaler(logging=True) if not self.check_finite else None
        self.skipped_before = first.skipped if first else 0  # a resumed run's, before
        self.scaler = first  # the loss scaler's last statistic (ScalerStats), for the log record
        self.loss, self.lr, self.last_loss = None, None, float("nan")
        self.steps_done, self.phase_totals = 0, {}
        self.train_s = 0.0  # wall time of the steps alone
        self.earlier, self.paused_at = {"train_s": 0.0, "segments": 0, **(earlier or {})}, None
        self.window_steps, self.window_start, self.window_excluded = 0, time.perf_counter(), 0.0
        self.window_images = (0.0, 0.0)  # the job's, this rank's, since the last log

    def record(self, engine, step: int, loss: torch.Tensor, lr: float) -> None:
        self.loss, self.lr = loss, lr
        self.window_steps += 1
        self.steps_done += 1
        share, mine = engine.trained_share()
        job, rank = self.window_images
        self.window_images = (job + self.global_batch * share, rank + self.rank_images * mine)
        self.images += self.global_batch * share
        if self.check_finite:
            bad = (self.first_bad_step == 0) & ~torch.isfinite(loss.to(self.first_bad_step.device))
            self.first_bad_step.masked_fill_(bad, step)
        elif (stats := engine.scaler(logging=self.should_log(step))) is not None:
            self.scaler = stats
            self._report_skips(step, stats.skipped, stats.in_a_row, stats.longest)
        if self.is_main:
            progress(step, self.total_steps)

    def _report_skips(self, step: int, skipped: int, in_a_row: int, longest: int) -> None:
        """A skip record when steps were skipped since the last statistic: every step for an engine
        that counts skips on the host (DeepSpeed), on logging steps for one that counts them on the
        device (DDP)."""
        if skipped > self.skipped_before:
            self.metrics.write("skip", step, skipped_steps=skipped, in_a_row=in_a_row)
            if self.is_main:
                print(
                    f"step {step}: fp16 gradients overflowed, step skipped ({skipped} so far)",
                    flush=True,
                )
        self.skipped_before = skipped
        if longest > self.max_skipped:
            raise NonFiniteLoss(
                f"fp16: {longest} overflow-skipped steps in a row up to step {step}; "
                "lower initial_scale_power in the DeepSpeed config or use bf16"
            )

    def should_log(self, step: int) -> bool:
        return step % self.log_interval == 0 or step == self.total_steps

    def log(self, engine, step: int) -> None:
        """The step-time window since the last log: one metrics record, and rank 0's line."""
        # The only host sync and the only collective of our own per step, on logging steps only.
        self.last_loss = engine.mean_loss(self.loss).item()
        if self.check_finite and self.first_bad_step.item():
            raise NonFiniteLoss(
                f"the loss became non-finite at step {self.first_bad_step.item()} (now "
                f"{self.last_loss}); lower --lr, or resume from an earlier checkpoint"
            )
        window_s = time.perf_counter() - self.window_start - self.window_excluded
        self.train_s += window_s
        step_time = window_s / self.window_steps
        images_per_s, mem = self.window_images[0] / window_s, peak_mem_gib(self.device)
        phases = engine.breakdown(self.window_steps)
        for phase, seconds in phases.items():
            self.phase_totals[phase] = (
                self.phase_totals.get(phase, 0.0) + seconds * self.window_steps
            )
        self.metrics.write(
            "train",
            step,
            loss=self.last_loss,
            lr=float(self.lr),
            images_per_s=images_per_s,
            step_time_s=step_time,
            mem_gib=mem,
            rank_images_per_s=self.window_images[1] / window_s,
            skipped_steps=self.scaler.skipped if self.scaler else 0,
            loss_scale=self.scaler.scale if self.scaler else None,
            **phases,
        )
        if self.is_main:
            if sys.stderr.isatty():
                sys.stderr.write("\r")
            eta = (self.total_steps - step) * self.train_s / self.steps_done
            line = log_line(
                step,
                self.total_steps,
                self.last_loss,
                float(self.lr),
                images_per_s,
                step_time,
                mem,
                eta,
            )
            print(line, flush=True)
        self.window_steps, self.window_start, self.window_excluded = 0, time.perf_counter(), 0.0
        self.window_images = (0.0, 0.0)  # the job's, this rank's, since the last log

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (evaluation, checkpoints) counts in no step time, images/s or
        breakdown. The steps' work still queued on the GPU is waited for first, so that it counts as
        training."""
        wait_for_queued(self.device)
        start = self.paused_at = time.perf_counter()
        try:
            yield
        finally:
            self.window_excluded += time.perf_counter() - start
            self.paused_at = None

    def train_time(self) -> dict:
        """The run's training time over its segments (the first run and each resume) up to the last
        step done: the earlier segments' from the checkpoint resumed, plus this one's, the steps not
        logged yet included."""
        pending = (
            self.paused_at - self.window_start - self.window_excluded
            if self.window_steps and self.paused_at
            else 0.0
        )
        return {
            "train_s": self.earlier["train_s"] + self.train_s + pending,
            "segments": self.earlier["segments"] + 1,
        }

    def totals(self) -> dict:
        """For the summary: the steps' wall time (over every segment of a resumed run, and this
        one's), this run's images/s and mean breakdown per step."""
        steps, run = self.steps_done, self.train_time()
        return {
            "train_s": run["train_s"],
            "train_s_this_run": self.train_s,
            "segments": run["segments"],
            "final_loss": self.last_loss,
            "images_per_s": self.images / self.train_s if steps and self.train_s else None,
            "breakdown": {k: v / max(1, steps) for k, v in self.phase_totals.items()},
        }
