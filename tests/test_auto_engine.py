"""--engine auto (vit.planner.auto): what it leaves to the user, how a choice becomes a command
line, and a real run on 2 ranks that measures, ranks, chooses the model's first and trains with it
(the simulated hosts' test, with links and a slowed rank, is in test_cluster.py)."""

import json
import sys

import pytest
from helpers import gloo_pair, launch, plan_in_process, run_cmd, train_losses

from vit.checkpoints.checkpoint import MANIFEST_KEYS
from vit.core.costs import Candidate, Network
from vit.core.errors import ConfigError
from vit.core.paths import ROOT
from vit.engines.registry import spec
from vit.planner import auto, links
from vit.run.cli import parse
from vit.run.compat import PROVISIONAL, auto_allowed
from vit.run.plan import with_auto_choice


@pytest.mark.parametrize(
    "argv,option",
    [
        (["--comm-hook", "fp16"], "--comm-hook"),
        (["--pipeline-stages", "3"], "--pipeline-stages"),
        (["--ds-config", "deepspeed_configs/zero1.json"], "--ds-config"),
        (["--partition", "uniform"], "--partition"),
        (["--batch-split", "proportional"], "--batch-split"),
        # given at their defaults too: a user who says "no compression" must not get compression
        (["--pipeline-stages", "2"], "--pipeline-stages"),
        (["--partition", "parameters"], "--partition"),
        (["--batch-split", "equal"], "--batch-split"),
        (["--comm-hook=none"], "--comm-hook"),
        (["--pipeline-st", "2"], "--pipeline-stages"),  # argparse's abbreviation
    ],
)
def test_what_auto_chooses_is_refused_when_given_not_replaced(argv, option):
    with pytest.raises(
        ConfigError,
        match=f"^--engine auto chooses {option} itself; leave it out, or name an engine$",
    ):
        parse(["--engine", "auto", *argv])


def test_auto_refuses_what_it_does_not_plan_and_keeps_the_global_batch_options():
    for argv, message in [
        (["--micro-batch-size", "auto"], "chooses the micro-batch within the global batch"),
        (["--freeze", "schedule"], "does not plan freeze training yet"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse(["--engine", "auto", *argv])
    s = parse(
        [
            "--engine",
            "auto",
            "--micro-batch-size",
            "8",
            "--grad-accum",
            "2",
            "--simulate-slowdown",
            "1=2",
        ]
    )
    assert (
        s.parallel.engine == "auto"
        and s.parallel.micro_batch_size == 8
        and s.parallel.grad_accum == 2
    )
    # its global batch
    assert s.parallel.ds_config == parse(["--engine", PROVISIONAL]).parallel.ds_config


def test_a_candidate_runs_with_the_deepspeed_json_of_its_zero_stage_or_not_at_all():
    assert spec("zero").config_for(1, 1, 4) == "zero1.json"
    assert spec("zero").config_for(3, 1, 4) == "zero3.json"
    assert spec("ddp").config_for(0, 1, 4) == "zero0.json"
    assert spec("pipeline").config_for(1, 2, 4) == "pipeline.json"  # its JSON is ZeRO-1
    assert spec("pipeline").config_for(0, 2, 4) is None  # no pipeline JSON at ZeRO-0
    assert spec("pipeline").config_for(0, 4, 4) == "pipeline.json"  # no data parallelism: no ZeRO
    assert spec("async-pipeline").config_for(0, 2, 4) == "pipeline.json"
    assert all(
        (ROOT / "deepspeed_configs" / spec("zero").config_for(z, 1, 4)).is_file() for z in range(4)
    )


def test_a_tie_goes_to_the_plainest_and_a_clear_win_to_the_fastest():
    def cand(ms, compression="none", split=None, stages=1):
        return {"step_ms": ms, "compression": compression, "split": split, "stages": stages}

    runs = [
        cand(10.0, "bf16"),
        cand(10.1, split=[3, 1]),
        cand(10.15),
        cand(10.19, stages=2),
        cand(11.0),
    ]
    assert auto.pick(runs) is runs[2]  # within 2%: no compression, equal split, one stage
    runs = [cand(10.0, "bf16"), cand(10.5)]
    assert auto.pick(runs) is runs[0]  # 5% faster: the model's first


def test_what_changes_learning_is_chosen_only_when_allowed(monkeypatch):
    diloco, powersgd = Candidate("diloco", 0, 1, 32, 1), Candidate("ddp", 0, 1, 32, 1, "powersgd")
    stale = Candidate("async-pipeline", 0, 2, 32, 2)  # no flush: updates one step stale
    assert "the asynchronous pipeline changes what is learned" in auto.not_chosen(stale)
    assert auto.not_chosen(stale, frozenset({"async-pipeline"})) is None
    assert auto.not_chosen(Candidate("pipeline", 0, 2, 32, 2)) is None  # flushes: DDP's step
    assert "DiLoCo changes what is learned" in auto.not_chosen(diloco)
    assert "PowerSGD changes what is learned" in auto.not_chosen(powersgd)
    assert auto.not_chosen(diloco, frozenset({"diloco"})) is None
    assert "PowerSGD" in auto.not_chosen(powersgd, frozenset({"diloco"}))
    assert auto.not_chosen(powersgd, frozenset({"diloco", "powersgd"})) is None
    # the option is auto's: checked by name, refused with a named engine
    s = parse(["--engine", "auto", "--auto-allow", "diloco,powersgd"])
    assert s.parallel.engine == "auto" and auto_allowed(s) == {"diloco", "powersgd"}
    unknown = "^--auto-allow diloco,sgd: sgd is not one of async-pipeline, diloco, powersgd$"
    with pytest.raises(ConfigError, match=unknown):
        parse(["--engine", "auto", "--auto-allow", "diloco,sgd"])
    with pytest.raises(ConfigError, match="--auto-allow .*--engine auto"):
        parse(["--engine", "ddp", "--auto-allow", "diloco"])
    # chosen, diloco runs as `--engine diloco` would, with its wire
    argv = ["--engine", "auto", "--auto-allow", "diloco"]
    plan = plan_in_process(monkeypatch, argv, world_size=2)
    choice = {"engine": "diloco", "zero_stage": 0, "stages": 1, "micro_batch": 32, "grad_accum": 1}
    choice |= {"split": None, "parts": None, "compression": "outer-int8"}
    chosen = with_auto_choice(plan, {"choice": choice})
    assert (
        chosen.settings.parallel.engine == "diloco" and chosen.settings.local.outer_wire == "int8"
    )
    assert chosen.shape["engine"] == "diloco" and chosen.settings.parallel.auto_allow == ""


def test_ranks_of_one_machine_share_its_contention():
    reports = [
        {"machine": "a", "contention": 1.0},
        {"machine": "a", "contention": 2.1},  # a burst of background load while it was timed
        {"machine": "b", "contention": 1.0},
    ]
    assert [r["contention"] for r in auto.machine_contention(reports)] == [1.55, 1.55, 1.0]


def test_links_measured_from_the_first_host_give_each_hosts_rate():
    reports = [{"host": "a"}, {"host": "a"}, {"host": "b"}, {"host": "c"}]
    net = links.network(reports, {"b": (100e6, 2e-4), "c": (50e6, 4e-4)})
    assert net.host_bytes_s == {"b": 100e6, "c": 50e6, "a": 100e6}
    assert net.latency_s == pytest.approx(3e-4) and net.bytes_s("a", "c") == 50e6
    one = links.network(reports[:2], {})
    assert one.host_bytes_s == {} and one.same_host_bytes_s == Network.same_host_bytes_s


def test_auto_resume_refuses_a_checkpoint_of_a_named_engine(tmp_path, monkeypatch):
    step = tmp_path / "run" / "checkpoints" / "step2"
    step.mkdir(parents=True)
    manifest = dict.fromkeys(MANIFEST_KEYS, 1) | {"files": {}, "engine": "zero", "step": 2}
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as e:
        plan_in_process(monkeypatch, ["--engine", "auto", "--resume", step])
    assert str(e.value) == (
        f"--engine auto --resume: checkpoint {step} is of a run that named its engine; resume it "
        "with --engine zero"
    )


@pytest.mark.ranks
@pytest.mark.timeout(500)
def test_auto_on_two_ranks_runs_the_models_first_and_gives_a_slowed_rank_less_work(tmp_path):
    """... and `--engine auto --resume` (what scripts/retry.sh adds) goes on as it chose, measuring
    nothing again, with the same losses as the run it resumes."""
    log_dir = tmp_path / "logs"
    common = ["--engine", "auto", "--simulate-slowdown", "1=3", "--steps", 4, "--eval-interval", 0]
    common += ["--log-interval", 1, "--monitor-interval", 0]
    r = launch([*common, "--save-interval", 2, "--log-dir", log_dir], timeout=240)
    assert r.ok, r
    resumed = tmp_path / "resumed"
    step2 = log_dir / "checkpoints" / "step2"
    again = launch([*common, "--resume", step2, "--log-dir", resumed], timeout=240)
    assert again.ok, again
    assert "engine auto chose" not in again.outputs[0]
    assert train_losses(resumed) == {s: v for s, v in train_losses(log_dir).items() if s > 2}
    first = json.loads((log_dir / "config.json").read_text())["engine_auto"]
    second = json.loads((resumed / "config.json").read_text())["engine_auto"]
    assert second == {**first, "resumed_from": str(step2)}
    # on one rank (retry.sh after a host is gone): chosen again among what takes the checkpoint
    chosen_again_on_one_rank(tmp_path, common, log_dir)
    config = json.loads((log_dir / "config.json").read_text())
    record, summary = config["engine_auto"], json.loads((log_dir / "summary.json").read_text())
    rows, choice = record["candidates"], record["choice"]
    local = [c for c in rows if c["engine"] == "diloco"]  # listed, never chosen for the user
    assert local and all(
        "DiLoCo changes what is learned" in c["not_chosen"] for c in local if c["fits"]
    )
    assert (
        # auto chooses among what fits and runs, leaving to the user what changes what is learned
        auto.pick(
            [c for c in rows if c["fits"] and c["runs"] and "learned" not in str(c["not_chosen"])]
        )
        == choice
    )
    # each one ranked above it says why not
    assert all(c["not_chosen"] for c in rows[: rows.index(choice)])
    assert (
        choice["fits"]
        and f"engine auto chose #{rows.index(choice) + 1}: {choice['candidate']}" in r.outputs[0]
    )
    assert summary["engine"] == choice["engine"] and summary["micro_batch"] == choice["micro_batch"]
    # zero2.json's 32 x 2
    assert summary["grad_accum"] == choice["grad_accum"] and summary["global_batch"] == 64
    assert (summary["pipeline_stages"] or 1) == choice["stages"]
    # how long planning takes is bench planner's to print ("planned in"), not a bound here: 36 s
    # on three pytest workers sharing two cores
    assert record["links_mbit"] == {} and record["planning_s"] > 0
    # each rank's layer times at once over alone (predict.busy_slots), and the census's machine: one
    # kernel here: both ranks the machine's one contention
    contention = record["contention"]
    assert len(contention) == 2 and contention[0] == contention[1] >= 1.0
    census = json.loads((log_dir / "cluster.json").read_text())["census"]
    assert len({rank["machine"] for rank in census}) == 1 and census[0]["machine"]
    # the offline planner on this run ranks with what auto measured (it disagreed 3.5x without)
    planner = run_cmd([sys.executable, "-m", "vit.planner", str(log_dir), "--top", "3"], 120)
    assert planner.returncode == 0, planner.stdout + planner.stderr
    assert "; contention, links, fixed costs from the run's engine_auto" in planner.stdout
    # Rank 1 computes 3x slower: the choice gives it less than half of the work.
    flops, micro = record["layer_flops"], choice["micro_batch"]
    if choice["stages"] == 1:
        work = [(choice["split"] or [micro, micro])[k] * sum(flops) for k in range(2)]
    else:
        parts = choice["parts"]
        work = [micro * sum(flops[parts[k] : parts[k + 1]]) for k in range(2)]
    assert work[1] < work[0], (choice["candidate"], work)


def chosen_again_on_one_rank(tmp_path, common: list, log_dir) -> None:
    """`--engine auto --resume` of a 2-rank run's checkpoint on 1 rank: auto chooses again among
    the candidates that can take it, the global batch kept, the losses the 2-rank run's."""
    one, step2 = tmp_path / "one", log_dir / "checkpoints" / "step2"
    common = [a for a in common if a not in ("--simulate-slowdown", "1=3")]
    r1 = launch([*common, "--resume", step2, "--log-dir", one], nprocs=1, timeout=240)
    assert r1.ok, r1
    assert (
        f"--engine auto --resume: chosen for 2 ranks, 1 here: choosing again among the engines "
        f"that can take {step2}"
    ) in r1.outputs[0]
    assert "engine auto chose #" in r1.outputs[0]
    again1 = json.loads((one / "config.json").read_text())["engine_auto"]
    assert again1["resumed_from"] == str(step2) and len(again1["contention"]) == 1
    refused = [c for c in again1["candidates"] if "cannot resume the --engine zero" in str(c)]
    assert refused and all(c["engine"] != "zero" or c["zero_stage"] != 0 for c in refused)
    assert again1["choice"] not in refused and again1["choice"]["engine"] == "zero"
    got, want = train_losses(one), train_losses(log_dir)
    assert sorted(got) == [3, 4] and all(got[s] == pytest.approx(want[s], rel=1e-4) for s in got)


def test_the_planner_from_a_hostfile_refuses_bad_input_in_one_line(tmp_path, capsys):
    from vit.planner import cli

    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost slots=two\n")
    both = "give a run's log dir or --hostfile, one of the two"
    for argv, message in [
        ([], both),
        (["logs/run", "--hostfile", str(hosts)], both),
        (["logs/run", "--", "--steps", "3"], "vit.train options after -- go with --hostfile"),
        (
            ["--hostfile", str(hosts), "--json", str(tmp_path)],
            f"--json {tmp_path}: a folder; give a file's path",
        ),
        (
            ["logs/run", "--json", "/no/such/x.json"],
            "--json /no/such/x.json: its folder /no/such does not exist",
        ),
        (
            ["--hostfile", str(hosts), "--link-mbit", "100"],
            "--link-mbit plans "
            "from a run's census; "
            "with --hostfile the ranks measure (vit.train options such as --model "
            "go after --)",
        ),
    ]:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and capsys.readouterr().err == f"{cli.PROG}: error: {message}\n"
    for argv, message in [
        (["--hostfile", str(tmp_path / "none")], f"--hostfile {tmp_path / 'none'}: No such file"),
        (["--hostfile", str(hosts)], f"hostfile {hosts}, line 1: slots=two is not a whole number"),
    ]:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{cli.PROG}: error: ") and message in err and err.count("\n") == 1, (
            err
        )


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_the_planner_measures_every_slot_of_a_hostfile_and_trains_nothing(tmp_path):
    hosts, out, log_dir = tmp_path / "hosts.txt", tmp_path / "plan.json", tmp_path / "run"
    hosts.write_text("localhost slots=2\n")
    cmd = [
        sys.executable,
        "-m",
        "vit.planner",
        "--hostfile",
        hosts,
        "--json",
        out,
        "--",
        "--model",
        "vit_digits",
        "--dataset",
        "synthetic",
        "--micro-batch-size",
        16,
        "--log-dir",
        log_dir,
    ]
    r = run_cmd([str(c) for c in cmd], timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads(out.read_text())
    rows, choice = record["candidates"], record["choice"]
    assert len(rows) > 10 and choice in rows and record["precision"] == "fp32"
    assert f"engine auto chose #{rows.index(choice) + 1}: {choice['candidate']}" in r.stdout
    assert f"planned only, nothing trained; the table and the choice are in {out}" in r.stdout
    assert "VIT_ENGINE_AUTO" not in r.stdout + r.stderr  # no internal variable's name
    # 16 x 2 ranks
    assert choice["micro_batch"] * choice["grad_accum"] * 2 // choice["stages"] == 32
    assert not log_dir.exists()  # nothing trained, nothing written


CONTENTION_RANK = """
import json, sys
from types import SimpleNamespace
import torch.distributed as dist
from vit.planner import auto
rank, store, machine = int(sys.argv[1]), sys.argv[2], sys.argv[3]
together, alone = json.loads(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
shared, n = machine == "shared", {"calls": 0}
def time_all():  # the layer times of each pair: at once, then alone (where the machine is shared)
    i = n["calls"]
    n["calls"] += 1
    return [[together[i]]] if not shared else [[(together if i % 2 == 0 else alone)[i // 2]]]
job = SimpleNamespace(rank=rank, world_size=2)
reports = auto.measure_contention(job, {"machine": machine}, time_all)
print(json.dumps({"calls": n["calls"], "contention": [r["contention"] for r in reports]}))
"""


@pytest.mark.ranks
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "machine,together,calls,contention",
    [
        ("shared", [2.0, 3.0, 3.1], 6, 3.1),  # 2.0, then 3.0 (moved 50%), then 3.1: settled
        ("shared", [2.0, 2.1, 9.0], 4, 2.1),  # 2.0, then 2.1: settled at once
        ("own", [2.0, 3.0, 3.1], 1, 1.0),  # a rank alone on its machine cannot share
    ],
    ids=["settles in three", "settles in two", "one rank a machine"],
)
def test_contention_is_measured_again_until_it_settles(
    tmp_path, machine, together, calls, contention
):
    """Two gloo ranks of auto.measure_contention, the layer times given (1.0 alone): another pair of
    measurements (at once, then one rank at a time) while the contention moves by more than 10%."""
    outs = gloo_pair(
        CONTENTION_RANK,
        tmp_path / "store",
        lambda r: machine if machine == "shared" else f"own{r}",
        json.dumps([together, [1.0] * 3]),
    )
    for out in outs:
        got = json.loads(out.strip().splitlines()[-1])
        assert got == {"calls": calls, "contention": [contention, contention]}, got
