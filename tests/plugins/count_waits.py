"""VIT_TEST_COUNT_WAITS=PATH: count the times the training loop waits for the device's queued work
(vit.training.stats's wait_for_queued, an event synchronize on a GPU and a call that returns at
once on a CPU); each rank writes its count to PATH.rank<R> when it exits."""

import atexit
import os

import vit.training.stats as stats

calls = [0]
waited = stats.wait_for_queued


def counted(device) -> None:
    calls[0] += 1
    waited(device)


def write() -> None:
    rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    with open(f"{os.environ['VIT_TEST_COUNT_WAITS']}.rank{rank}", "w") as f:
        f.write(str(calls[0]))


stats.wait_for_queued = counted
atexit.register(write)
