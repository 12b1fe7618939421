"""Freeze training (--freeze): the rules of vit/freeze/freezer.py, and real 2-rank runs whose
engines are rebuilt in place at each freeze point compared with the single-process loop that freezes
the same layers after the same steps."""

import json
import re
import shlex
import sys

import pytest
import torch
from helpers import (
    assert_losses,
    launch,
    plan_in_process,
    plugin_env,
    read_jsonl,
    run_cmd,
    train_losses,
)
from torch import nn

from vit.core.errors import ConfigError
from vit.core.layout import Layout
from vit.engines.registry import NAMES, spec
from vit.freeze import activation_cache
from vit.freeze.activation_cache import FeatureCache
from vit.freeze.freezer import Freezer, freeze_prefix
from vit.freeze.measures import WeightMoves, changes
from vit.freeze.replan import replan
from vit.freeze.rules import by_measure, next_measure, scheduled
from vit.model.layers import build_layers
from vit.planner import stages
from vit.run.cli import defaults, parse
from vit.training.reference import reference_losses

# vit_digits on the digits: 22 steps per epoch at a global batch of 64, so 0.1 epochs is a freeze
# point every 2 steps; 5 freezable layers (embedding, 4 blocks) and alpha 1/3 freeze 2, 3, 4, 5 of
# them at points 1, 2, 3, 4.
FREEZE = "--freeze schedule --freeze-interval-epochs 0.1"


def test_schedule_is_the_released_rule():
    assert [scheduled(e, 5, 1 / 3) for e in range(6)] == [0, 2, 3, 4, 5, 5]
    assert [scheduled(e, 12, 1 / 3) for e in range(4)] == [
        0,
        4,
        7,
        9,
    ]  # ViT-B/16: ceil(12 (1 - (2/3)^e))
    assert scheduled(1, 5, 1.0) == 5


def test_gradient_change_is_relative_to_the_previous_decision_point():
    assert changes([1.0, 2.0, 4.0], [1.0, 1.0, 5.0]) == [0.0, 0.5, 0.25]


def test_gradient_rule_freezes_the_settled_prefix_at_most_alpha_and_the_schedule():
    settled = [0.01, 0.02, 0.03, 0.04, 0.05, 0.06]
    assert by_measure(settled, 0, 0.1, 1 / 3, allowed=6) == 2  # 2 of 6 = alpha of the active layers
    assert by_measure(settled, 0, 0.1, 0.1, allowed=6) == 1  # at most alpha, at least one
    assert by_measure(settled, 0, 0.1, 1.0, allowed=3) == 3  # never past the schedule's count
    assert by_measure(settled, 2, 0.1, 1.0, allowed=2) == 2
    # The prefix rule: layers 1-5 settled behind layer 0 still learning do not freeze; nor does
    # layer 3 behind 2.
    assert by_measure([0.5, 0.0, 0.0, 0.0, 0.0, 0.0], 0, 0.1, 1.0, allowed=6) == 0
    assert by_measure([0.0, 0.0, 0.3, 0.0, 0.0, 0.0], 0, 0.1, 1.0, allowed=6) == 2
    assert (
        by_measure([0.0, 0.0, 0.1, 0.0, 0.0, 0.0], 0, 0.1, 1.0, allowed=6) == 2
    )  # at the threshold: learning


def test_the_decision_line_names_the_next_layers_measure():
    assert next_measure([0.0, 0.3, 0.0], 1, 0.1, 3) == "next: layer 1, gradient change 0.3 >= 0.1"
    assert next_measure([0.0, 0.05, 0.0], 1, 0.1, 3) == "next: layer 1, gradient change 0.05 < 0.1"
    assert next_measure(None, 0, 0.1, 3).startswith("next: layer 0, no gradient change yet")
    assert (
        next_measure(None, 3, 0.1, 3)
        == next_measure([0.0] * 3, 3, 0.1, 3)
        == "all freezable layers frozen"
    )
    assert (
        next_measure([0.0, 0.42, 1.0], 1, 0.5, 3, "settled")
        == "next: layer 1, weights moved 0.42 of their "
        "fastest < 0.5"
    )
    assert (
        next_measure(None, 1, 0.5, 3, "settled")
        == "next: layer 1, no weight move over a whole interval yet "
        "(resumed)"
    )


def test_a_replan_that_halves_the_micro_batches_keeps_the_measure_on_one_scale():
    f = Freezer(
        defaults().with_(freeze="grad").freeze,
        num_layers=3,
        steps_per_epoch=10,
        total_steps=100,
        device=torch.device("cpu"),
    )
    f.previous = [1.0, 2.0]
    f.rescale(
        Layout(2, [0, 2, 3], 4), Layout(1, [0, 3], 2)
    )  # 2 stages of 4 micro-batches: 1 stage x 2 copies of 2
    assert f.previous == [2.0, 4.0]
    f.rescale(Layout(1, [0, 3], 2), Layout(1, [0, 3], 2))
    assert f.previous == [2.0, 4.0]


def replay(history: list[list[float]], rule: str = "grad", **options) -> list[int]:
    """The frozen count after each decision point of a Freezer fed a synthetic history of per-layer
    gradient norms (grad) or weight moves as a share of the largest (settled), one entry per
    decision point, a decision every step."""
    s = defaults().with_(freeze=rule, freeze_interval_epochs=0.1, **options).freeze
    f = Freezer(
        s,
        num_layers=len(history[0]) + 1,
        steps_per_epoch=10,
        total_steps=1000,
        device=torch.device("cpu"),
    )
    measure = iter(history).__next__
    if rule == "settled":  # WeightMoves.take without ranks or an engine
        f.moves = type("Moves", (), {"take": staticmethod(lambda engine, step: measure())})()
    else:  # GradNorms.take without ranks
        f.norms = type("Norms", (), {"take": staticmethod(measure)})()
    counts = []
    for step in range(1, len(history) + 1):
        f.decide(step)
        counts.append(f.frozen)
    return counts


def test_gradient_rule_freezes_nothing_while_gradients_still_change():
    # Every layer's norm falls by 30% an interval (a model still learning), the embedding's fastest.
    history = [[3.0 * 0.6**e] + [1.0 * 0.7**e] * 4 for e in range(8)]
    assert replay(history) == [0] * 8
    assert replay(history, freeze_alpha=1.0) == [0] * 8


def test_gradient_rule_freezes_a_prefix_once_gradients_settle():
    # Falling for 3 intervals, then within 2% of the last one: a layer a decision point once it has
    # settled.
    history = [[0.5 ** min(e, 3) * (1 + 0.02 * (e % 2))] * 5 for e in range(9)]
    # Nothing to compare at the first point; still learning at the next 3; then alpha 1/3 of the
    # active at a time.
    assert replay(history) == [0, 0, 0, 0, 1, 2, 3, 4, 5]
    # Only the front settles (layers 2-4 keep learning): the prefix stops at layer 2.
    front = [[1.0, 1.0] + [0.7**e] * 3 for e in range(6)]
    assert replay(front, freeze_alpha=1.0) == [0, 2, 2, 2, 2, 2]


def test_gradient_rule_never_freezes_more_than_the_schedule():
    gen = torch.Generator().manual_seed(0)
    for alpha in (0.2, 1 / 3, 0.5, 1.0):
        for _ in range(20):
            history = (1 + 0.2 * torch.rand(8, 6, generator=gen)).tolist()
            got = replay(history, freeze_alpha=alpha, freeze_threshold=0.5)
            assert all(n <= scheduled(e + 1, 6, alpha) for e, n in enumerate(got)), (alpha, got)
            assert got == sorted(got)


def test_settled_rule_freezes_nothing_while_weights_still_move():
    # Each interval every layer moves 7% less than in the one before: at 0.70 of its fastest after 5
    # intervals.
    history = [[0.93**e] * 5 for e in range(6)]
    assert replay(history, "settled") == [0] * 6  # the default threshold, 0.65
    assert replay(history, "settled", freeze_alpha=1.0) == [0] * 6
    assert replay(history, "settled", freeze_threshold=0.75, freeze_alpha=1.0) == [0, 0, 0, 0, 5, 5]


def test_settled_rule_freezes_a_prefix_once_weights_settle():
    history = [[1.0] * 5, [0.8] * 5, [0.4] * 5, [0.3] * 5, [0.2] * 5, [0.1] * 5]
    # Below 0.65 of their fastest from the third point; then alpha 1/3 of the active layers (at
    # least one) at a time.
    assert replay(history, "settled") == [0, 0, 1, 2, 3, 4]
    # Only the front settles: the prefix stops at the first layer still moving, though layer 3
    # behind it settled.
    front = [[0.1, 0.2, 0.9, 0.1, 1.0]] * 4
    assert replay(front, "settled", freeze_alpha=1.0) == [2] * 4


def test_settled_rule_never_freezes_more_than_the_schedule():
    gen = torch.Generator().manual_seed(0)
    for alpha in (0.2, 1 / 3, 0.5, 1.0):
        for _ in range(20):
            got = replay(torch.rand(8, 6, generator=gen).tolist(), "settled", freeze_alpha=alpha)
            assert all(n <= scheduled(e + 1, 6, alpha) for e, n in enumerate(got)), (alpha, got)
            assert got == sorted(got)


def test_weight_moves_are_a_share_of_each_layers_largest_move_per_unit_of_learning_rate(tmp_path):
    """||W_now - W_then|| / ||W_then|| / (the interval's learning rates summed) per layer, over the
    freezable layers (not the head), against the largest so far; frozen layers count 0; a copy
    younger than an interval (a resume) or an interval at learning rate 0 measures nothing."""
    import contextlib

    import torch.distributed as dist

    module = nn.Sequential(
        nn.Linear(1, 2, bias=False), nn.Linear(2, 2, bias=False), nn.Linear(2, 1)
    )
    holder = type(
        "Engine",
        (),
        {
            "device": torch.device("cpu"),
            "gathered": lambda self: contextlib.nullcontext(),
            "live_module": lambda self: module,
        },
    )()  # what WeightMoves asks of an engine
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with torch.no_grad():
            module[0].weight.copy_(torch.tensor([[3.0], [4.0]]))  # norm 5
            moves = WeightMoves(num_freezable=2, interval_steps=2)
            moves.snapshot(holder, 0)
            module[0].weight += torch.tensor(
                [[0.3], [0.4]]
            )  # moved 0.5 of 5 at learning rates 0.5 + 0.5: 0.1
            module[2].weight += 1.0  # the head: not measured
            moves.stepped(0.5), moves.stepped(0.5)
            assert moves.take(holder, 2) == pytest.approx([1.0, 0.0])
            module[0].weight += torch.tensor(
                [[0.15], [0.2]]
            )  # 0.25 of 5.5 at 0.25 + 0.25: 0.0909 against 0.1
            module[1].weight += 0.1
            moves.stepped(0.25), moves.stepped(0.25)
            assert moves.take(holder, 4) == pytest.approx([0.25 / 5.5 / 0.5 / 0.1, 1.0])
            assert moves.peak[0] == pytest.approx(0.1) and moves.peak[1] > 0
            moves.stepped(0.5)
            assert (
                moves.take(holder, 5) is None
            )  # one step after the last copy: not a whole interval
            moves.stepped(0.0), moves.stepped(0.0)
            assert moves.take(holder, 7) is None  # learning rate 0: nothing to measure
            module[0].weight.requires_grad_(False)  # frozen
            module[1].weight += 0.1
            moves.stepped(1.0), moves.stepped(1.0)
            shares = moves.take(holder, 9)
            assert shares[0] == 0.0 and 0 < shares[1] <= 1.0
    finally:
        dist.destroy_process_group()


@pytest.mark.ranks
@pytest.mark.timeout(200)
@pytest.mark.parametrize("rule", ["grad", "schedule", "settled"])
def test_each_decision_says_what_froze_and_the_next_layers_measure(tmp_path, rule):
    """One rank, 4 steps an interval: a decision at steps 4 and 8. grad with a threshold every layer
    is under freezes nothing first (nothing to compare yet), then layer 0; settled, whose first
    interval is its own fastest move, layer 0 then layer 1 (alpha 1/3 of the active layers at a
    time); the schedule freezes 2 then 3 layers and warns once when layer 2 still learns."""
    threshold = 1e-6 if rule == "schedule" else 10
    args = shlex.split(
        f"--engine ddp --freeze {rule} --freeze-interval-epochs 0.1 --steps 9 --no-save "
        f"--freeze-threshold {threshold}"
    )
    r = run_cmd([sys.executable, "-m", "vit.train", *args, "--log-dir", tmp_path], timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    said = re.findall(r"^freeze at step (\d+): (.*)$", r.stdout, re.MULTILINE)
    first = (
        "next: layer {}, no gradient change yet (the first interval has nothing to compare with)"
    )
    if rule == "grad":
        assert [s for s, _ in said] == ["4", "8"] and said[0][
            1
        ] == f"nothing frozen ({first.format(0)})", said
        assert re.match(
            r"layer 0 frozen \(next: layer 1, gradient change [0-9.e-]+ < 10\); 1 stages",
            said[1][1],
        )
        assert [(x["step"], x["frozen"], x["threshold"]) for x in freeze_records(tmp_path)] == [
            (8, 1, 10)
        ]
    elif rule == "settled":
        assert said[0][1].startswith(
            "layer 0 frozen (next: layer 1, weights moved 1 of their fastest < 10); "
        ), said
        assert re.match(
            r"layers 0-1 frozen \(next: layer 2, weights moved 0?\.[0-9]+ of their fastest < 10\)",
            said[1][1],
        ), said
        assert [(x["step"], x["frozen"]) for x in freeze_records(tmp_path)] == [(4, 1), (8, 2)]
    else:
        assert said[0][1].startswith(f"layers 0-1 frozen ({first.format(2)})"), said
        assert re.match(
            r"layers 0-2 frozen \(next: layer 3, gradient change [0-9.e-]+ >= 1e-06\)", said[1][1]
        )
        warnings = [
            line
            for line in r.stdout.splitlines()
            if line.startswith("warning: the freeze schedule")
        ]
        assert (
            len(warnings) == 1 and "freezes layer 2 at step 8 while it still learns" in warnings[0]
        ), warnings
        assert [(x["step"], x["frozen"]) for x in freeze_records(tmp_path)] == [(4, 2), (8, 3)]


def test_frozen_layers_keep_no_graph_and_take_no_gradient():
    layers = build_layers("vit_digits", 10, 1, 8)
    freeze_prefix(layers, 2)
    x = torch.randn(2, 1, 8, 8, requires_grad=True)
    h = layers[1](layers[0](x))
    assert h.grad_fn is None  # no activations kept for a backward, even for an input that wants one
    assert not any(p.requires_grad for layer in layers[:2] for p in layer.parameters())
    assert all(p.requires_grad for layer in layers[2:] for p in layer.parameters())


def test_freezer_decides_at_interval_ends_only_when_more_freeze():
    f = Freezer(
        defaults().with_(freeze="schedule", freeze_interval_epochs=0.1).freeze,
        num_layers=6,
        steps_per_epoch=22,
        total_steps=12,
        device=torch.device("cpu"),
    )
    f.norms = type("Norms", (), {"take": staticmethod(lambda: [1.0] * 5)})()  # settled: no warning
    assert [(s, f.decide(s)) for s in range(1, 13)] == [
        (1, None),
        (2, 2),
        (3, None),
        (4, 3),
        (5, None),
        (6, 4),
        (7, None),
        (8, 5),
        (9, None),
        (10, None),
        (11, None),
        (12, None),
    ]  # all 5 frozen after step 8; none at the last step
    assert f.frozen == 5


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--freeze-alpha", "1.5"], "--freeze-alpha must be at most 1"),
        (
            ["--freeze", "schedule", "--engine", "pipeline", "--model-ema"],
            "--model-ema does not follow a pipeline",
        ),
        (["--freeze", "sometimes"], "argument --freeze: invalid choice"),
    ],
)
def test_bad_freeze_settings(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(argv)


def reference(steps: int, freeze_after: dict, **recipe) -> list[float]:
    return reference_losses(
        defaults().with_(**recipe), 64, steps, clip=1.0, freeze_after=freeze_after
    )


def freeze_records(log_dir, rank: int = 0) -> list[dict]:
    return [r for r in read_jsonl(log_dir / f"metrics_rank{rank}.jsonl") if r["kind"] == "freeze"]


def assert_released(log_dir) -> None:
    """Every freeze point freed the old engine's module before it built the new one, and left no
    more process groups than the first freeze point did, on both ranks."""
    for rank in (0, 1):
        records = freeze_records(log_dir, rank)
        assert records and all(x["old_engine_freed"] for x in records), records
        assert len({x["process_groups"] for x in records}) == 1, records


def train(log_dir, args: str, *paths, timeout: float = 240, env=None):
    """2 ranks of `vit.train ARGS PATHS` (ARGS as typed on a command line), a loss logged at every
    step into log_dir; they must succeed."""
    r = launch(
        [*shlex.split(args), *paths, "--log-interval", 1, "--log-dir", log_dir],
        timeout=timeout,
        env=env,
    )
    assert r.ok, r
    return r


@pytest.mark.ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine,config", [("zero", "zero2.json"), ("ddp", "zero0.json")])
def test_freeze_schedule_matches_single_process_loop(tmp_path, engine, config):
    # Micro-steps and layer-wise LR decay too: the rebuilt optimizer has fewer parameter groups.
    # ZeRO's state crosses to the rebuilt engine in chunks of 97 elements (2**24 by default), so
    # that chunk boundaries fall inside parameters and between the ranks' partitions.
    train(
        tmp_path,
        f"--engine {engine} --ds-config deepspeed_configs/{config} --micro-batch-size 16 "
        f"--grad-accum 2 --layer-decay 0.8 --steps 6 --no-save {FREEZE}",
        env=plugin_env(handover_chunk="97"),
    )
    for rank in (0, 1):
        assert [
            (x["step"], x["frozen"], x["stages"], x["dp"], x["cache"])
            for x in freeze_records(tmp_path, rank)
        ] == [
            (2, 2, 1, 2, False),
            (4, 3, 1, 2, False),
        ]  # the digits' default crop: auto does not cache
    assert_released(tmp_path)
    want = reference(6, {2: 2, 4: 3}, layer_decay=0.8)
    assert_losses(train_losses(tmp_path), want, range(1, 7))
    assert want[4:] != pytest.approx(
        reference(6, {}, layer_decay=0.8)[4:], rel=2e-4
    )  # freezing shows


@pytest.mark.ranks
@pytest.mark.timeout(420)
@pytest.mark.parametrize("engine", [n for n in NAMES if spec(n).freeze and not spec(n).pipeline])
def test_resume_across_and_between_freeze_points(tmp_path, engine):
    full = tmp_path / "full"
    common = f"--engine {engine} --steps 8 {FREEZE}"
    train(full, f"{common} --save-interval 3", timeout=200)
    points = [(x["step"], x["frozen"]) for x in freeze_records(full)]
    assert points == [(2, 2), (4, 3), (6, 4)]
    # step3: in the middle of the phase that froze 2 layers at step 2; step6: the freeze point to 4
    # layers.
    for start in (3, 6):
        resumed = tmp_path / f"from{start}"
        checkpoint = full / "checkpoints" / f"step{start}"
        train(resumed, f"{common} --no-save --resume", checkpoint, timeout=200)
        want = train_losses(full)
        assert_losses(train_losses(resumed), [want[s] for s in range(1, 9)], range(start + 1, 9))
        assert [(x["step"], x["frozen"]) for x in freeze_records(resumed)] == [
            p for p in points if p[0] > start
        ]


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_freeze_by_measure_decides_alike_everywhere_and_matches_the_loop(tmp_path):
    train(tmp_path, "--engine ddp --steps 8 --no-save --freeze grad --freeze-interval-epochs 0.05")
    points = [(x["step"], x["frozen"]) for x in freeze_records(tmp_path)]
    assert points and points == [(x["step"], x["frozen"]) for x in freeze_records(tmp_path, 1)]
    assert_losses(train_losses(tmp_path), reference(8, dict(points)), range(1, 9))


# Every engine that freezes, the pipeline with and without re-planning. At alpha 1/2 the schedule
# freezes 3 then 4 layers at steps 2 and 4; the pipeline that keeps its layout caps that at 2 (its
# first stage, layers 0-2, keeps one active), and then nothing more can freeze: no decision at step
# 4.
FREEZING_ENGINES = {
    "zero": "--engine zero",
    "ddp": "--engine ddp",
    "pipeline": "--engine pipeline",
    "pipeline, replan off": "--engine pipeline --freeze-replan off",
}


@pytest.mark.ranks
@pytest.mark.timeout(200)
# The schedule on every engine (each rebuild); the measured rules where a layer's weights and
# gradients are gathered differently (ZeRO-2's partitions, a pipeline's stages), settled also where
# the capped schedule stops it.
@pytest.mark.parametrize(
    "engine,rule",
    [
        *((engine, "schedule") for engine in FREEZING_ENGINES),
        ("zero", "settled"),
        ("pipeline", "settled"),
        ("pipeline, replan off", "settled"),
        ("zero", "grad"),
        ("pipeline", "grad"),
    ],
)
def test_the_rules_on_the_freezing_engines_say_each_decision_and_match_the_loop(
    tmp_path, engine, rule
):
    # settled under a threshold every move is below: alpha 1/2 of the active layers at a time, 2
    # then 3 layers.
    threshold = "--freeze-threshold 10" if rule == "settled" else ""
    r = train(
        tmp_path,
        f"{FREEZING_ENGINES[engine]} --freeze {rule} --freeze-alpha 0.5 --freeze-interval-epochs "
        f"0.1 {threshold} --steps 5 --no-save",
        timeout=160,
    )
    points = [(x["step"], x["frozen"]) for x in freeze_records(tmp_path)]
    assert points == [(x["step"], x["frozen"]) for x in freeze_records(tmp_path, 1)]
    decisions = [
        [
            x
            for x in read_jsonl(tmp_path / f"metrics_rank{rank}.jsonl")
            if x["kind"] == "freeze_decision"
        ]
        for rank in (0, 1)
    ]
    assert [x["changes"] for x in decisions[0]] == [
        x["changes"] for x in decisions[1]
    ]  # measured alike
    capped = engine == "pipeline, replan off"
    if (
        rule == "settled"
    ):  # every layer's first move is its fastest; the next a share of it, one stage's or another's
        assert points == ([(2, 2)] if capped else [(2, 2), (4, 3)])
        assert decisions[0][0]["changes"] == [1.0] * 5, decisions
        assert capped or all(0 < x <= 1 for x in decisions[0][1]["changes"][2:]), decisions
    elif rule == "schedule":
        assert points == ([(2, 2)] if capped else [(2, 3), (4, 4)])
    else:  # the first decision has no previous interval to compare with
        assert (
            points in ([], [(4, 1)], [(4, 2)])
            and "freeze at step 2: nothing frozen (next: layer 0, no "
            "gradient change yet (the first interval has nothing to compare with))"
            in r.outputs[0]
        ), r.outputs[0]
    # One console line per decision: what froze, or why nothing did.
    said = re.findall(r"^freeze at step (\d+): (.*)$", r.outputs[0], re.MULTILINE)
    assert [int(step) for step, _ in said] == ([2] if capped else [2, 4]), said
    assert all(
        line.startswith("nothing frozen") == (int(step) not in dict(points)) for step, line in said
    ), said
    assert_losses(train_losses(tmp_path), reference(5, dict(points)), range(1, 6))


@pytest.mark.ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine,config", [("pipeline", "pipeline.json"), ("zero", "zero0.json")])
def test_freeze_in_bf16_moves_deepspeeds_fp32_weights_and_adam_state(tmp_path, engine, config):
    # bf16 gives the pipeline DeepSpeed's BF16_Optimizer (fp32 weights flat and partitioned, like
    # ZeRO's) and ZeRO stage 0 its FP16_UnfusedOptimizer (an fp32 copy of each parameter); both are
    # rebuilt at each freeze point.
    r = train(
        tmp_path,
        f"--engine {engine} --ds-config deepspeed_configs/{config} --precision bf16 --steps 6 "
        f"--no-save {FREEZE}",
    )
    assert "precision bf16" in r.outputs[0], r.outputs[0]
    assert [(x["step"], x["frozen"]) for x in freeze_records(tmp_path)] == [(2, 2), (4, 3)]
    assert_released(tmp_path)
    # bf16 weights and activations against the fp32 loop: within 0.5% (measured: at most 0.3%).
    assert_losses(train_losses(tmp_path), reference(6, {2: 2, 4: 3}), range(1, 7), rel=5e-3)


def census(free_gib: float, layers: int = 6) -> dict:
    """hetero.adapt's record for 2 ranks: every layer 1 ms forward and 2 ms backward at micro-batch
    4, 1 MiB of trained state (1/4 of it weights) and 1 MiB of activations at micro-batch 4."""
    mib = 2**20
    reports = [
        {
            "host": f"cn{r}",
            "device": "CPU",
            "mem_free_gib": free_gib,
            "layer_ms": [[1.0, 2.0]] * layers,
            "layer_ms_micro_batch": 4,
        }
        for r in range(2)
    ]
    return {
        "census": reports,
        "layers": [{"name": "Block", "params": mib / 16, "act_bytes": mib / 4}] * layers,
        "state_bytes_per_param": 16,
    }


def test_replan_moves_the_cut_by_measured_times_and_halves_only_when_memory_allows():
    start = Layout(2, [0, 3, 6], 4)
    roomy = census(free_gib=1.0)
    # 2 frozen layers at their forward only (1 ms) pull a third layer into the first stage: 1+1+3+3
    # | 3+3 ms.
    layout, plan = replan(roomy, 2, Layout(2, [0, 3, 6], 3), micro_batch=4)
    assert layout == Layout(2, [0, 4, 6], 3) and max(plan.times) == pytest.approx(
        8e-3
    )  # 3 micro-batches: stay
    # Memory for all 6 layers on one rank: K -> K/2, 1 stage x 2 copies at half the micro-batches.
    layout, plan = replan(roomy, 2, start, micro_batch=4)
    assert layout == Layout(1, [0, 6], 2) and max(plan.times) == pytest.approx(14e-3)
    # 7 MiB usable: with 2 frozen one stage needs 0.5 + 4 + 4 x 1 MiB in flight = 8.5; with 4 frozen
    # 1 + 2 + 2 = 5.
    tight = census(free_gib=7 / 1024 / 0.9)
    assert replan(tight, 2, start, micro_batch=4)[0].stages == 2
    assert replan(tight, 4, start, micro_batch=4)[0] == Layout(1, [0, 6], 2)
    # The first stage keeps an active layer: with 4 of 6 frozen and 2 stages, not [0, 4, 6] (4 | 6
    # ms).
    layout, _ = replan(tight, 4, Layout(2, [0, 3, 6], 3), micro_batch=4)
    assert layout.parts == [0, 5, 6]


def test_replan_times_the_layers_only_when_a_plan_has_boundaries_to_place():
    timed = []

    def time_layers():  # every rank's [forward, backward] ms: the second layer slower
        timed.append(1)
        return [[[1.0, 2.0], [5.0, 10.0], *[[1.0, 2.0]] * 4]] * 2

    untimed = census(free_gib=1.0)
    for report in untimed["census"]:
        del report["layer_ms"], report["layer_ms_micro_batch"]
    # One stage fits: nothing timed, no times predicted.
    layout, plan = replan(
        untimed, 2, Layout(2, [0, 3, 6], 4), micro_batch=4, time_layers=time_layers
    )
    assert layout == Layout(1, [0, 6], 2) and plan.times == [0.0] and not timed
    # 2 stages stay (3 micro-batches cannot halve): timed once, kept in the census, the cut placed
    # by the times.
    for _ in range(2):
        layout, plan = replan(
            untimed, 1, Layout(2, [0, 3, 6], 3), micro_batch=4, time_layers=time_layers
        )
        assert layout.parts == [0, 2, 6] and max(plan.times) == pytest.approx(
            16e-3
        )  # 1 + 15 | 4 x 3 ms
    assert len(timed) == 1 and untimed["census"][1]["layer_ms"][1] == [5.0, 10.0]
    with pytest.raises(ValueError, match="several stages needs every rank's layer_ms"):
        stages.plan_stages(untimed["layers"], [{"mem_free_gib": 1.0}] * 2, 2, 4, 3, 16)


@pytest.mark.ranks
@pytest.mark.timeout(480)
def test_pipeline_shrinks_to_data_parallel_and_matches_the_loop_and_resumes(tmp_path):
    full = tmp_path / "full"
    common = f"--engine pipeline --steps 8 {FREEZE}"
    r = train(full, f"{common} --save-interval 3")
    # Re-planned: all 6 layers fit one rank's (CPU) memory once 2 froze, so the first freeze point
    # halves the pipeline: 1 stage x 2 copies (micro-batches 16 x 4 -> 16 x 2 each). One stage has
    # no boundary to place: the layers were never timed, and no time is predicted.
    points = [(2, 2, 1, 2), (4, 3, 1, 2), (6, 4, 1, 2)]
    for rank in (0, 1):
        records = freeze_records(full, rank)
        assert [(x["step"], x["frozen"], x["stages"], x["dp"]) for x in records] == points
        assert all(x["parts"] == [0, 6] and "predicted_ms" not in x for x in records)
    assert not any(
        "layer_ms" in report for report in json.loads((full / "cluster.json").read_text())["census"]
    )
    assert (
        "freeze at step 2: layers 0-1 frozen (next: layer 2, no gradient change yet (the first "
        "interval has "
        "nothing to compare with)); 1 stages x 2 data-parallel, layers [0, 6]" in r.outputs[0]
    )
    assert_released(full)
    want = reference(8, {2: 2, 4: 3, 6: 4})
    assert_losses(train_losses(full), want, range(1, 9))
    for start in (
        3,
        6,
    ):  # in the 1 x 2 layout the checkpoint records, across the freeze points at 4 and 6
        resumed = tmp_path / f"from{start}"
        checkpoint = full / "checkpoints" / f"step{start}"
        train(resumed, f"{common} --no-save --resume", checkpoint, timeout=200)
        assert_losses(train_losses(resumed), want, range(start + 1, 9))


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_a_replan_that_keeps_two_stages_times_the_layers_at_that_freeze_point(tmp_path):
    # 5 MiB usable a rank: with 2 layers frozen one stage needs about 6.1 MiB (weights, Adam state
    # and 16 samples' activations of 3 blocks), 2 stages fit; with 3 frozen one stage needs 4.4 MiB.
    env = plugin_env(census=json.dumps({"mem_free_gib": 5 / 1024 / 0.9}))
    r = train(tmp_path, f"--engine pipeline --steps 6 --no-save {FREEZE}", env=env)
    for rank in (0, 1):
        records = freeze_records(tmp_path, rank)
        assert [(x["step"], x["frozen"], x["stages"], x["dp"]) for x in records] == [
            (2, 2, 2, 1),
            (4, 3, 1, 2),
        ]
        assert all(
            x["predicted_ms"] > 0 for x in records
        )  # timed for the 2 stages; the times then kept
    assert re.search(
        r"freeze at step 2: layers 0-1 frozen .*; 2 stages x 1 data-parallel, layers \[0, \d, 6\], "
        r"slowest stage [0-9.]+ ms predicted",
        r.outputs[0],
    )
    assert_losses(train_losses(tmp_path), reference(6, {2: 2, 4: 3}), range(1, 7))


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_pipeline_without_replan_keeps_its_layout(tmp_path):
    train(tmp_path, f"--engine pipeline --steps 6 --no-save {FREEZE} --freeze-replan off")
    # DeepSpeed's parameter split puts 3 layers on the first stage; it keeps one of them active.
    assert [(x["step"], x["frozen"], x["stages"], x["dp"]) for x in freeze_records(tmp_path)] == [
        (2, 2, 2, 1)
    ]
    assert_losses(train_losses(tmp_path), reference(6, {2: 2}), range(1, 7))


@pytest.mark.ranks
@pytest.mark.timeout(200)
def test_pipeline_rebuilds_leave_no_process_groups_and_no_engine_behind(tmp_path):
    # Two freeze points at 2 stages (alpha 0.2 freezes 1, then 2 layers; the first stage keeps its
    # third layer). Each DeepSpeed PipelineModule creates five process groups of its own (world,
    # model, data, pipe and slice parallel); the old pipeline's must be destroyed at each rebuild
    # (before: 11, then 16 groups live). On the last stage DeepSpeed keeps the last forward's
    # outputs, whose autograd hooks held the old engine.
    train(
        tmp_path,
        "--engine pipeline --freeze-replan off --freeze schedule --freeze-alpha 0.2 "
        "--freeze-interval-epochs 0.1 --steps 5 --no-save",
        timeout=160,
    )
    for rank in (0, 1):
        records = freeze_records(tmp_path, rank)
        assert [(x["step"], x["frozen"], x["stages"]) for x in records] == [(2, 1, 2), (4, 2, 2)]
        assert [x["process_groups"] for x in records] == [
            6,
            6,
        ]  # the default group and the live pipeline's five
        assert [x["old_engine_freed"] for x in records] == [True, True]
    assert_losses(train_losses(tmp_path), reference(5, {2: 1, 4: 2}), range(1, 6))


@pytest.mark.ranks
@pytest.mark.timeout(420)
def test_cache_gives_the_same_losses(tmp_path):
    # 128 samples, 2 steps an epoch; a freeze point every 2 epochs: the cache fills in the epoch
    # after the first and serves the next; at the second its entries are carried through the newly
    # frozen layer. Its memory holds a few samples' outputs; the rest spill into the log dir (and
    # are carried too).
    common = (
        "--dataset synthetic --synthetic-size 128 --steps 10 --no-save --freeze schedule "
        "--freeze-interval-epochs 2 --freeze-cache-gib 1e-4"
    )
    losses = {}
    for cache in ("on", "off"):
        train(tmp_path / cache, f"{common} --freeze-cache {cache}", timeout=200)
        losses[cache] = train_losses(tmp_path / cache)
        assert [(x["step"], x["frozen"], x["cache"]) for x in freeze_records(tmp_path / cache)] == [
            (4, 2, cache == "on"),
            (8, 3, cache == "on"),
        ]
        assert_released(tmp_path / cache)
    assert sorted(losses["on"]) == list(range(1, 11))
    for step, loss in losses["on"].items():
        assert loss == pytest.approx(losses["off"][step], rel=1e-5), (step, losses)
    for rank in (0, 1):  # the last phase's outputs, past the memory limit
        assert len(list((tmp_path / "on" / f"freeze_cache_rank{rank}").glob("*.pt"))) > 20
    assert not (tmp_path / "off" / "freeze_cache_rank0").exists()


def test_a_new_freeze_boundary_carries_the_cache_through_the_newly_frozen_layers(
    tmp_path, monkeypatch
):
    # Entries in memory and in files alike, a few at a time; a shorter prefix (never carried back)
    # empties it.
    monkeypatch.setattr(activation_cache, "ADVANCE_BATCH", 4)
    torch.manual_seed(0)
    layers, images = [nn.Linear(4, 4) for _ in range(3)], torch.randn(10, 4)

    def prefix(x, start, stop):
        for layer in layers[start:stop]:
            x = layer(x)
        return x

    cache = FeatureCache(
        3 * 16 / 2**30, str(tmp_path / "spill")
    )  # 3 entries of 4 floats in memory, then files
    with torch.no_grad():
        cache.advance(1, None)  # nothing held yet: nothing to run
        for i in range(10):
            cache.put(i, prefix(images[i : i + 1], 0, 1)[0])
        assert (len(cache.memory), len(cache.spilled)) == (3, 7)
        ran, beats = [], []
        cache.advance(
            3,
            lambda x, start: ran.append((len(x), start)) or prefix(x, start, 3),
            lambda: beats.append(1),
        )
        assert (
            ran == [(4, 1), (4, 1), (2, 1)] and len(beats) == 3 and cache.depth == 3
        )  # the watchdog hears each
        for i in range(10):
            torch.testing.assert_close(cache.get(i), prefix(images[i : i + 1], 0, 3)[0])
        assert sorted(int(f.stem) for f in (tmp_path / "spill").glob("*.pt")) == sorted(
            cache.spilled
        )
        cache.advance(3, None)  # the same prefix: nothing to run
        cache.advance(2, None)
    assert (
        not any(i in cache for i in range(10))
        and cache.depth == 2
        and not (tmp_path / "spill").exists()
    )


def test_cache_on_augmented_data_is_one_clear_line(tmp_path, monkeypatch):
    # The digits' default random crop counts, though no augmentation option was given. Refused
    # before any process group (in-process; test_train.py runs one refusal through the entry point:
    # exit 2, the line).
    with pytest.raises(ConfigError) as e:
        plan_in_process(
            monkeypatch,
            ["--freeze", "schedule", "--freeze-cache", "on", "--log-dir", tmp_path / "run"],
        )
    last = str(e.value)
    assert (
        last.startswith("--freeze-cache on needs the same sample every epoch")
        and "--no-aug" in last
        and "\n" not in last
    ), last
    assert not (tmp_path / "run").exists()
