"""Ending the whole job, quickly, when one rank fails.

A failing rank publishes "rank R (host) failed at step S: why" in the process group's key-value store
and exits non-zero. Every rank runs a watchdog thread that exits its process when that key appears,
when the store (rank 0) is gone, or when, after the first step, no step, evaluation batch or save
finished for --dist-timeout seconds (a dead or hung peer). Collectives also time out after
--dist-timeout, so no rank waits longer than that.
"""
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

ABORT_KEY = "vit/abort"


def _store():
    return dist.distributed_c10d._get_default_store()


def announce_failure(message: str) -> None:
    """Tell every rank why this one stops (best effort: the store may be gone too)."""
    try:
        _store().set(ABORT_KEY, message)
    except Exception:
        pass


def failure_elsewhere() -> str | None:
    """The failure another rank announced, if any."""
    try:
        store = _store()
        return store.get(ABORT_KEY).decode() if store.check([ABORT_KEY]) else None
    except Exception:
        return None


class Watchdog(threading.Thread):
    def __init__(self, rank: int, timeout_s: float, poll_s: float = 1.0):
        super().__init__(name="vit-watchdog", daemon=True)
        self.rank, self.host, self.timeout_s, self.poll_s = rank, socket.gethostname(), timeout_s, poll_s
        self.step, self.last_beat = 0, None  # armed by the first beat: start-up (JIT builds) can be slow
        self._stop_event = threading.Event()

    def beat(self, step: int | None = None) -> None:
        """Progress: a finished step, or (without one) a sign of life inside a long evaluation or save."""
        self.step, self.last_beat = self.step if step is None else step, time.monotonic()

    def stop(self) -> None:
        self._stop_event.set()

    def _die(self, why: str) -> None:
        print(f"rank {self.rank} ({self.host}) stops at step {self.step}: {why}", file=sys.stderr, flush=True)
        os._exit(1)

    def run(self) -> None:
        store = _store()
        while not self._stop_event.wait(self.poll_s):
            try:
                if store.check([ABORT_KEY]):
                    self._die(store.get(ABORT_KEY).decode())
            except Exception as e:
                if not self._stop_event.is_set():
                    self._die(f"lost the job's store on rank 0 ({type(e).__name__}: {e})")
            idle = 0 if self.last_beat is None else time.monotonic() - self.last_beat
            if idle > self.timeout_s:
                message = f"rank {self.rank} ({self.host}): no progress for {idle:.0f} s after step {self.step}"
                announce_failure(message)
                self._die(f"{message} (a rank died or hangs; --dist-timeout {self.timeout_s:g})")
