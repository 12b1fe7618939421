"""A background thread per rank that samples this host's GPUs, CPU and the process's memory at a
fixed interval into <log-dir>/monitor_rank<R>.jsonl; monitoring never stops a training run.

One record per sample (readers ignore unknown fields):
  {"time", "host", "rank", "step", "backend", "cpu_percent", "rss_mib",
   "gpus": [{"index", "name", "util_pct", "mem_used_mib", "mem_total_mib", "temp_c", "power_w"}]}
"gpus" is [] without a GPU backend; "temp_c" and "power_w" are null where the backend cannot tell
(GPUtil never reports power); "cpu_percent" (host-wide, since the previous sample) is null for a
sample taken within 50 ms of the previous one.
"""

import contextlib
import json
import os
import socket
import threading
import time

import psutil

from vit.telemetry.jsonl import open_append

BACKENDS = ("auto", "nvml", "gputil", "none")


class NvmlBackend:
    name = "nvml"

    def __init__(self):
        import pynvml  # nvidia-ml-py

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.count = pynvml.nvmlDeviceGetCount()

    def indices(self) -> list[int]:
        return list(range(self.count))

    def uuids(self) -> dict[str, int]:
        names = [
            self.nvml.nvmlDeviceGetUUID(self.nvml.nvmlDeviceGetHandleByIndex(i))
            for i in range(self.count)
        ]
        return {_uuid(n.decode() if isinstance(n, bytes) else n): i for i, n in enumerate(names)}

    def read(self, indices) -> list[dict]:
        nv, gpus = self.nvml, []
        for i in indices:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            name = nv.nvmlDeviceGetName(h)
            gpus.append(
                {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "util_pct": float(nv.nvmlDeviceGetUtilizationRates(h).gpu),
                    "mem_used_mib": mem.used / 2**20,
                    "mem_total_mib": mem.total / 2**20,
                    "temp_c": self._optional(
                        lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
                    ),
                    "power_w": self._optional(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000),
                }
            )
        return gpus

    def _optional(self, read):
        try:  # consumer cards and some drivers answer NVML_ERROR_NOT_SUPPORTED
            return read()
        except self.nvml.NVMLError:
            return None

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def _uuid(name: str) -> str:
    """nvidia-smi and NVML write GPU-<hex>, torch's device properties <hex>."""
    name = name.strip().lower()
    return name[4:] if name.startswith("gpu-") else name


def _number(x: float):
    """GPUtil turns nvidia-smi's "[N/A]" into NaN, which is not JSON; null instead."""
    return None if x != x else x


class GputilBackend:
    """GPUtil runs `nvidia-smi --query-gpu=... --format=csv` on every call."""

    name = "gputil"

    def __init__(self):
        import GPUtil

        self.gputil = GPUtil
        if not self._query():
            raise RuntimeError("nvidia-smi found no GPU (or is not on PATH)")

    def _query(self):
        try:
            return self.gputil.getGPUs()
        except (ValueError, IndexError) as e:  # nvidia-smi printed an error instead of CSV
            raise RuntimeError(f"cannot parse nvidia-smi output ({e})") from None

    def indices(self) -> list[int]:
        return [g.id for g in self._query()]

    def uuids(self) -> dict[str, int]:
        return {_uuid(g.uuid): g.id for g in self._query()}

    def read(self, indices) -> list[dict]:
        wanted = set(indices)
        return [
            {
                "index": g.id,
                "name": g.name,
                "util_pct": _number(g.load * 100),
                "mem_used_mib": _number(g.memoryUsed),
                "mem_total_mib": _number(g.memoryTotal),
                "temp_c": _number(g.temperature),
                "power_w": None,
            }
            for g in self._query()
            if g.id in wanted
        ]

    def close(self) -> None:
        pass


def open_backend(name: str):
    """The GPU backend `name` asks for, or None (CPU-only records) with the reason."""
    if name == "none":
        return None, None
    reasons = []
    for cls in {
        "auto": (NvmlBackend, GputilBackend),
        "nvml": (NvmlBackend,),
        "gputil": (GputilBackend,),
    }[name]:
        try:
            return cls(), None
        # missing module, no driver, no nvidia-smi: all mean "no GPU data here"
        except Exception as e:
            reasons.append(f"{cls.name}: {type(e).__name__}: {e}")
    return None, "; ".join(reasons)


class Monitor:
    """mon = Monitor(log_dir, rank, interval_s, backend, gpu_indices); mon.start(); each step
    mon.step = step; mon.stop() (joins the thread, flushes); mon.summary(); mon.last: the latest
    sample. interval_s <= 0: off, no thread and no file. `say` gets the one note a monitor may have
    (print by default)."""

    def __init__(
        self,
        log_dir: str,
        rank: int,
        interval_s: float = 1.0,
        backend: str = "auto",
        gpu_indices=None,
        say=None,
    ):
        if backend not in BACKENDS:
            raise ValueError(
                f"monitor backend must be one of {', '.join(BACKENDS)}, got '{backend}'"
            )
        self.path = os.path.join(log_dir, f"monitor_rank{rank}.jsonl")
        self.rank, self.host, self.interval_s = rank, socket.gethostname(), interval_s
        self.requested, self.gpu_indices = backend, gpu_indices
        self.backend = "off" if interval_s <= 0 else None  # set by start()
        self.step = 0  # the trainer updates this; every sample carries it
        self._gpu, self._file, self._thread, self._stop = None, None, None, threading.Event()
        self._samples = self._cpu_sum = self._cpu_count = self._rss_max = self._util_sum = (
            self._util_count
        ) = 0
        self._mem_max = None
        self._warned = False
        self.say = say or (lambda message: print(message, flush=True))
        self.last = None

    def _note(self, message: str) -> None:
        if not self._warned:
            self.say(f"monitor rank {self.rank}: {message}")
            self._warned = True

    def start(self) -> None:
        if self.interval_s <= 0:
            return
        self._gpu, reason = open_backend(self.requested)
        self.backend = self._gpu.name if self._gpu else "none"
        if reason:
            self._note(f"no GPU data, recording CPU and memory only ({reason})")
        if self._gpu:
            try:
                self.gpu_indices = self._driver_indices(self.gpu_indices)
            except Exception as e:
                self._note(f"no GPU data, recording CPU and memory only ({type(e).__name__}: {e})")
                self._gpu, self.backend = None, "none"
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._file = open_append(self.path)
        self._process, self._cpu_since = psutil.Process(), time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name=f"monitor-rank{self.rank}", daemon=True
        )
        self._thread.start()

    def _driver_indices(self, wanted) -> list[int]:
        """The GPUs to sample, numbered as nvidia-smi does: all of them for None; ints are such
        indices already; strings are GPU UUIDs (str(torch.cuda.get_device_properties(device).uuid)),
        the only name that CUDA_VISIBLE_DEVICES and CUDA's fastest-first order do not change."""
        if wanted is None:
            return self._gpu.indices()
        by_uuid = self._gpu.uuids() if any(isinstance(w, str) for w in wanted) else {}
        missing = [w for w in wanted if isinstance(w, str) and _uuid(w) not in by_uuid]
        if missing:
            self._note(
                f"no GPU with UUID {', '.join(missing)} on this host; sampling all of its GPUs"
            )
            return self._gpu.indices()
        return [by_uuid[_uuid(w)] if isinstance(w, str) else w for w in wanted]

    def _run(self) -> None:
        # Every interval_s, and once more at stop, so a run shorter than one interval still has a
        # sample.
        psutil.cpu_percent(None)  # sets this thread's reference point (psutil keeps one per thread)
        try:
            while not self._stop.wait(self.interval_s):
                self.sample()
            self.sample()
        except OSError as e:  # a full disk: the run says so where it saves; this thread just stops
            self._warned = False
            self._note(f"stopped sampling, its file cannot be written ({e})")

    def sample(self) -> dict:
        gpus = []
        if self._gpu:
            try:
                gpus = self._gpu.read(self.gpu_indices)
            except Exception as e:  # a driver hiccup costs this sample's GPU data, not the run
                self._note(
                    f"{self.backend} query failed, sample without GPU data "
                    f"({type(e).__name__}: {e})"
                )
        cpu, now = None, time.monotonic()
        # psutil's CPU % covers the time since its last call: noise when short
        if now - self._cpu_since >= 0.05:
            cpu, self._cpu_since = psutil.cpu_percent(None), now
        record = {
            "time": time.time(),
            "host": self.host,
            "rank": self.rank,
            "step": self.step,
            "backend": self.backend,
            "cpu_percent": cpu,
            "rss_mib": self._process.memory_info().rss / 2**20,
            "gpus": gpus,
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.last = record
        self._samples += 1
        if cpu is not None:
            self._cpu_sum += cpu
            self._cpu_count += 1
        self._rss_max = max(self._rss_max, record["rss_mib"])
        for g in gpus:
            if g["util_pct"] is not None:
                self._util_sum += g["util_pct"]
                self._util_count += 1
            if g["mem_used_mib"] is not None:
                self._mem_max = max(self._mem_max or 0.0, g["mem_used_mib"])
        return record

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        with contextlib.suppress(OSError):  # the last buffered bytes on a full disk
            self._file.close()
        if self._gpu:
            self._gpu.close()

    def summary(self) -> dict:
        n = self._samples
        return {
            "host": self.host,
            "rank": self.rank,
            "backend": self.backend,
            "samples": n,
            "interval_s": self.interval_s,
            "gpus": list(self.gpu_indices or []) if self._gpu else [],
            "gpu_util_mean": self._util_sum / self._util_count if self._util_count else None,
            "gpu_mem_used_max_mib": self._mem_max,
            "cpu_percent_mean": self._cpu_sum / self._cpu_count if self._cpu_count else None,
            "rss_max_mib": self._rss_max if n else None,
        }


def gpu_util_mean_per_host(summaries: list[dict]) -> dict:
    """{host: mean of its ranks' gpu_util_mean} from every rank's Monitor.summary(); None for a host
    without GPU data."""
    per_host = {}
    for s in summaries:
        means = per_host.setdefault(s["host"], [])
        if s["gpu_util_mean"] is not None:
            means.append(s["gpu_util_mean"])
    return {host: sum(means) / len(means) if means else None for host, means in per_host.items()}
