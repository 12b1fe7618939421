"""Output folders: checked before any process group starts, and held by one run at a time.

A run's log dir (and a separate save dir) carries a `.lock` file locked with POSIX record locks
(fcntl.lockf, which NFS also honours) for the run's lifetime; the kernel releases it on any exit, a
kill included. The file says which host and pid hold it, so a second run can name them."""

import fcntl
import os
import socket
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from vit.checkpoints import checkpoint
from vit.core.errors import ConfigError
from vit.core.paths import ROOT
from vit.runtime.dist_env import rank0_decides

LOCK_FILE = ".lock"


def check_writable(path: str, option: str, named: str | None = None) -> None:
    """`path` is, or can become, a folder this process can write: one line naming the problem
    otherwise (the line begins with `named`, by default `option path`). Creates nothing that stays.
    """
    name = named or f"{option} {path}"
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{name} is a file, not a folder")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{name}: {existing} is a file, not a folder")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise ConfigError(f"{name}: {existing} is on a read-only file system")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{name}: {existing} is not writable by this user")
    try:  # what the permissions do not tell: /proc, for one, takes no new files, even from root
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"{name}: no file can be created in {existing} ({e.strerror})") from None


def check_export(path: str) -> None:
    """--export PATH: a file (and PATH.json beside it) that this process can write."""
    for target in (path, f"{path}.json"):
        if target.endswith(os.sep) or Path(target).is_dir():
            raise ConfigError(
                f"--export {path}: {target} is a folder; name the file to write, e.g. "
                f"{os.path.join(path, 'model.safetensors')}"
            )
    parent = os.path.dirname(os.path.abspath(path))
    check_writable(parent, "--export", named=f"--export {path}: {parent}")


def check_unused(log_dir: str | None, save_dir: str | None) -> None:
    """A run that does not resume must not mix its records and checkpoints with another run's: it
    refuses a log dir with summary.json (a finished run) or a complete checkpoint, and a save dir
    with a complete checkpoint (--resume would pick it over this run's). A folder that holds only
    the records of a run that ended before its first checkpoint, with nothing to resume from, is
    taken: that run starts over (as scripts/retry.sh does)."""
    if log_dir:
        held = ["summary.json"] if Path(log_dir, "summary.json").is_file() else []
        tags = checkpoint.complete_tags(Path(log_dir, "checkpoints"))
        held += [f"checkpoints {', '.join(tags)}"] if tags else []
        if held:
            how = "continue it with --resume, or" if tags else "the run is finished:"
            raise ConfigError(
                f"--log-dir {log_dir} already holds a run ({'; '.join(held)}); "
                f"{how} use another --log-dir"
            )
    if save_dir and (tags := checkpoint.complete_tags(save_dir)):
        raise ConfigError(
            f"--save-dir {save_dir} already holds a run's checkpoints ({', '.join(tags)}); "
            "continue it with --resume, or use another --save-dir"
        )


class RunLock:
    """lock = RunLock(folder) holds folder/.lock until the process ends; ConfigError names the
    holder."""

    def __init__(self, folder: str, option: str):
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, LOCK_FILE)
        self.file = open(path, "a+")
        try:
            fcntl.lockf(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.seek(0)
            holder = self.file.read().strip() or "unknown"
            self.file.close()
            raise ConfigError(
                f"{option} {folder} is in use by another run ({holder}); "
                f"wait for it to end, or use another {option}"
            ) from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(
            f"pid {os.getpid()} on {socket.gethostname()}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        )
        self.file.flush()


def agree_log_dir(log_dir: str | None, engine: str) -> str:
    """The run folder: --log-dir, else logs/<engine>-<time>, whose time is rank 0's clock, so it is
    broadcast (a collective)."""
    name = [log_dir or os.path.join(ROOT, "logs", f"{engine}-{time.strftime('%Y%m%d-%H%M%S')}")]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def lock_run_dirs(log_dir: str, save_dir: str, no_save: bool) -> list[RunLock]:
    """Rank 0 holds the log dir (and a save dir outside it) for the run's lifetime; every rank stops
    alike when another run holds one."""
    locks = []

    def take():
        locks.append(RunLock(log_dir, "--log-dir"))
        if not no_save and not os.path.realpath(save_dir).startswith(
            os.path.realpath(log_dir) + os.sep
        ):
            locks.append(RunLock(save_dir, "--save-dir"))

    rank0_decides(take)
    return locks
