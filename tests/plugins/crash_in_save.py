"""VIT_TEST_CRASH_IN_SAVE=TAG: each rank dies (exit 3) between writing checkpoint TAG's files and
its manifest."""

import os

from vit.runtime import plugins


def checkpoint_written(tag: str) -> None:
    if tag == os.environ["VIT_TEST_CRASH_IN_SAVE"]:
        os._exit(3)


plugins.add("checkpoint_written", checkpoint_written)
