"""The plugin point (vit.runtime.plugins) the fault-injecting tests use: a module VIT_PLUGINS names
that cannot be imported stops the run in one line, and only the documented hooks can be added to.
The plugins themselves are exercised by the tests that inject with them (tests/plugins/)."""

import sys

import pytest
from helpers import base_env, run_cmd

from vit.runtime import plugins


@pytest.mark.ranks
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("variable", "said"),
    [
        (
            "VIT_PLUGINS",
            "entry_cn.sh: error: VIT_PLUGINS: cannot import tests_no_such_module: No module named "
            "'tests_no_such_module'\n",
        ),
        # read when the registry is imported, before vit.train's error handling: was a traceback
        (
            "VIT_ENGINES",
            "error: VIT_ENGINES: cannot take an engine's SPEC from tests_no_such_module: No module "
            "named 'tests_no_such_module'\n",
        ),
    ],
)
def test_a_module_that_cannot_be_imported_is_one_line_and_nothing_written(tmp_path, variable, said):
    r = run_cmd(
        [sys.executable, "-m", "vit.train", "--steps", "2", "--log-dir", str(tmp_path / "run")],
        env=base_env(**{variable: "tests_no_such_module"}),
        timeout=100,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr == said, r.stderr
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
