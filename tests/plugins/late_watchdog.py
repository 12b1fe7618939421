"""VIT_TEST_LATE_WATCHDOG=SECONDS: every rank's watchdog (vit.runtime.faults) notices a lack of
progress SECONDS later than --dist-timeout, so that a collective waiting on a stopped rank always
times out first and the main thread's report is the one tested."""

import os

from vit.runtime import plugins


def start(rank: int, watchdog) -> None:
    late, beat = float(os.environ["VIT_TEST_LATE_WATCHDOG"]), watchdog.beat

    def late_beat(step: int | None = None) -> None:
        beat(step)
        watchdog.last_beat += late

    watchdog.beat = late_beat


plugins.add("start", start)
