"""VIT_TEST_CRASH_IN_SAVE=TAG: each rank dies (exit 5, a status the project does not use: 3 is
"cannot go on on these ranks", which retry.sh treats otherwise) between writing checkpoint TAG's
files and its manifest."""

import os

from vit.runtime import plugins


def checkpoint_written(tag: str) -> None:
    if tag == os.environ["VIT_TEST_CRASH_IN_SAVE"]:
        os._exit(5)


plugins.add("checkpoint_written", checkpoint_written)
