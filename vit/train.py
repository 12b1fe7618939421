"""Train a ViT: plan everything, start the process group, build the engine, train, evaluate,
summarise. Run through ./entry_cn.sh (under mpirun, srun, torchrun or directly); `--help` lists the
options."""

import gc

if __name__ == "__main__":
    # A rank: no cyclic garbage collection while torch, timm and DeepSpeed load (they leave 715,000
    # tracked objects, and collecting among them cost a rank 1.5 of its 5.4 CPU-s of imports,
    # docs/benchmarks.md); main() freezes what they left and turns it back on.
    gc.disable()

import os
import signal
import socket
import sys
import threading
import time

import psutil
import torch

from vit.checkpoints import checkpoint
from vit.core.errors import ConfigError, NonFiniteLoss, NothingToDo, OutOfMemory
from vit.engines.registry import planner_inputs
from vit.planner import auto as auto_engine
from vit.planner import fit, oom
from vit.run.cli import PROG, parse
from vit.run.compat import auto_allowed
from vit.run.plan import Plan, cannot_take, make_plan, with_auto_choice, with_micro_batch
from vit.runtime import console, plugins
from vit.runtime.dist_env import (
    device,
    discover,
    end_process_group,
    init_process_group,
)
from vit.runtime.faults import Watchdog, announce_failure
from vit.trainer import build_trainer, finish, loop

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def prepare_environment() -> None:
    """Before DeepSpeed is imported: where it builds its ops, and with which ninja."""
    # DeepSpeed JIT-builds small ops (the CPU shared-memory comm op, CPU Adam) into this cache. Its
    # key includes the interpreter's path, so two environments sharing one cache rebuild each
    # other's ops.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    # torch builds them with the first `ninja` on PATH. The venv's ninja (pip) and the system's
    # write .ninja_log hashes the other cannot read: with and without the venv on PATH, each run
    # rebuilt the op (a minute of CPU); the venv's.
    bin_dir = os.path.dirname(sys.executable)
    if os.path.isfile(os.path.join(bin_dir, "ninja")) and not os.environ.get("PATH", "").startswith(
        bin_dir
    ):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def train(plan: Plan, start_time: float, watchdog: Watchdog, stop: "StopOnSignal") -> None:
    run = build_trainer(plan, watchdog, charts=tracker_charts)
    stop.save_dir = run.checkpointer.save_dir if run.checkpointer.enabled else None
    loop(plan, run, watchdog)
    finish(plan, run, start_time)


def tracker_charts(log_dir: str) -> list:
    """The run's charts for the trackers (matplotlib is imported only by a run that reports to
    one)."""
    from vit.reports.charts import for_trackers

    return for_trackers(log_dir)


def choose_engine(plan: Plan, dev: torch.device) -> dict:
    """--engine auto: vit.planner.auto's choice for this run (collective)."""
    s = plan.settings
    return auto_engine.choose(
        plan.job,
        dev,
        plan.fresh_layers(s.model.drop_path),
        plan.sample,
        plan.likely_precision(dev),
        s.parallel.engine,
        auto_engine.Request(
            batch=plan.batch,
            inputs=planner_inputs(s.flat()),
            allowed=auto_allowed(s),
            cannot_take=cannot_take(plan) if plan.resume else None,  # a resume on a changed cluster
        ),
        plan.slowdowns.get(plan.job.rank, 1.0),
    )


def fit_micro_batch(plan: Plan, dev: torch.device) -> tuple[int, list[int] | None, dict]:
    """--micro-batch-size auto: vit.planner.fit's search for this run (collective)."""
    precision, batch = plan.likely_precision(dev), plan.batch
    return fit.fit_micro_batch(
        plan.job,
        dev,
        precision,
        upper=len(plan.data.train) // (batch.dp_size * batch.grad_accum),
        dp_size=batch.dp_size,
        proportional=plan.settings.parallel.batch_split == "proportional",
        memory=plan.memory,
        layers=plan.fresh_layers,
        sample=plan.data.train[0][0],
    )


def out_of_memory(plan: Plan, dev: torch.device, step: int, error: Exception) -> OutOfMemory:
    """An out-of-memory error on this rank as one message (vit.planner.oom), with what this run
    would fit."""

    def estimated():
        return oom.estimate(
            dev, plan.job.local_world_size, plan.memory, plan.fresh_layers, plan.sample
        )

    return oom.out_of_memory(error, dev, step, plan.batch, estimated)


class StopOnSignal:
    """Ctrl-C (SIGINT), SIGTERM, and SIGUSR1 (what scripts/mpirun sends the ranks for a Ctrl-C:
    Open MPI kills them on SIGINT and drops their output) end the run at once: one line on rank 0
    naming the step and the checkpoint --resume goes on from, exit 130. The other ranks wait two
    seconds first, so that rank 0's line is out before the launcher, seeing them end, stops
    forwarding output. No collective: every rank is stopping.

    A thread of its own stops the run: Python's C-level handler, in whichever thread the kernel
    picks, writes the signal's number to a pipe (signal.set_wakeup_fd) that the thread reads. A
    Python handler runs only between the main thread's bytecodes, and a main thread in a collective
    waiting for a rank that was stopping said nothing before the launcher ended it (seen in CI:
    rank 1's exit 130 came first)."""

    def __init__(self, plan: Plan):
        self.plan, self.watchdog = plan, None  # the watchdog once the process group is up
        self.save_dir: str | None = None  # where the checkpoints are, once the trainer is built

    def install(self) -> None:
        self.handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
        for signum in STOP_SIGNALS:
            signal.signal(signum, lambda signum, frame: None)  # the pipe says it
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self.wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self.write_fd = write_fd
        self.thread = threading.Thread(target=self.wait, name="stop-on-signal", daemon=True)
        self.thread.start()

    def uninstall(self) -> None:
        """The process's signals as they were before install(): run() has ended, and a process
        that goes on (a test that calls it) would otherwise keep them."""
        signal.set_wakeup_fd(self.wakeup)
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        os.close(self.write_fd)  # the thread reads the end of the pipe and returns
        self.thread.join(timeout=5)

    def wait(self) -> None:
        while got := os.read(self.read_fd, 1):  # empty: uninstall() closed the pipe
            if got[0] in STOP_SIGNALS:  # another Python handler's signal is written there too
                self.stop(got[0], None)
        os.close(self.read_fd)

    def stop(self, signum, frame) -> None:
        if not self.plan.job.is_main:
            time.sleep(2.0)
            os._exit(130)
        console.last_words(f"{PROG}: {self.where(signum)}", 130)

    def where(self, signum: int) -> str:
        """Ctrl-C (SIGINT, or SIGUSR1 from scripts/mpirun) interrupts; a SIGTERM is the launcher
        ending the job (a rank failed or was killed, a second Ctrl-C) or another process's."""
        how = "stopped by SIGTERM" if signum == signal.SIGTERM else "interrupted"
        step, save_dir = self.watchdog.step if self.watchdog else 0, self.save_dir
        if save_dir is None and not step:
            return f"{how} before training"
        tags = checkpoint.complete_tags(save_dir) if save_dir and os.path.isdir(save_dir) else []
        resume = (
            f"--resume goes on from {save_dir}/{tags[0]}"
            if tags
            else "no complete checkpoint yet: the run starts over"
        )
        return f"{how} at step {step}; {resume}"


def run(plan: Plan, start_time: float) -> int:
    """Train; any failure on any rank ends every rank, non-zero, naming the rank that failed."""
    stop = StopOnSignal(plan)
    stop.install()
    try:
        return run_until_stopped(plan, start_time, stop)
    finally:
        stop.uninstall()


def run_until_stopped(plan: Plan, start_time: float, stop: StopOnSignal) -> int:
    try:  # every rank reaches the same verdict on the job's devices, so each stops alike
        init_process_group(
            plan.job,
            plan.settings.cluster.dist_timeout,
            plan.settings.cluster.device,
            plan.requested_precision,
            plan.engine,
        )
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return e.exit_status
    except RuntimeError as e:  # a full GPU: NCCL's communicators did not fit
        if not oom.is_oom(e):
            raise
        print(
            f"rank {plan.job.rank} ({socket.gethostname()}) failed at start: "
            f"{oom.nccl_out_of_memory(device(plan.job), e)}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    watchdog = Watchdog(plan.job.rank, plan.settings.cluster.dist_timeout)
    watchdog.start()
    stop.watchdog = watchdog
    plugins.call("start", plan.job.rank, watchdog)
    try:
        if plan.auto == {}:  # --engine auto, to choose (a resumed one has chosen)
            plan = with_auto_choice(plan, choose_engine(plan, device(plan.job)))
        if plan.settings.parallel.micro_batch_size == "auto":
            plan = with_micro_batch(plan, *fit_micro_batch(plan, device(plan.job)))
        train(plan, start_time, watchdog, stop)
    except NothingToDo as e:  # decided on rank 0 before anything was written
        if plan.job.is_main:
            print(f"{PROG}: {e}", flush=True)
    except Exception as e:
        if oom.is_oom(e):
            e = out_of_memory(plan, device(plan.job), watchdog.step, e)
        # a collective finding (preflight, census, lock): the same on every rank
        if isinstance(e, ConfigError):
            announce_failure(f"rank {plan.job.rank} ({socket.gethostname()}): {e}")
            console.last_words(f"{PROG}: error: {e}", e.exit_status)
        # os._exit, not through atexit: DeepSpeed and MPI would wait on the ranks that are gone
        watchdog.fail(
            e, explained=isinstance(e, (NonFiniteLoss, OutOfMemory, checkpoint.CheckpointError))
        )
    watchdog.stop()
    end_process_group()
    return 0


SAY_ONCE_S = 10.0  # how long the other ranks leave rank 0 to say a usage error first


def launcher_rank() -> int | None:
    """This process's rank as its launcher says, None where the variables do not say it."""
    try:
        return discover().rank
    except ConfigError:
        return None


def main(argv=None) -> int:
    prepare_environment()
    # what exists now lives on: each --freeze rebuild's full collection skips it (300 ms -> 70 ms,
    # CPU)
    gc.freeze()
    gc.enable()
    start_time = psutil.Process().create_time()  # wall time includes the imports
    try:
        settings = parse(argv)
    except ConfigError as e:
        # the same arguments on every rank give the same error: rank 0 says it, the others exit
        # after it (mpirun ends the job at the first rank to fail, and adds its box)
        if launcher_rank() in (0, None):
            print(f"{PROG}: error: {e}", file=sys.stderr)
        else:
            time.sleep(SAY_ONCE_S)
        return 2
    try:
        console.capture(settings.log.verbose)  # before DeepSpeed is imported
        plugins.load()  # VIT_PLUGINS: the tests' fault injection
        plan = make_plan(settings, discover())
    except NothingToDo as e:
        print(f"{PROG}: {e}", flush=True)
        return 0
    except ConfigError as e:  # exit 3 where the checkpoint cannot go on on these ranks
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.exit_status
    return run(plan, start_time)


if __name__ == "__main__":
    sys.exit(main())
