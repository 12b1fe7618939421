"""Ending the whole job, quickly, when one rank fails or stops, and naming that rank.

A failing rank publishes "rank R (host) failed at step S: why" in the process group's key-value
store and exits non-zero. Every rank runs a watchdog thread that publishes its last step (a
heartbeat key per rank), reads everyone else's, and exits its process with os._exit, whatever its
main thread is waiting in, when a failure is announced, when the store is gone, when the store does
not answer for --dist-timeout seconds, or when, after the first step, no step, evaluation batch or
save finished here for --dist-timeout seconds. It names the rank that stopped: the one whose
heartbeat stopped changing. A collective of the default group waits as long; when it times out
first, the main thread names that rank the same way (its own failure when no other rank is stuck).

The store lives in rank 0's process. When rank 0 stops (SIGSTOP, a driver stall, swap, an NFS hang)
a store call from any other rank never returns and no timeout applies, not even to a new connection;
so every store call here runs on a helper thread and is waited for with a deadline. For the same
reason rank 0, when it stops, keeps its process (and the store) a moment longer, so that the others
read why.

A rank that dies (SIGKILL, a crash) closes its connections: the ranks talking to it get an error
saying so. Such a survivor names the rank that died, not itself: rank 0 when the store is gone with
it, else the rank whose heartbeat stopped. Its traceback goes to the warnings log
(vit.runtime.console), not the console.
"""

import json
import re
import socket
import threading
import time
import traceback
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import NoReturn

import torch.distributed as dist

from vit.runtime import console

ABORT_KEY = "vit/abort"
BEAT_KEY = "vit/beat/{}"
ANSWER_S = 3.0  # how long the main thread's own store calls may take before they are given up
# gloo's words for a connection its peer closed (a read of 0 bytes, ECONNRESET, EPIPE): the peer's
# process is gone
CLOSED = re.compile(r"(closed|reset) by peer|Broken pipe")
# A collective that waited its process group's timeout for its peers (gloo's words, then NCCL's)
TIMED_OUT = re.compile(
    r"Timed out waiting \d+ms for (recv|send) operation|collective operation timeout"
)
# one report per process: the main thread's or the watchdog's, whichever comes first
_REPORT = threading.Lock()


def _store():
    return dist.distributed_c10d._get_default_store()


def _in_thread(fn, *args) -> Future:
    """fn(*args) on a daemon thread: a call that never returns costs that thread, not its caller."""
    future = Future()

    def call():
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # handed to the caller
            future.set_exception(e)

    threading.Thread(target=call, name="vit-store-call", daemon=True).start()
    return future


def _answer(fn, *args, timeout_s: float = ANSWER_S):
    """fn(*args) on the store, or None when it fails or does not answer within timeout_s."""
    try:
        return _in_thread(fn, *args).result(timeout=timeout_s)
    except Exception:
        return None


def _get_abort(store) -> str | None:
    return store.get(ABORT_KEY).decode() if store.check([ABORT_KEY]) else None


def announce_failure(message: str) -> None:
    """Tell every rank why this one stops (best effort: the store may be gone or stopped too)."""
    _answer(lambda: _store().set(ABORT_KEY, message))


def failure_elsewhere() -> str | None:
    """The failure another rank announced, if any (None too when the store does not answer)."""
    return _answer(lambda: _get_abort(_store()))


def store_gone() -> bool:
    """Whether a call to the job's store fails (it died with rank 0's process); one that hangs does
    not say so."""
    try:
        _in_thread(lambda: _store().check([ABORT_KEY])).result(timeout=ANSWER_S)
    except TimeoutError:
        return False
    except Exception:
        return True
    return False


@dataclass
class Peer:
    """A rank as this one saw it through its heartbeats; times are this rank's time.monotonic()."""

    host: str
    step: int
    seq: int | None  # None: no heartbeat of it seen yet
    beat_seen_at: float  # when its heartbeat last changed: its watchdog was running then
    step_seen_at: float  # when its step last changed


class Watchdog(threading.Thread):
    def __init__(self, rank: int, timeout_s: float, poll_s: float = 1.0):
        """Collective: every rank makes its watchdog at the same point."""
        super().__init__(name="vit-watchdog", daemon=True)
        self.rank, self.host, self.timeout_s, self.poll_s = (
            rank,
            socket.gethostname(),
            timeout_s,
            poll_s,
        )
        self.who, self.world_size = f"rank {rank} ({self.host})", dist.get_world_size()
        # Every rank's host, known before any heartbeat: a rank that dies before its first one is
        # still named.
        self.hosts = [None] * self.world_size
        dist.all_gather_object(self.hosts, self.host)
        # armed by the first beat: start-up (JIT builds) can be slow
        self.step, self.last_beat = 0, None
        # Every rank as seen from now on: one stopped before its first heartbeat reached the store
        # (no seq yet) is frozen like one whose heartbeat stopped later.
        now = time.monotonic()
        self.peers = {r: Peer(host, 0, None, now, now) for r, host in enumerate(self.hosts)}
        self._stop_event = threading.Event()
        self._pending: Future | None = None  # the store call in flight
        self._asked_at = time.monotonic()  # when it was made
        # A heartbeat that has not changed for this long means that rank's process is stopped or
        # gone.
        self.frozen_s = max(5.0, 5 * poll_s)
        # rank 0's last moment: every other watchdog reads the store once meanwhile
        self.linger_s = 2 * poll_s

    def beat(self, step: int | None = None) -> None:
        """Progress: a finished step, or (without one) a sign of life inside a long evaluation or
        save."""
        self.step, self.last_beat = self.step if step is None else step, time.monotonic()

    def stop(self) -> None:
        """Stop, and wait (at most ANSWER_S) for the store call in flight: one that returns while
        the interpreter exits ends the process with 'terminate called without an active exception'
        (seen on ZeRO-3 at the end of a run on the simulated hosts, once rank 0 and its store had
        gone)."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=2 * self.poll_s)
        if self._pending is not None:
            wait([self._pending], timeout=ANSWER_S)

    def _die(self, why: str) -> NoReturn:
        self._exit(f"{self.who} stops at step {self.step}: {why}")

    def _exit(self, line: str) -> NoReturn:
        """Print line and end the process, once: a report from the other thread waits here until
        then. Rank 0 holds the store, so it waits a moment first: the others read why there rather
        than find the store gone."""
        _REPORT.acquire()
        console.last_words(line, 1, self.linger_s if self.rank == 0 and self.world_size > 1 else 0)

    def fail(self, e: BaseException, explained: bool) -> NoReturn:
        """End the process for e, which the main thread caught, and tell the others: the failure
        another rank announced, else the rank that died (e says a connection closed), else this
        rank's own failure. A traceback (unless e explains itself) prints with this rank's own
        failure, and goes to the warnings log with another's."""
        elsewhere = failure_elsewhere()
        if elsewhere is not None:
            self._exit(f"{self.who} stops: {elsewhere}")
        died = self.lost_peer(e)
        hung = None if died else self.hung_peer(e)
        if not explained:
            (console.aside if died or hung else console.to_stderr)(
                "".join(traceback.format_exception(e))
            )
        if hung:
            announce_failure(hung)
            self._die(hung)
        message = died or f"{self.who} failed at step {self.step}: {e}"
        announce_failure(message)
        self._exit(message)

    def lost_peer(self, e: BaseException) -> str | None:
        """When e says a peer closed its connection, the line naming the rank that died: rank 0 when
        the store is gone too, else the one other rank that could have (rank 0 is alive when its
        store answers), else the ones whose heartbeats stay still while the live ones beat (waited
        for at most frozen_s). None: e says nothing of the kind, or every rank still beats."""
        if not CLOSED.search(str(e)):
            return None
        why = f"its connection to {self.who} closed"
        if self.rank != 0 and store_gone():
            return self._died([0], f"{why}, and the job's store, in its process, is gone")
        seqs = {r: p.seq for r, p in dict(self.peers).items()}
        suspects = [r for r in range(1, self.world_size) if r != self.rank]
        deadline = time.monotonic() + self.frozen_s
        while len(suspects) > 1 and time.monotonic() < deadline:
            time.sleep(self.poll_s / 4)
            suspects = [r for r in suspects if self.peers[r].seq == seqs[r]]
        return self._died(suspects, why) if suspects else None

    def hung_peer(self, e: BaseException) -> str | None:
        """When e says a collective timed out, what the watchdog would have said a moment later:
        rank 0 when the store does not answer, else the rank whose heartbeat stopped first, or the
        one furthest behind, if its step has not changed for frozen_s. None: e says nothing of the
        kind, or no other rank is to blame. (The collective's timeout and the watchdog's are both
        --dist-timeout; which ends the wait first is chance.)"""
        now = time.monotonic()
        if not TIMED_OUT.search(str(e)):
            return None
        pending = self._pending
        if (
            self.rank != 0
            and pending is not None
            and not pending.done()
            and now - self._asked_at > self.frozen_s
        ):
            return self._store_silent(now)
        culprit = self._culprit(now)
        if culprit == self.rank or now - self.peers[culprit].step_seen_at <= self.frozen_s:
            return None
        return (
            f"{self._stopped(culprit, now)} (a collective waited --dist-timeout "
            f"{self.timeout_s:g} s for it)"
        )

    def _store_silent(self, now: float) -> str:
        return (
            f"{self._stopped(0, now)}: the job's store, in its process, has not answered for "
            f"{now - self._asked_at:.0f} s (--dist-timeout {self.timeout_s:g})"
        )

    def _died(self, ranks: list[int], why: str) -> str:
        names = ", ".join(f"rank {r} ({self.hosts[r]})" for r in ranks)
        return f"{names} died at step {self.step}: {why}"

    def _exchange(self, store, world_size: int, seq: int) -> tuple[str | None, dict]:
        """One round with the store: publish this rank's heartbeat, read the abort key and every
        heartbeat."""
        store.set(
            BEAT_KEY.format(self.rank),
            json.dumps({"host": self.host, "step": self.step, "seq": seq}),
        )
        keys = {r: BEAT_KEY.format(r) for r in range(world_size)}
        beats = {r: json.loads(store.get(k)) for r, k in keys.items() if store.check([k])}
        return _get_abort(store), beats

    def _seen(self, beats: dict, now: float) -> None:
        for r, b in beats.items():
            p = self.peers[r]
            if b["seq"] != p.seq:
                p.seq, p.beat_seen_at = b["seq"], now
            if b["step"] != p.step:
                p.step, p.step_seen_at = b["step"], now

    def _stopped(self, rank: int, now: float) -> str:
        p = self.peers[rank]
        last = "it never published a step" if p.seq is None else f"last step {p.step}"
        return f"rank {rank} ({p.host}) made no progress for {now - p.step_seen_at:.0f} s ({last})"

    def _culprit(self, now: float) -> int:
        """The rank to blame when this one made no progress: the one whose heartbeat stopped first,
        else the one furthest behind, else this one (every watchdog runs, so the hang is inside a
        collective)."""
        # the main thread asks too (hung_peer) while the watchdog's adds ranks
        peers = dict(self.peers)
        others = [r for r in peers if r != self.rank]
        frozen = [r for r in others if now - peers[r].beat_seen_at > self.frozen_s]
        if frozen:
            return min(frozen, key=lambda r: peers[r].beat_seen_at)
        behind = [r for r in others if peers[r].step < self.step]
        return min(behind, key=lambda r: peers[r].step) if behind else self.rank

    def run(self) -> None:
        store, world_size, seq = _store(), self.world_size, 0
        # the first heartbeat at once: a rank stopped in its first poll_s is still seen to stop
        while not self._stop_event.is_set():
            now, pending = time.monotonic(), self._pending
            if pending is None or pending.done():
                if pending is not None:
                    self._take(pending)
                seq += 1
                self._asked_at = now  # first: hung_peer (main thread) reads the two
                self._pending = _in_thread(self._exchange, store, world_size, seq)
            elif now - self._asked_at > self.timeout_s:
                self._die(self._store_silent(now))
            idle = 0 if self.last_beat is None else now - self.last_beat
            if idle > self.timeout_s:
                culprit = self._culprit(now)
                message = (
                    self._stopped(culprit, now)
                    if culprit != self.rank
                    else f"rank {self.rank} ({self.host}) made no progress for {idle:.0f} s "
                    f"(last step {self.step})"
                )
                announce_failure(f"{message} (--dist-timeout {self.timeout_s:g})")
                self._die(f"{message} (a rank died or hangs; --dist-timeout {self.timeout_s:g})")
            self._stop_event.wait(self.poll_s)

    def _take(self, done: Future) -> None:
        try:
            abort, beats = done.result()
        except Exception as e:
            if not self._stop_event.is_set():
                self._exit(
                    self._died(
                        [0],
                        "the job's store, in its process, closed its connection to "
                        f"{self.who} ({type(e).__name__})",
                    )
                )
            return
        if abort is not None:
            self._die(abort)
        self._seen(beats, time.monotonic())
