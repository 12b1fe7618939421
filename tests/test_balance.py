"""--partition balanced by the planner's cost model (vit.planner.balance) on census records in the
run's format, against hand-computed predictions: it gives the slow rank fewer layers, keeps uniform
when fixed costs or the link hide the difference, and refuses a split that fits nowhere. Fast,
in-process; the real 2-rank run is in test_hetero.py."""

import json

import pytest
from torch import nn

from vit.core.costs import Candidate
from vit.core.errors import ConfigError
from vit.engines.registry import SPECS
from vit.planner import balance, cli

DS_PIPE = next(e.name for e in SPECS.values() if e.pipeline and e.deepspeed)
MICRO, ACCUM = 8, 4
PROFILE = [
    {
        "name": "Embed" if i == 0 else "Block",
        "params": 1000,
        "act_bytes": 100.0,
        "out_elems": 50,
        "flops": 1.0,
    }
    for i in range(6)
]
LAYERS = [nn.Identity() for _ in PROFILE]


@pytest.fixture(autouse=True)
def calibration(tmp_path, monkeypatch):
    """The defaults unless a test writes one: no logs/planner_calibration.json of this machine's."""
    monkeypatch.delenv(cli.CALIBRATION, raising=False)
    monkeypatch.setattr(cli, "CALIBRATION_FILE", tmp_path / "absent.json")

    def write(**fixed):
        (tmp_path / "calib.json").write_text(json.dumps(fixed))
        monkeypatch.setenv(cli.CALIBRATION, str(tmp_path / "calib.json"))

    return write


def census(ms_per_layer=(1.0, 2.0), hosts=("a", "a"), free_gib=8.0) -> list[dict]:
    """Each rank's layer_ms (forward, backward) at the run's micro-batch: `ms` each way per
    layer."""
    return [
        {
            "host": h,
            "mem_free_gib": free_gib,
            "layer_ms": [[ms, ms]] * len(PROFILE),
            "layer_ms_micro_batch": MICRO,
        }
        for ms, h in zip(ms_per_layer, hosts)
    ]


def plan(reports, links=None):
    return balance.plan_partition(
        Candidate(DS_PIPE, 0, 2, MICRO, ACCUM), PROFILE, LAYERS, reports, links or {}, "fp32"
    )


def test_the_slow_rank_gets_fewer_layers_with_the_predicted_step_by_hand():
    # rank 0: 2 ms a layer (forward and backward), rank 1: 4 ms. Balanced: 4 layers on rank 0 (8
    # ms), 2 on rank 1 (8 ms); uniform 6 ms and 12 ms. Step: (4 micro-batches + 1 slot of fill) x
    # (slowest stage + the pipeline's 0.5 ms a micro-batch) + 2 ms a step (the calibration's
    # defaults); the same-host link is far from binding.
    parts, record, text = plan(census())
    assert (
        parts == [0, 4, 6]
        and record["chosen"] == "balanced"
        and record["compare"]["uniform"] == [0, 3, 6]
    )
    assert 1e3 * record["predicted_step_s"]["balanced"] == pytest.approx(5 * 8.5 + 2)
    assert 1e3 * record["predicted_step_s"]["uniform"] == pytest.approx(5 * 12.5 + 2)
    assert [1e3 * t for t in record["stage_compute_s"]] == pytest.approx([8.5, 8.5])
    assert "stage 1 on rank 1 (a): layers 4-5 (Block x2); per micro-batch 8.50 ms compute" in text
    assert (
        "balanced [0, 4, 6] 44.5 ms, uniform [0, 3, 6] 64.5 ms" in text
        and "predicted 44.9% faster" in text
    )


def test_uniform_stays_when_the_fixed_costs_hide_the_difference(calibration):
    # 100 ms of the pipeline's own per micro-batch: 5 x 112 + 2 against 5 x 108 + 2 is 3.7% more
    # (under 5%).
    calibration(engine_micro_s={DS_PIPE: 0.1})
    parts, record, text = plan(census())
    assert (
        parts == [0, 3, 6]
        and record["chosen"] == "uniform"
        and record["compare"]["balanced"] == [0, 4, 6]
    )
    assert record["predicted_step_s"]["uniform"] / record["predicted_step_s"][
        "balanced"
    ] == pytest.approx(562 / 542)
    assert "balanced predicted only 3.7% faster than uniform, within the model's error" in text
    assert record["calibration_from"].endswith("calib.json")


def test_uniform_stays_when_the_link_sets_the_step():
    # Rank 1 on another host behind 1 kB/s: each micro-batch's 8 x 50 fp32 activations (1,600 bytes)
    # take 1.6 s whatever the cut, far above either stage's compute.
    parts, record, _ = plan(census(hosts=("a", "b")), links={"b": (1000.0, 0.0)})
    assert (
        parts == [0, 3, 6]
        and record["chosen"] == "uniform"
        and record["links_mbit"]["b"] == pytest.approx(8e-3)
    )
    assert record["predicted_step_s"]["balanced"] == pytest.approx(
        record["predicted_step_s"]["uniform"]
    )
    assert 1e3 * record["stage_link_s"][0] == pytest.approx(1600 + 0.2)  # and 0.2 ms a message


def test_a_split_that_fits_nowhere_is_refused_in_one_line():
    with pytest.raises(
        ConfigError,
        match=r"^--partition balanced: no split of the 6 layers into 2 "
        r"stages fits in "
        r"the ranks' free memory \(smallest usable 0.00 GiB\); use more stages",
    ):
        plan(census(free_gib=1e-6))


def test_the_runs_pipeline_is_the_candidate_only_when_balanced_is_asked_for(monkeypatch):
    from vit.run.cli import parse
    from vit.run.plan import make_plan
    from vit.runtime.dist_env import Job

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    job = Job(0, 2, 0, 2, "single")
    made = make_plan(
        parse(
            [
                "--engine",
                DS_PIPE,
                "--pipeline-stages",
                "2",
                "--partition",
                "balanced",
                "--micro-batch-size",
                "8",
                "--grad-accum",
                "4",
            ]
        ),
        job,
    )
    # pipeline.json: ZeRO-1
    assert made.balanced_candidate() == Candidate(DS_PIPE, 1, 2, 8, 4, "none")
    assert (
        make_plan(parse(["--engine", DS_PIPE, "--pipeline-stages", "2"]), job).balanced_candidate()
        is None
    )
