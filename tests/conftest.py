"""pytest wiring: the `ranks` marker is required of every test that starts processes
(tests/helpers.py checks), so that `pytest -m "not ranks"` runs only the in-process tests; and
each test gets the environment the one before it started with."""

import os

import helpers
import pytest


@pytest.fixture(autouse=True)
def _environment_restored():
    """A test that starts a run in-process (vit.train.run, dist_env.init_process_group) sets RANK,
    LOCAL_RANK, MASTER_PORT ... in os.environ as a rank does; left there, every later test's ranks
    inherited them (a leaked LOCAL_RANK=1 hung the next mpirun run in DeepSpeed's shared-memory
    all-reduce)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _ranks_marker(request):
    helpers.CURRENT_TEST_STARTS_PROCESSES = request.node.get_closest_marker("ranks") is not None
    yield
    helpers.CURRENT_TEST_STARTS_PROCESSES = None
    helpers.kill_leftovers()


# `make test` runs the files on two pytest-xdist workers (--dist loadfile
# --no-loadscope-reorder), each file on one worker, handed out in collection order. xdist's own
# order (most tests first) left the files of few long tests to the end, where one worker ran them
# while the other had nothing left. These are the files that took longest (seconds per file,
# docs/benchmarks.md, 2 December 2026), longest first, the rest in their usual order; a run in one
# process keeps the usual order.
LONGEST_FIRST = (
    "test_reliability.py",
    "test_cluster.py",
    "test_freeze.py",
    "test_diloco.py",
    "test_universal.py",
    "test_train.py",
    "test_async_pipeline.py",
    "test_engine_seam.py",
    "test_weights.py",
    "test_auto_engine.py",
    "test_bench.py",
)


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # not an xdist worker
        return
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
