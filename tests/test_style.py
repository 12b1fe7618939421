"""Style held by tools, not by line counts: the code is as `ruff format` writes it (100 columns),
and `ruff check` passes, with the complexity rules of ruff.toml (mccabe's C901; pylint's branches,
arguments and statements per function) that keep a function small by its structure."""

import sys

import pytest
from helpers import ROOT, run_cmd

RUFF = [sys.executable, "-m", "ruff"]


@pytest.mark.ranks
def test_the_code_is_as_the_formatter_writes_it():
    r = run_cmd([*RUFF, "format", "--check", "--diff", str(ROOT)], timeout=120)
    assert r.returncode == 0, "run `ruff format .`:\n" + r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.ranks
def test_the_linter_and_its_complexity_rules_pass():
    r = run_cmd([*RUFF, "check", str(ROOT)], timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.ranks
def test_the_complexity_rule_sees_a_tangled_function(tmp_path):
    body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(16))
    (tmp_path / "tangled.py").write_text(f"def tangled(x):\n{body}    return -1\n")
    config = str(ROOT / "ruff.toml")
    r = run_cmd([*RUFF, "check", "--config", config, str(tmp_path / "tangled.py")], timeout=120)
    assert r.returncode == 1 and "C901" in r.stdout and "PLR0912" in r.stdout, r.stdout + r.stderr
