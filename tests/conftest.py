"""pytest wiring: the `ranks` marker is required of every test that starts processes
(tests/helpers.py checks), so that `pytest -m "not ranks"` runs only the in-process tests."""

import helpers
import pytest


@pytest.fixture(autouse=True)
def _ranks_marker(request):
    helpers.CURRENT_TEST_STARTS_PROCESSES = request.node.get_closest_marker("ranks") is not None
    yield
    helpers.CURRENT_TEST_STARTS_PROCESSES = None
    helpers.kill_leftovers()
