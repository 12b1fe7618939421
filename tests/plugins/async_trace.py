"""VIT_TEST_ASYNC_TRACE=PREFIX: the async pipeline's rank R writes PREFIX_rankR.jsonl, one record
per micro-batch's backward: its stage, the updates applied at its forward and at its backward, its
staleness, and a checksum of the weights each pass used, and its input's dtype (and whether a leaf
requiring grad)."""

import json
import os

import torch.distributed as dist

from vit.runtime import plugins

forward_weights: dict[int, float] = {}  # by micro-batch, until its backward
trace = None


def checksum(weights: dict) -> float:
    return float(sum(w.detach().double().sum() for w in weights.values()))


def forwarded(engine, k: int, weights: dict) -> None:
    forward_weights[k] = checksum(weights)


def backwarded(engine, k: int, inflight, weights: dict) -> None:
    global trace
    if trace is None:
        trace = open(
            f"{os.environ['VIT_TEST_ASYNC_TRACE']}_rank{dist.get_rank()}.jsonl", "a", buffering=1
        )
    trace.write(
        json.dumps(
            {
                "stage": engine.stage,
                "k": k,
                "forward_version": inflight.version,
                "backward_version": engine.version,
                "staleness": inflight.staleness,
                "forward_weights": forward_weights.pop(k),
                "backward_weights": checksum(weights),
                "input": input_kind(inflight.x),
            }
        )
        + "\n"
    )


def input_kind(x) -> str:
    """What the stage's input was: its dtype, and whether a leaf requiring grad (a received
    activation)."""
    leaf = ", leaf requiring grad" if x.is_leaf and x.requires_grad else ""
    return f"{str(x.dtype).removeprefix('torch.')}{leaf}"


plugins.add("async_forward", forwarded)
plugins.add("async_backward", backwarded)
