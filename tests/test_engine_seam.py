"""The engine seam (issue 52): a throwaway engine kept outside vit/ (tests/engines/ddp_checked/: DDP
with one option of its own, --check-every) registers through VIT_ENGINES and nothing else: its
option parses, shows in --help and is refused elsewhere; it trains 2 ranks with ddp's losses, bit
for bit; it resumes its own checkpoint, which ddp refuses; the planner lists it, plot_logs.py charts
its run; and no module of vit/ names it."""

import json
import os
import sys

import pytest
from helpers import ROOT, base_env, launch, run_cmd, train_losses

NAME, MODULE = "ddp-checked", "ddp_checked"
ENGINES = ROOT / "tests" / "engines"
SEAM = {"VIT_ENGINES": MODULE, "PYTHONPATH": f"{ROOT}{os.pathsep}{ENGINES}"}
COMMON = ["--steps", 6, "--log-interval", 1, "--monitor-interval", 0]

PROBE = """
import json
from vit.run.cli import parse, parser
from vit.core.errors import ConfigError
from vit.engines.registry import NAMES, planner_inputs

def refusal(argv):
    try:
        parse(argv)
    except ConfigError as e:
        return str(e)

s = parse(["--engine", "ddp-checked", "--check-every", "3"])
print(json.dumps({
    "check_every": s.checked.check_every,
    "default": parse(["--engine", "ddp-checked"]).checked.check_every,
    "help": parser().format_help(),
    "elsewhere": refusal(["--check-every", "3"]),
    "zero": refusal(["--engine", "ddp-checked", "--check-every", "0"]),
    "names": NAMES,
    "inputs": sorted(planner_inputs(s.flat())),
}))
"""


def seam_run(*cmd, timeout: float = 120):
    r = run_cmd([sys.executable, *map(str, cmd)], timeout=timeout, env=base_env(**SEAM))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.mark.ranks
def test_its_option_parses_shows_in_help_and_is_refused_without_it():
    got = json.loads(seam_run("-c", PROBE).stdout.splitlines()[-1])
    assert (got["check_every"], got["default"]) == (3, 1)
    assert "--check-every" in got["help"] and "weight checks (--engine ddp-checked)" in got["help"]
    assert got["elsewhere"] == "--check-every has no effect without --engine ddp-checked"
    assert got["zero"] == "--check-every must be positive, got 0"
    assert got["names"][-1] == NAME and NAME in got["inputs"]


@pytest.mark.ranks
@pytest.mark.timeout(900)
def test_it_trains_as_ddp_resumes_its_own_checkpoint_and_is_planned_and_charted(tmp_path):
    checked, ddp, resumed = tmp_path / "checked", tmp_path / "ddp", tmp_path / "resumed"
    own = ["--engine", NAME, "--check-every", 2, *COMMON]
    r = launch([*own, "--save-interval", 3, "--log-dir", checked], env=SEAM, timeout=300)
    assert r.ok, r
    r = launch(["--engine", "ddp", *COMMON, "--no-save", "--log-dir", ddp], timeout=300)
    assert r.ok, r
    want = train_losses(checked)
    assert sorted(want) == list(range(1, 7)) and want == train_losses(ddp)

    step3 = checked / "checkpoints" / "step3"
    r = launch([*own, "--no-save", "--resume", step3, "--log-dir", resumed], env=SEAM, timeout=300)
    assert r.ok, r
    got = train_losses(resumed)
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-7), (step, got, want)
    r = launch(
        ["--engine", "ddp", *COMMON, "--resume", step3, "--log-dir", tmp_path / "refused"],
        env=SEAM,
        timeout=300,
    )
    assert r.returncodes == [2, 2], r
    assert f"was written by --engine {NAME}, this run uses --engine ddp" in r.outputs[0], r

    seam_run("-m", "vit.planner", checked, "--json", tmp_path / "plan.json", timeout=300)
    rows = json.loads((tmp_path / "plan.json").read_text())["candidates"]
    assert NAME in {row["engine"] for row in rows}
    seam_run(ROOT / "plot_logs.py", checked, timeout=300)
    assert (checked / "plots" / "loss.png").stat().st_size > 0


def test_no_module_of_vit_names_it():
    names = (NAME, MODULE, "CheckedSpec", "CheckSettings", "check_every", "check-every")
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "vit").rglob("*.py"))
        for name in names
        if name in path.read_text()
    ]
    assert not found, found
