"""VIT_TEST_HANDOVER_CHUNK=N: a freeze point's handover of ZeRO's partitioned state goes through
its device buffer N elements at a time (vit.engines.deepspeed.HANDOVER_CHUNK, 2**24), so
that a small model crosses several chunks and chunk boundaries inside parameters."""

import os

import vit.engines.deepspeed as deepspeed_specs
from vit.runtime import plugins


def start(rank: int, watchdog) -> None:
    deepspeed_specs.HANDOVER_CHUNK = int(os.environ["VIT_TEST_HANDOVER_CHUNK"])


plugins.add("start", start)
