"""Reading the JSON-lines logs (metrics_rank<R>.jsonl, monitor_rank<R>.jsonl): one rule for every
reader (plot_logs.py, the benchmarks, the tests). A torn last line is what a run killed mid-write
leaves: it is dropped. A line that is not JSON anywhere else means the file is not a log of ours: an
error naming the file and line.

Writers append through open_append, which cuts such a torn line first: a resumed run's records then
start on a line of their own instead of turning the torn line into a bad middle line."""

import json
import os
import sys
from pathlib import Path


class JsonlError(ValueError):
    pass


def read_jsonl(path, on_torn_tail=None) -> list[dict]:
    """The objects of a JSON-lines file, in order; `on_torn_tail(path)` is called when a torn last
    line is dropped."""
    lines = Path(path).read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                if on_torn_tail:
                    on_torn_tail(path)
                continue
            raise JsonlError(f"{path}:{i + 1}: not a JSON line") from None
        if isinstance(record, dict):
            records.append(record)
    return records


def _last_line_start(f, size: int) -> int:
    """Offset of the last line of a file open in binary mode: just after its last newline, 0 without
    one."""
    end = size
    while end > 0:
        start = max(0, end - (1 << 16))
        f.seek(start)
        newline = f.read(end - start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def open_append(path):
    """Open a JSON-lines log for appending (text mode, created if missing). A last line without its
    newline is ended when it is a whole record, and cut, with a note, when it is torn."""
    with open(path, "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        start = _last_line_start(f, size)
        if start < size:
            f.seek(start)
            try:
                json.loads(f.read())
                f.write(b"\n")
            except ValueError:
                f.truncate(start)
                print(
                    f"note: {path}: cut a torn last line ({size - start} "
                    "bytes) left by an interrupted run",
                    file=sys.stderr,
                    flush=True,
                )
    return open(path, "a")
