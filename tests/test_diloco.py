"""--engine diloco against a single-process emulator of the same schedule (each worker's inner steps
on its own shard of every global batch, then the outer step on the averaged pseudo-gradient), with
2 and 4 real gloo ranks; one-step windows with a plain outer step are DDP; an exact resume between
syncs; the wire in fp32, bf16 and int8; bad input."""

import copy
import json

import pytest
import torch
from helpers import launch, plan_in_process, train_losses
from torch import nn

from vit.config.cli import defaults, parse
from vit.core.errors import ConfigError
from vit.data.augment import train_batches
from vit.data.datasets import load_dataset
from vit.engines.diloco.wire import BLOCK, compress, decompress
from vit.loop.optim import make_optimizer, make_scheduler
from vit.loop.reference import train_step
from vit.model.layers import build_layers, model_shape

GLOBAL_BATCH, CLIP = 64, 1.0  # the default job's global batch; zero0.json's gradient clipping


def emulate(s, workers: int, steps: int, sync_every: int, outer_lr: float, momentum: float) -> list:
    """Per-step mean losses over the workers of DiLoCo on settings `s`: worker w trains its own copy
    with its own optimizer and schedule on shard w of each global batch; after every sync_every-th
    step and the last, the global weights take an SGD step (Nesterov `momentum`) on the mean of the
    workers' global-minus-own weights, and every worker goes on from them."""
    data = load_dataset("digits", None, model_shape(s.model.model).img_size, seed=s.train.seed)
    first = nn.Sequential(
        *build_layers(s.model.model, data.num_classes, data.in_chans, data.img_size, s.train.seed)
    )
    global_model, models = copy.deepcopy(first), [copy.deepcopy(first) for _ in range(workers)]
    optims = [make_optimizer(m, s.optim, num_layers=len(m)) for m in models]
    scheds = [make_scheduler(o, s.optim, steps) for o in optims]
    outer = torch.optim.SGD(
        global_model.parameters(), lr=outer_lr, momentum=momentum, nesterov=momentum > 0
    )
    shard = dict(grad_accum=1, dp_size=workers, start_step=0, end_step=steps)
    feeds = [
        iter(
            train_batches(
                data,
                s.recipe,
                s.train.seed,
                micro_batch=GLOBAL_BATCH // workers,
                dp_rank=w,
                **shard,
            )
        )
        for w in range(workers)
    ]
    losses = []
    for step in range(1, steps + 1):
        step_losses = []
        for model, opt, sched, feed in zip(models, optims, scheds, feeds):
            x, y = next(feed)
            loss = train_step(model, opt, sched, x, y, CLIP, smoothing=s.recipe.smoothing)
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / workers)
        if step % sync_every == 0 or step == steps:
            with torch.no_grad():
                for g, *own in zip(global_model.parameters(), *(m.parameters() for m in models)):
                    g.grad = sum(g - p for p in own) / workers
                outer.step()
                for model in models:
                    for g, p in zip(global_model.parameters(), model.parameters()):
                        g.grad = None
                        p.copy_(g)
    return losses


PAPER = ["--outer-lr", 0.7, "--outer-momentum", 0.9]  # the paper's outer step: Nesterov's path


def diloco_args(tmp_path, steps: int, sync_every: int, *extra) -> list:
    return [
        "--engine", "diloco", "--steps", steps, "--sync-every", sync_every, "--log-interval", 1,
        "--no-save", "--log-dir", tmp_path, *PAPER, *extra,
    ]  # fmt: skip


@pytest.mark.ranks
@pytest.mark.timeout(420)
@pytest.mark.parametrize("ranks", [2, 4])
def test_workers_train_alone_between_syncs_as_the_emulator_does(tmp_path, ranks):
    steps, sync_every = 7, 3  # syncs after steps 3 and 6, and at the end
    micro = ["--micro-batch-size", GLOBAL_BATCH // ranks]  # the same global batch on 2 and 4 ranks
    r = launch(diloco_args(tmp_path, steps, sync_every, *micro), nprocs=ranks, timeout=360)
    assert r.ok, r
    got = train_losses(tmp_path)
    want = emulate(defaults(), ranks, steps, sync_every, outer_lr=0.7, momentum=0.9)
    assert sorted(got) == list(range(1, steps + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(want[step - 1], rel=1e-5), (step, got, want)
    lone = emulate(defaults(), ranks, steps, steps + 1, outer_lr=0.7, momentum=0.9)
    assert lone[3] != pytest.approx(want[3], rel=1e-5)  # the syncs change what is learned
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["engine"] == "diloco" and summary["steps"] == steps


@pytest.mark.ranks
@pytest.mark.timeout(420)
def test_one_step_windows_with_a_plain_outer_step_train_as_ddp(tmp_path):
    """H = 1, outer lr 1, no outer momentum: the global weights are the mean of the workers', which
    with SGD (momentum and weight decay are linear) is DDP's step on the averaged gradient."""
    sgd = [
        "--opt",
        "sgd",
        "--lr",
        0.05,
        "--clip-grad",
        0,
    ]  # clipping each worker's own gradient is not
    common = ["--steps", 6, "--log-interval", 1, "--no-save", *sgd]  # DDP's clipping of the mean
    ddp = launch(["--engine", "ddp", *common, "--log-dir", tmp_path / "ddp"], timeout=300)
    assert ddp.ok, ddp
    local = ["--sync-every", 1, "--outer-lr", 1, "--outer-momentum", 0]
    diloco = launch(
        ["--engine", "diloco", *common, *local, "--log-dir", tmp_path / "d"], timeout=300
    )
    assert diloco.ok, diloco
    want, got = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "d")
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
    assert want[6] < want[1]


@pytest.mark.ranks
@pytest.mark.timeout(420)
def test_a_resume_between_syncs_repeats_the_losses(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    # the paper's outer step, so that the outer optimizer's momentum must come back too
    common = ["--engine", "diloco", "--sync-every", 4, "--log-interval", 1, "--steps", 10, *PAPER]
    r = launch([*common, "--save-interval", 6, "--log-dir", full], timeout=300)
    assert r.ok, r
    step6 = full / "checkpoints" / "step6"  # two steps after the sync of step 4
    assert sorted(p.name for p in step6.glob("diloco_rank*.pt")) == [
        "diloco_rank0.pt",
        "diloco_rank1.pt",
    ]
    r = launch([*common, "--resume", step6, "--log-dir", resumed], timeout=300)
    assert r.ok, r
    want, got = train_losses(full), train_losses(resumed)
    assert sorted(got) == [7, 8, 9, 10]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got, want)
    # plot_logs.py marks the syncs on the loss chart: after steps 4 and 8, and the last
    from vit.reports.charts import plot_loss
    from vit.reports.runlogs import Run

    fig = plot_loss([Run(full)], None)
    marks = [
        x for line in fig.axes[0].lines if len(x := list(line.get_xdata())) == 2 and x[0] == x[1]
    ]
    assert sorted(x[0] for x in marks) == [4, 8, 10]


@pytest.mark.ranks
@pytest.mark.timeout(420)
@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_a_smaller_wire_trains_near_fp32(tmp_path, wire):
    steps = 8
    r = launch(diloco_args(tmp_path, steps, 2, "--outer-wire", wire), timeout=300)
    assert r.ok, r
    got = train_losses(tmp_path)
    exact = emulate(defaults(), 2, steps, 2, outer_lr=0.7, momentum=0.9)
    assert got[1] == pytest.approx(exact[0], rel=1e-5)  # before the first sync: the same
    for step in range(3, steps + 1):  # after it: the rounding of the wire, no more
        assert got[step] == pytest.approx(exact[step - 1], rel=2e-2), (step, got, exact)
    assert got[3] != pytest.approx(exact[2], rel=1e-7)  # the wire was really narrower


def test_the_wire_rounds_as_it_says():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * BLOCK, generator=g) * torch.linspace(1e-3, 10, 4 * BLOCK)
    for wire, bound in (("bf16", 2**-8), ("int8", 1 / 127)):
        payload, scales = compress(x, wire)
        back = decompress(payload, scales)
        per_block = x.view(-1, BLOCK).abs().amax(dim=1).repeat_interleave(BLOCK)
        limit = bound * (x.abs() if wire == "bf16" else per_block / 2 * 1.0001)
        assert (back - x).abs().le(limit).all(), wire
    assert (
        compress(x, "int8")[0].dtype == torch.int8
        and compress(x, "bf16")[0].dtype == torch.bfloat16
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sync-every", "0"], "--sync-every must be positive, got 0"),
        (["--outer-lr", "nan"], "--outer-lr must be a finite number, got nan"),
        (["--outer-lr", "inf"], "--outer-lr must be a finite number, got inf"),
        (["--outer-momentum", "1"], "--outer-momentum must be at least 0 and below 1, got 1"),
        (["--outer-wire", "int4"], "argument --outer-wire: invalid choice: 'int4'"),
        (["--worker-ranks", "abc"], "argument --worker-ranks: not a whole number: 'abc'"),
        (["--worker-ranks", "0"], "argument --worker-ranks: must be positive, got 0"),
        (["--precision", "fp16"], "--engine diloco trains in fp32 or bf16"),
        (["--comm-hook", "bf16"], "--comm-hook applies to --engine ddp"),
        (["--freeze", "settled"], "--freeze works with --engine"),
        (
            ["--batch-split", "proportional"],
            "--batch-split proportional applies to --engine zero or ddp",
        ),
    ],
)
def test_bad_diloco_options_are_one_line(monkeypatch, argv, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        plan_in_process(monkeypatch, ["--engine", "diloco", *argv])


def test_workers_must_share_the_ranks_evenly(monkeypatch):
    with pytest.raises(ConfigError, match="^--worker-ranks 3 does not divide the world size 2$"):
        plan_in_process(monkeypatch, ["--engine", "diloco", "--worker-ranks", 3], world_size=2)
    plan = plan_in_process(monkeypatch, ["--engine", "diloco", "--worker-ranks", 2], world_size=4)
    assert plan.settings.local.worker_ranks == "2"


def test_its_options_have_no_effect_on_another_engine():
    with pytest.raises(ConfigError, match="^--sync-every has no effect without --engine diloco$"):
        parse(["--engine", "ddp", "--sync-every", "10"])
