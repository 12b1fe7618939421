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
