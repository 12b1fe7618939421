"""VIT_TEST_DEEPSPEED_VERSION=V: DeepSpeed reports release V (deepspeed.__version__), so that a test
reaches vit.engines.zero.engine's check of the releases its ZeRO-3 mend was verified on without
installing another DeepSpeed."""

import os

import deepspeed

from vit.runtime import plugins


def start(rank: int, watchdog) -> None:
    deepspeed.__version__ = os.environ["VIT_TEST_DEEPSPEED_VERSION"]


plugins.add("start", start)
