"""Reading the JSON-lines logs (metrics_rank<R>.jsonl, monitor_rank<R>.jsonl): one rule for every reader (plot_logs.py,
the benchmarks, the tests). A torn last line is what a run killed mid-write leaves: it is dropped. A line that
is not JSON anywhere else means the file is not a log of ours: an error naming the file and line."""
import json
from pathlib import Path


class JsonlError(ValueError):
    pass


def read_jsonl(path, on_torn_tail=None) -> list[dict]:
    """The objects of a JSON-lines file, in order; `on_torn_tail(path)` is called when a torn last line is
    dropped."""
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
