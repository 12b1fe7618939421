"""What the tests share: real ranks (N processes of `python -m vit.train`, torchrun-style variables,
a free port, a hard timeout, every rank killed as soon as one fails or time runs out), commands with
a hard timeout, and readers of the run logs.

Every test that starts a process must carry @pytest.mark.ranks (conftest.py sets
CURRENT_TEST_STARTS_PROCESSES), so that `pytest -m "not ranks"` stays a quick, in-process run."""

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from vit.runtime.dist_env import free_port
from vit.telemetry.jsonl import read_jsonl  # noqa: F401  (the one reader of our logs, for the tests too)

ROOT = Path(__file__).resolve().parent.parent
MPIRUN = [str(ROOT / "scripts" / "mpirun"), "--oversubscribe"]
PLUGINS = ROOT / "tests" / "plugins"


# Set per test by conftest.py: True under @pytest.mark.ranks, False without, None outside a test.
CURRENT_TEST_STARTS_PROCESSES = None
# The process groups started for the current test; conftest.py kills what is left of them when it
# ends, so a test that fails (or times out) before its own cleanup leaves no rank training on into
# the next tests.
STARTED: list[subprocess.Popen] = []


def stop_group(p: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End a process started in a session of its own, and what it started: SIGTERM first, which
    scripts/mpirun passes on to Open MPI (in a session of its own, out of this group's reach), then
    SIGKILL for what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def kill_leftovers() -> None:
    for p in STARTED:
        if p.poll() is None:
            stop_group(p)
            p.wait()
    STARTED.clear()


def require_ranks_mark() -> None:
    if CURRENT_TEST_STARTS_PROCESSES is False:
        pytest.fail("this test starts processes: mark it @pytest.mark.ranks")


def base_env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
        and k != "MASTER_PORT"
    }
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def plugin_env(**settings: str) -> dict:
    """The variables that make a run import tests/plugins/NAME.py (vit.runtime.plugins) for each
    NAME=value given, with VIT_TEST_NAME=value, the plugin's setting:
    plugin_env(crash_in_save="step4")."""
    return {
        "VIT_PLUGINS": ",".join(settings),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{PLUGINS}",
        **{f"VIT_TEST_{name.upper()}": value for name, value in settings.items()},
    }


class Result:
    def __init__(self, returncodes, outputs):
        self.returncodes, self.outputs = returncodes, outputs

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)

    def __repr__(self):
        return "\n".join(
            f"--- rank {r} exit {rc}\n{out[-4000:]}"
            for r, (rc, out) in enumerate(zip(self.returncodes, self.outputs))
        )


def _wait_all(procs, timeout: float) -> list:
    """Wait for every process; on the first failure give the others 20 s, then kill the lot."""
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > 20):
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    return [p.wait() for p in procs]


class Ranks:
    """`nprocs` ranks of vit.train on this machine (gloo), torchrun-style variables, output in temp
    files."""

    def __init__(self, args, nprocs: int = 2, env=None, rank_env=None):
        require_ranks_mark()
        port = free_port()
        self.procs, self.logs = [], []
        for rank in range(nprocs):
            log = tempfile.TemporaryFile("w+")
            e = base_env(
                RANK=str(rank),
                WORLD_SIZE=str(nprocs),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(nprocs),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                **(env or {}),
                **(rank_env or {}).get(rank, {}),
            )
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "vit.train", *map(str, args)],
                    cwd=ROOT,
                    env=e,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            STARTED.append(self.procs[-1])
            self.logs.append(log)

    def wait(self, timeout: float) -> Result:
        rcs = _wait_all(self.procs, timeout)
        outs = []
        for log in self.logs:
            log.seek(0)
            outs.append(log.read())
            log.close()
        return Result(rcs, outs)


def launch(args, nprocs: int = 2, timeout: float = 240, env=None, rank_env=None) -> Result:
    """Start `nprocs` ranks and wait for them, at most `timeout` seconds; rank_env: {rank: {VAR:
    value}}."""
    return Ranks(args, nprocs, env, rank_env).wait(timeout)


def wait_for(predicate, timeout: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def last_step(log_dir, rank: int) -> int:
    path = Path(log_dir) / f"metrics_rank{rank}.jsonl"
    if not path.exists():
        return 0
    steps = [r["step"] for r in read_jsonl(path) if r["kind"] == "train"]
    return max(steps, default=0)


def mpi_rank_process(marker, rank: int):
    """The running `vit.train` process whose command line holds `marker` (a log dir) and whose Open
    MPI rank is `rank`, as a psutil.Process; None when there is none."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        try:
            cmdline = " ".join(p.info["cmdline"] or [])
            if (
                "vit.train" in cmdline
                and str(marker) in cmdline
                and p.environ().get("OMPI_COMM_WORLD_RANK") == str(rank)
            ):
                return p
        except psutil.Error:  # gone, or not ours to read
            continue
    return None


def as_a_terminal_starts_it() -> None:
    """In the child: Ctrl-C neither ignored nor blocked, as in a terminal's foreground job. A suite
    started as a script's background job has SIGINT ignored, and bash cannot trap a signal ignored
    on entry: a Ctrl-C test would wait for the command's end (a fresh clone's `.ci/run` under
    nohup: 60 s, then failed)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def start_group(
    cmd, env=None, cwd=ROOT, terminal: bool = False, log=None, stderr=None
) -> subprocess.Popen:
    """Start a command in a process group of its own (text pipes, or stdout and stderr into the open
    file `log`, or stderr as given), killed with what is left when the test ends; `terminal`: with
    Ctrl-C as a terminal leaves it (as_a_terminal_starts_it)."""
    require_ranks_mark()
    p = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env or base_env(),
        stdout=log or subprocess.PIPE,
        stderr=stderr or (subprocess.STDOUT if log else subprocess.PIPE),
        text=True,
        start_new_session=True,
        preexec_fn=as_a_terminal_starts_it if terminal else None,
    )
    STARTED.append(p)
    return p


@contextlib.contextmanager
def running(cmd, log_path, env=None, terminal: bool = False):
    """For a test that acts on a command while it runs: start_group with its output in the file
    log_path (a pipe nobody reads would fill and stall a long run), and what is left of it stopped
    when the block ends."""
    with open(log_path, "w") as log:
        p = start_group(cmd, env, terminal=terminal, log=log)
        try:
            yield p
        finally:
            if p.poll() is None:
                stop_group(p)


def gloo_pair(script: str, store, *args, timeout: float = 100) -> list[str]:
    """`python -c script RANK STORE ARGS...` as ranks 0 and 1 (the script joins a gloo group of 2
    through file://STORE); each rank's ARGS may be a function of its rank. Their stdouts."""
    procs = [
        start_group(
            [sys.executable, "-c", script, r, store, *(a(r) if callable(a) else a for a in args)]
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    return [out for out, _ in outs]


def run_cmd(cmd, timeout: float = 240, env=None, cwd=ROOT) -> subprocess.CompletedProcess:
    """Run a command in its own process group; kill the whole group on timeout."""
    p = start_group(cmd, env, cwd)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(p)
        out, err = p.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} hung for {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def plan_in_process(monkeypatch, argv, world_size: int = 1):
    """What `vit.train ARGV` plans before any process group starts, in this process: its settings
    (vit.run.cli.parse) and plan (vit.run.plan.make_plan) as rank 0 of `world_size` ranks,
    with rank 0's address given as a launcher gives it. A ConfigError here is what the run reports
    in one line with exit 2 (vit.train.main)."""
    from vit.run.cli import parse
    from vit.run.plan import make_plan
    from vit.runtime.dist_env import Job

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "9")
    launcher = "single" if world_size == 1 else "torchrun"
    return make_plan(parse([str(a) for a in argv]), Job(0, world_size, 0, world_size, launcher))


def train_losses(log_dir, rank: int = 0) -> dict[int, float]:
    return {
        r["step"]: r["loss"]
        for r in read_jsonl(Path(log_dir) / f"metrics_rank{rank}.jsonl")
        if r["kind"] == "train"
    }


def assert_losses(got: dict[int, float], want: list[float], steps, rel: float = 2e-4) -> None:
    """`got` (train_losses) holds the losses of `steps`, in order, each want's (want[0]: step 1's)
    within `rel`."""
    assert list(got) == list(steps)
    for step in steps:
        assert got[step] == pytest.approx(want[step - 1], rel=rel), (step, got, want)
