"""The JSON-lines logs after a run killed mid-write (in-process): the metrics and monitor writers
both start appending on a line of their own (vit.telemetry.jsonl.open_append), so the reader sees
every record, old and new."""

import json

import pytest

from vit.telemetry.jsonl import read_jsonl
from vit.telemetry.metrics import MetricsLog
from vit.telemetry.monitor import Monitor

GOOD = [{"kind": "train", "step": 1}, {"kind": "train", "step": 2}]


def write_metrics(log_dir):
    log = MetricsLog(str(log_dir), 0)
    log.write("train", 3, loss=1.0)
    log.close()
    return log_dir / "metrics_rank0.jsonl"


def write_monitor(log_dir):
    mon = Monitor(str(log_dir), 0, interval_s=60, backend="none")
    mon.start()
    mon.stop()  # one sample at the stop
    return log_dir / "monitor_rank0.jsonl"


@pytest.mark.parametrize(
    "writer,name",
    [(write_metrics, "metrics_rank0.jsonl"), (write_monitor, "monitor_rank0.jsonl")],
    ids=["metrics", "monitor"],
)
@pytest.mark.parametrize(
    "tail,kept",
    [
        ('{"kind": "train", "step": 3, "lo', 2),  # torn: cut
        ('{"kind": "train", "step": 3}', 3),  # a whole record whose newline was not written: kept
        ("", 2),  # nothing torn
    ],
    ids=["torn", "no newline", "clean"],
)
def test_resumed_writer_starts_on_a_fresh_line(tmp_path, capsys, writer, name, tail, kept):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in GOOD) + tail)
    writer(tmp_path)
    torn = []
    records = read_jsonl(path, on_torn_tail=torn.append)
    assert not torn and len(records) == kept + 1, path.read_text()
    assert records[:2] == GOOD and path.read_text().endswith("}\n")
    assert ("cut a torn last line" in capsys.readouterr().err) == (kept == 2 and tail != "")


def test_a_file_that_is_only_a_torn_line(tmp_path):
    path = tmp_path / "metrics_rank0.jsonl"
    path.write_text('{"kind": "tr')
    write_metrics(tmp_path)
    assert [r["step"] for r in read_jsonl(path)] == [3]
