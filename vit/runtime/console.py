"""A quiet console: the libraries' notes and warnings (DeepSpeed's log lines and op-build prints,
torch's and timm's warnings) go into <log-dir>/warnings_rank<R>.log instead of the terminal, with
one line on rank 0 saying where; `--verbose` prints them as they come. Errors always print, and so
does everything of our own."""

import contextlib
import io
import logging
import os
import sys
import time
from typing import NoReturn

# Loggers the libraries write to directly. Records of their children reach the root logger, where
# capture() puts a handler, or torch's own handlers (torch's loggers do not propagate to the root).
LIBRARY_LOGGERS = ("DeepSpeed",)


class Capture(logging.Filter):
    """Keeps what it filters out: in memory until the log dir is known, then in the file."""

    def __init__(self):
        super().__init__()
        self.verbose, self.lines, self.file, self.count, self.installed = True, [], None, 0, False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbose or record.levelno >= logging.ERROR:
            return True
        self.add(f"{record.levelname} [{record.name}] {record.getMessage()}")
        return False

    def add(self, text: str) -> None:
        self.count += 1
        if self.file:
            self.file.write(text.rstrip("\n") + "\n")
            self.file.flush()
        else:
            self.lines.append(text)


CAPTURE = Capture()


def capture(verbose: bool) -> None:
    """From here on, library output is kept off the console unless `verbose`; call it before
    DeepSpeed is imported (it logs at import)."""
    CAPTURE.verbose = verbose
    if CAPTURE.installed:
        return
    CAPTURE.installed = True
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).addFilter(CAPTURE)
    for handler in logging.getLogger("torch").handlers:
        handler.addFilter(CAPTURE)
    # what Python's last-resort handler would print, filtered
    root = logging.StreamHandler(sys.stderr)
    root.setFormatter(logging.Formatter("%(message)s"))
    root.addFilter(CAPTURE)
    logging.getLogger().addHandler(root)
    # warnings.warn goes through the "py.warnings" logger, to that handler
    logging.captureWarnings(True)


def to_file(log_dir: str, rank: int) -> str | None:
    """Once the log dir is agreed: what was kept so far, and everything after, into
    warnings_rank<R>.log."""
    if CAPTURE.verbose:
        return None
    path = os.path.join(log_dir, f"warnings_rank{rank}.log")
    CAPTURE.file = open(path, "a")
    for line in CAPTURE.lines:
        CAPTURE.file.write(line.rstrip("\n") + "\n")
    CAPTURE.file.flush()
    CAPTURE.lines = []
    return path


def aside(text: str) -> None:
    """What a one-line report stands for (its traceback): into the warnings log, or printed with
    --verbose or before the log dir is known."""
    if CAPTURE.file:
        CAPTURE.add(text)
    else:
        sys.stderr.write(text)


def where(path: str | None) -> str | None:
    """Rank 0's one line about the hidden messages, or None when there is nothing to say."""
    if path is None or not CAPTURE.count:
        return None
    return f"library messages: {CAPTURE.count} so far, in {path} (--verbose prints them)"


@contextlib.contextmanager
def library_prints():
    """Around library calls that print() (DeepSpeed's op builds): their output is kept like their
    log lines; if the call fails, what it printed is shown, since it may say why."""
    if CAPTURE.verbose:
        yield
        return
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            yield
    except BaseException:
        sys.stdout.write(out.getvalue())
        raise
    finally:
        for line in out.getvalue().splitlines():
            if line.strip():
                CAPTURE.add(f"PRINT {line}")


def last_words(line: str, status: int, linger_s: float = 0.0) -> NoReturn:
    """Print line on stderr, wait linger_s, and end the process with os._exit(status) (not through
    atexit: DeepSpeed and MPI would wait on ranks that are gone), also when stderr is gone. A
    launcher that exits closes its ranks' pipes; the write's BrokenPipeError would otherwise end the
    thread that was to exit, and leave the rank running on its own (holding its log dir's lock)."""
    to_stderr(line + "\n")
    time.sleep(linger_s)
    os._exit(status)


def to_stderr(text: str) -> None:
    """Write text on stderr, flushed; nothing when stderr is gone (a closed pipe, a closed file)."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
