"""The plugin point (vit.runtime.plugins) the fault-injecting tests use: a module VIT_PLUGINS names
that cannot be imported stops the run in one line, and only the documented hooks can be added to.
The plugins themselves are exercised by the tests that inject with them (tests/plugins/)."""

import sys

import pytest
from helpers import base_env, run_cmd

from vit.runtime import plugins


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_a_plugin_that_cannot_be_imported_is_one_line_and_nothing_written(tmp_path):
    r = run_cmd(
        [sys.executable, "-m", "vit.train", "--steps", "2", "--log-dir", str(tmp_path / "run")],
        env=base_env(VIT_PLUGINS="tests_no_such_plugin"),
        timeout=100,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert (
        r.stderr
        == "entry_cn.sh: error: VIT_PLUGINS: cannot import tests_no_such_plugin: No module named "
        "'tests_no_such_plugin'\n"
    ), r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_an_engine_module_that_cannot_be_imported_is_one_line_and_nothing_written(tmp_path):
    """VIT_ENGINES is read when the registry is imported, before vit.train's error handling: it
    was a traceback."""
    r = run_cmd(
        [sys.executable, "-m", "vit.train", "--steps", "2", "--log-dir", str(tmp_path / "run")],
        env=base_env(VIT_ENGINES="tests_no_such_engine"),
        timeout=100,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert (
        r.stderr == "error: VIT_ENGINES: cannot take an engine's SPEC from tests_no_such_engine: "
        "No module named 'tests_no_such_engine'\n"
    ), r.stderr
    assert not (tmp_path / "run").exists()


def test_only_the_documented_hooks_can_be_added_to(monkeypatch):
    monkeypatch.setitem(plugins.HOOKS, "census", [])
    seen = []
    plugins.add("census", seen.append)
    plugins.call("census", {"bf16": False})
    assert seen == [{"bf16": False}]
    with pytest.raises(
        ValueError, match="no plugin hook 'census_report'; the hooks are start, census, "
    ):
        plugins.add("census_report", seen.append)
    for hook in plugins.HOOKS:
        assert f'"{hook}"' in plugins.__doc__, hook  # each one's arguments are documented
