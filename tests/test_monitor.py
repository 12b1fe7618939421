"""vit/telemetry/monitor.py with its GPU sources replaced at the library boundary: a fake nvidia-smi
on PATH for GPUtil, monkeypatched pynvml functions for NVML; and with no GPU at all."""

import os
import time
from types import SimpleNamespace

import pynvml
import pytest
from helpers import ROOT, read_jsonl

from vit.telemetry.monitor import Monitor, gpu_util_mean_per_host

pytestmark = pytest.mark.timeout(60)
FAKE_BIN = ROOT / "tests" / "fake_bin"
GPU_KEYS = {"index", "name", "util_pct", "mem_used_mib", "mem_total_mib", "temp_c", "power_w"}
RECORD_KEYS = {"time", "host", "rank", "step", "backend", "cpu_percent", "rss_mib", "gpus"}


def no_nvml(monkeypatch):
    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)


@pytest.fixture
def fake_smi(monkeypatch):
    """The fake nvidia-smi first on PATH, and NVML failing as on a machine without the library."""
    monkeypatch.setenv("PATH", f"{FAKE_BIN}:{os.environ['PATH']}")
    no_nvml(monkeypatch)


@pytest.fixture
def fake_nvml(monkeypatch):
    """Two GPUs behind pynvml; the second does not report power, as many consumer cards do not."""
    calls = []
    mib = 2**20

    def power(h):
        if h == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 312_500  # milliwatts

    fakes = {
        "nvmlInit": lambda: calls.append("init"),
        "nvmlShutdown": lambda: calls.append("shutdown"),
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: [b"NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 3060"][h],
        "nvmlDeviceGetUUID": lambda h: ["GPU-11111111-aaaa", b"GPU-22222222-bbbb"][h],
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=[55, 5][h], memory=30),
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(
            total=[24564, 12288][h] * mib, used=[8000, 600][h] * mib, free=0
        ),
        "nvmlDeviceGetTemperature": lambda h, sensor: (
            [66, 40][h] if sensor == pynvml.NVML_TEMPERATURE_GPU else -1
        ),
        "nvmlDeviceGetPowerUsage": power,
    }
    for name, fn in fakes.items():
        monkeypatch.setattr(pynvml, name, fn)
    return calls


def wait_for_records(path, count: int, timeout: float = 20) -> None:
    """Polls rather than sleeps a fixed time: the sampler may be starved on a busy machine."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().count("\n") >= count):  # complete lines only
        assert time.monotonic() < deadline, (
            f"fewer than {count} samples in {path} after {timeout} s"
        )
        time.sleep(0.02)


def run_monitor(tmp_path, backend, rank=3, samples=2, **kw) -> tuple[Monitor, list[dict]]:
    """`samples` samples at step 0, then at least one at step 7."""
    mon = Monitor(str(tmp_path), rank, interval_s=0.05, backend=backend, **kw)
    path = tmp_path / f"monitor_rank{rank}.jsonl"
    mon.start()
    wait_for_records(path, samples)
    mon.step = 7
    wait_for_records(path, samples + 1)
    mon.stop()
    return mon, read_jsonl(path)


def test_gputil_backend_records_nvidia_smi_numbers(tmp_path, fake_smi):
    mon, records = run_monitor(tmp_path, "auto")  # NVML fails, so auto falls back to GPUtil
    assert mon.backend == "gputil" and len(records) >= 3
    for r in records:
        assert (
            set(r) == RECORD_KEYS
            and r["rank"] == 3
            and r["host"] == mon.host
            and r["backend"] == "gputil"
        )
        assert r["cpu_percent"] is None or 0 <= r["cpu_percent"] <= 100
        assert r["rss_mib"] > 10
    assert records[0]["step"] == 0 and records[-1]["step"] == 7
    assert records[-1]["gpus"] == [
        {
            "index": 0,
            "name": "NVIDIA GeForce RTX 3090",
            "util_pct": 87.0,
            "mem_used_mib": 18234.0,
            "mem_total_mib": 24576.0,
            "temp_c": 71.0,
            "power_w": None,
        },
        {
            "index": 1,
            "name": "NVIDIA GeForce RTX 3090",
            "util_pct": 12.0,
            "mem_used_mib": 1024.0,
            "mem_total_mib": 24576.0,
            "temp_c": 45.0,
            "power_w": None,
        },
    ]
    s = mon.summary()
    assert s["samples"] == len(records) and s["backend"] == "gputil" and s["gpus"] == [0, 1]
    assert s["gpu_util_mean"] == pytest.approx(49.5) and s["gpu_mem_used_max_mib"] == 18234.0
    assert s["rss_max_mib"] == max(r["rss_mib"] for r in records)


@pytest.mark.parametrize(
    "wanted", [[1], ["a81c4d07-52e9-4b3f-8f6d-0c9e2a7b3d55"]], ids=["index", "torch uuid"]
)
def test_gputil_only_the_gpus_asked_for(tmp_path, fake_smi, wanted):
    mon, records = run_monitor(tmp_path, "gputil", gpu_indices=wanted, samples=1)
    assert all([g["index"] for g in r["gpus"]] == [1] for r in records)
    assert mon.summary()["gpu_util_mean"] == pytest.approx(12.0) and mon.summary()["gpus"] == [1]


def test_unknown_gpu_uuid_samples_every_gpu(tmp_path, fake_smi, capsys):
    mon, records = run_monitor(
        tmp_path, "gputil", gpu_indices=["GPU-00000000-0000-0000-0000-000000000000"], samples=1
    )
    assert [g["index"] for g in records[-1]["gpus"]] == [0, 1]
    assert "no GPU with UUID GPU-00000000" in capsys.readouterr().out


def test_gputil_query_failing_mid_run_costs_gpu_data_not_the_run(
    tmp_path, monkeypatch, capsys, fake_smi
):
    csv = tmp_path / "smi.csv"
    csv.write_text(
        "0, GPU-1, 50, 8192, 4096, 4096, 550.54.15, NVIDIA GeForce RTX 3070, [N/A], "
        "Disabled, Disabled, "
        "[N/A]\n"
    )
    monkeypatch.setenv("FAKE_NVIDIA_SMI_CSV", str(csv))
    mon = Monitor(str(tmp_path), 0, interval_s=0.05, backend="gputil")
    path = tmp_path / "monitor_rank0.jsonl"
    mon.start()
    wait_for_records(path, 1)
    csv.write_text(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
    )
    wait_for_records(path, len(read_jsonl(path)) + 3)
    mon.stop()
    records = read_jsonl(path)
    # [N/A]
    assert records[0]["gpus"][0]["util_pct"] == 50.0 and records[0]["gpus"][0]["temp_c"] is None
    assert records[-1]["gpus"] == [] and records[-2]["gpus"] == []
    assert capsys.readouterr().out.count("gputil query failed") == 1


def test_nvml_backend_same_schema(tmp_path, fake_nvml, monkeypatch):
    monkeypatch.setenv("PATH", f"{FAKE_BIN}:{os.environ['PATH']}")  # auto must still prefer NVML
    mon, records = run_monitor(tmp_path, "auto", rank=0)
    assert mon.backend == "nvml" and fake_nvml[0] == "init" and fake_nvml[-1] == "shutdown"
    for r in records:
        assert set(r) == RECORD_KEYS and r["backend"] == "nvml"
        assert all(set(g) == GPU_KEYS for g in r["gpus"])
    assert records[-1]["gpus"] == [
        {
            "index": 0,
            "name": "NVIDIA GeForce RTX 4090",
            "util_pct": 55.0,
            "mem_used_mib": 8000.0,
            "mem_total_mib": 24564.0,
            "temp_c": 66.0,
            "power_w": 312.5,
        },
        {
            "index": 1,
            "name": "NVIDIA GeForce RTX 3060",
            "util_pct": 5.0,
            "mem_used_mib": 600.0,
            "mem_total_mib": 12288.0,
            "temp_c": 40.0,
            "power_w": None,
        },
    ]
    s = mon.summary()
    assert s["gpu_util_mean"] == pytest.approx(30.0) and s["gpu_mem_used_max_mib"] == 8000.0
    # The GPU of a rank named by the UUID torch reports (no GPU- prefix), not by CUDA's renumbered
    # index.
    mon, records = run_monitor(
        tmp_path / "one", "nvml", rank=0, samples=1, gpu_indices=["22222222-BBBB"]
    )
    assert [g["index"] for g in records[-1]["gpus"]] == [1] and mon.summary()["gpus"] == [1]


def test_without_gpus_cpu_only_records_and_one_note(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no nvidia-smi
    no_nvml(monkeypatch)
    mon, records = run_monitor(tmp_path, "auto", rank=1)
    assert mon.backend == "none" and len(records) >= 3
    assert all(r["gpus"] == [] and r["backend"] == "none" and r["rss_mib"] > 0 for r in records)
    out = capsys.readouterr().out
    assert out.count("no GPU data") == 1 and out.count("\n") == 1
    s = mon.summary()
    assert (
        s["gpu_util_mean"] is None
        and s["gpu_mem_used_max_mib"] is None
        and s["samples"] == len(records)
    )
    assert s["cpu_percent_mean"] is not None and s["rss_max_mib"] > 0
    # Asked for a backend by name that is not there: the same, not a crash.
    mon, records = run_monitor(tmp_path / "nvml", "nvml", rank=1, samples=1)
    assert mon.backend == "none" and records


def test_off_writes_nothing(tmp_path):
    mon = Monitor(str(tmp_path), 0, interval_s=0)
    mon.start()
    mon.step = 3
    mon.stop()
    assert not list(tmp_path.iterdir())
    assert mon.summary()["samples"] == 0 and mon.summary()["backend"] == "off"


def test_unknown_backend_is_refused(tmp_path):
    with pytest.raises(ValueError, match="monitor backend must be one of auto, nvml, gputil, none"):
        Monitor(str(tmp_path), 0, backend="dcgm")


def test_gpu_util_mean_per_host():
    summaries = [
        {"host": "cn0", "gpu_util_mean": 80.0},
        {"host": "cn0", "gpu_util_mean": 60.0},
        {"host": "cn1", "gpu_util_mean": 10.0},
        {"host": "cpu0", "gpu_util_mean": None},
    ]
    assert gpu_util_mean_per_host(summaries) == {"cn0": 70.0, "cn1": 10.0, "cpu0": None}
