"""--engine diloco against a single-process emulator of the same schedule (each worker's inner steps
on its own shard of every global batch, then the outer step on the averaged pseudo-gradient), with
2 and 4 real gloo ranks; one-step windows with a plain outer step are DDP; an exact resume between
syncs; the wire in fp32, bf16 and int8; bad input."""

import copy
import json
import math
import re
import shlex

import pytest
import torch
from helpers import assert_losses, gloo_pair, launch, plan_in_process, train_losses
from torch import nn

from vit.core.errors import ConfigError
from vit.core.speeds import local_steps
from vit.data.augment import train_batches
from vit.data.datasets import load_dataset
from vit.engines.diloco.engine import fragment_bounds, worker_weight
from vit.engines.diloco.options import WEIGHTINGS
from vit.engines.diloco.wire import BLOCK, compress, decompress
from vit.model.layers import build_layers, loss_fn, model_shape
from vit.run.cli import defaults, parse
from vit.training.optim import make_optimizer, make_scheduler
from vit.training.reference import train_step

GLOBAL_BATCH, CLIP = 64, 1.0  # the default job's global batch; zero0.json's gradient clipping


def emulate(
    workers: int,
    steps: int,
    sync_every,
    local=None,
    fragments: int = 1,
    start: int = 0,
    refragment: tuple[int, int] | None = None,
    weighting: str = "steps",
) -> list:
    """Per-step losses of DiLoCo at the defaults with the paper's outer step (PAPER) as rank 0 logs
    them: where every worker meets in a
    sync (every H-th step without fragments, and the last), the mean over the workers that
    trained in the step; between syncs worker 0's last loss.

    Worker w trains its own copy with its own optimizer and schedule (which steps with the run,
    trained or not) on shard w of each global batch, in the first h[w] steps of every window of
    H (sync_every: H, or step -> H; `local`: h, or step -> the h of the window that holds the
    step, or None for h = H) and only draws its batch in the others. After every H-th step and
    the last, the global weights take an SGD step (Nesterov `momentum`) on the workers'
    global-minus-own weights averaged with weights by h[w] (`weighting`: steps, h[w]; uniform, 1;
    fednova, 1 / h[w] and the mean times the mean of h), and every worker goes on from them. With F
    `fragments` (each an equal share of the parameters, in order), fragment f's difference is
    taken after step (f + 1) H / F of a window (weighted by that window's h) and applied H / F
    steps later: the outer step, then each worker's fragment set to the new global weights plus
    what the worker learned in between. At the last step every fragment syncs. The first `start`
    steps are DDP's: every worker steps on the gradient averaged over the workers, and the windows
    count from there.
    refragment (s, F'): a resume after step s with F' fragments: a fragment in flight there (the
    old fragments' parameters) is applied at once when F' is 1, else at the first fragment turn of
    the new schedule, and the F' fragments follow from there."""
    s = defaults()
    data = load_dataset("digits", None, model_shape(s.model.model).img_size, seed=s.train.seed)
    first = nn.Sequential(
        *build_layers(s.model.model, data.num_classes, data.in_chans, data.img_size, s.train.seed)
    )
    global_model, models = copy.deepcopy(first), [copy.deepcopy(first) for _ in range(workers)]
    optims = [make_optimizer(m, s.optim, num_layers=len(m)) for m in models]
    scheds = [make_scheduler(o, s.optim, steps) for o in optims]
    outer = torch.optim.SGD(
        global_model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True
    )
    shard = dict(micro_batch=GLOBAL_BATCH // workers, dp_size=workers, grad_accum=1)
    feeds = [
        iter(
            train_batches(
                data, s.recipe, s.train.seed, dp_rank=w, start_step=0, end_step=steps, **shard
            )
        )
        for w in range(workers)
    ]
    window = sync_every if callable(sync_every) else lambda step: sync_every
    params = [list(m.parameters()) for m in [global_model, *models]]
    n = len(params[0])
    parts = fragment_parts(params[0], fragments)

    local_at = local if callable(local) else lambda step: local or [H] * workers

    def outer_step(indices, sent, h=None):  # h: of the window the fragment went in
        apply_outer(params, outer, weights(h or local_at(step), weighting), indices, sent)

    losses, in_flight, last = [], None, [None] * workers
    for _ in range(start):
        batches = [next(feed) for feed in feeds]
        losses.append(ddp_step(models, optims, scheds, batches, s.recipe.smoothing))
    global_model.load_state_dict(models[0].state_dict())
    for step in range(start + 1, steps + 1):
        if refragment and step == refragment[0] + 1:
            fragments = refragment[1]
            parts = fragment_parts(params[0], fragments)
            if in_flight and fragments == 1:
                outer_step(*in_flight)
                in_flight = None
        H = window(step)
        step_losses = []
        for w, (model, opt, sched, feed) in enumerate(zip(models, optims, scheds, feeds)):
            x, y = next(feed)
            if (step - start - 1) % H < local_at(step)[w]:
                loss = train_step(model, opt, sched, (x, y), CLIP, smoothing=s.recipe.smoothing)
                step_losses.append(loss.item())
                last[w] = loss.item()
            else:
                sched.step()  # the run's schedule, trained or not
        met = step == steps or (fragments == 1 and (step - start) % H == 0)
        losses.append(sum(step_losses) / len(step_losses) if met else last[0])
        offset, every = (step - start) % H or H, H // fragments
        if step == steps or (offset % every == 0 and fragments > 1):
            if in_flight:
                outer_step(*in_flight)
                in_flight = None
            if step < steps:
                sent = {
                    w: {i: params[1 + w][i].detach().clone() for i in range(n)}
                    for w in range(workers)
                }
                in_flight = (parts[offset // every - 1], sent, local_at(step))
            else:
                outer_step(range(n), None)
        elif (step - start) % H == 0:
            outer_step(range(n), None)
    return losses


def fragment_parts(params, count: int) -> list[range]:
    """The indices of `params` in each of `count` fragments (the engine's)."""
    ends = fragment_bounds([p.numel() for p in params], count)
    return [range(a, b) for a, b in zip([0, *ends[:-1]], ends)]


def weights(h: list[int], weighting: str) -> list[float]:
    """Each worker's weight in the mean of the pseudo-gradients, from the steps h each trained in
    the window (--outer-weighting)."""
    mean = sum(h) / len(h)
    if weighting == "uniform":
        return [1.0] * len(h)
    # FedNova: each difference divided by its steps, their mean times the mean steps
    return [k / mean if weighting == "steps" else mean / k for k in h]


@torch.no_grad()
def apply_outer(params, outer, weight: list[float], indices, sent) -> None:
    """The outer step on the parameters `indices` (params: the global model's, then each worker's)
    from the mean of the workers' differences, each times its `weight`, then each worker from the
    new global weights (plus what it learned since `sent`, its weights when they went, if given)."""
    workers = len(weight)
    for i in indices:
        g = params[0][i]
        own = [sent[w][i] if sent else params[1 + w][i] for w in range(workers)]
        g.grad = sum(weight[w] * (g - own[w]) for w in range(workers)) / workers
    outer.step()
    for i in indices:
        params[0][i].grad = None
        for w in range(workers):
            p = params[1 + w][i]
            p.copy_(params[0][i] + (p - sent[w][i] if sent else 0))


def ddp_step(models, optims, scheds, batches, smoothing: float) -> float:
    """DDP's step on every worker's copy: each one's gradient on its batch, their mean set on
    every copy, clipped, the step; the mean loss."""
    losses = []
    for model, (x, y) in zip(models, batches):
        loss = loss_fn(model(x), y, smoothing)
        loss.backward()
        losses.append(loss.item())
    for group in zip(*(m.parameters() for m in models)):
        mean = sum(p.grad for p in group) / len(models)
        for p in group:
            p.grad = mean.clone()
    for model, opt, sched in zip(models, optims, scheds):
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return sum(losses) / len(models)


OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # the paper's outer step: Nesterov's path
PAPER = ["--outer-lr", OUTER_LR, "--outer-momentum", OUTER_MOMENTUM]
EXACT = ["--outer-wire", "fp32", "--fragments", 1]  # the emulator's (the defaults: int8, auto)


def diloco_args(tmp_path, steps: int, sync_every: int, *extra) -> list:
    return [
        "--engine", "diloco", "--steps", steps, "--sync-every", sync_every, "--log-interval", 1,
        "--no-save", "--log-dir", tmp_path, *PAPER, *EXACT, *extra,
    ]  # fmt: skip


EQUAL = ["--local-steps", "equal"]  # where auto could take the census's noise for a spread


@pytest.mark.ranks
@pytest.mark.timeout(420)
@pytest.mark.parametrize("ranks", [2, 4])
def test_workers_train_alone_between_syncs_as_the_emulator_does(tmp_path, ranks):
    steps, sync_every = 7, 3  # syncs after steps 3 and 6, and at the end
    micro = ["--micro-batch-size", GLOBAL_BATCH // ranks]  # the same global batch on 2 and 4 ranks
    r = launch(diloco_args(tmp_path, steps, sync_every, *micro, *EQUAL), nprocs=ranks, timeout=360)
    assert r.ok, r
    want = emulate(ranks, steps, sync_every)
    assert_losses(train_losses(tmp_path), want, range(1, steps + 1), rel=1e-5)
    lone = emulate(ranks, steps, steps + 1)
    assert lone[3] != pytest.approx(want[3], rel=1e-5)  # the syncs change what is learned
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["engine"] == "diloco" and summary["steps"] == steps


@pytest.mark.ranks
@pytest.mark.timeout(420)
def test_one_step_windows_with_a_plain_outer_step_train_as_ddp(tmp_path):
    """H = 1, outer lr 1, no outer momentum: the global weights are the mean of the workers', which
    with SGD (momentum and weight decay are linear) is DDP's step on the averaged gradient."""
    # --clip-grad 0: clipping each worker's own gradient is not DDP's clipping of the mean
    common = shlex.split("--steps 6 --log-interval 1 --no-save --opt sgd --lr 0.05 --clip-grad 0")
    ddp = launch(["--engine", "ddp", *common, "--log-dir", tmp_path / "ddp"], timeout=300)
    assert ddp.ok, ddp
    local = ["--sync-every", 1, "--outer-lr", 1, "--outer-momentum", 0, *EQUAL, *EXACT]
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
def test_steps_before_the_local_start_are_ddp_and_the_windows_count_from_there(tmp_path):
    """--local-start-step 3, H = 3, 8 steps: DDP's steps 1 to 3 (AdamW on the averaged gradient,
    clipped), syncs after 6 and 8, as the emulator; all 8 as DDP are `--engine ddp`'s losses; a
    resume inside the DDP steps repeats the losses."""
    steps, common = 8, ["--log-interval", 1, "--steps", 8]
    local = ["--engine", "diloco", "--sync-every", 3, *PAPER, *EQUAL, *EXACT, *common]
    save = ["--save-interval", 2, "--keep-checkpoints", 4]
    r = launch([*local, "--local-start-step", 3, *save, "--log-dir", tmp_path / "d"])
    assert r.ok, r
    want = emulate(2, steps, 3, start=3)
    got = train_losses(tmp_path / "d")
    assert_losses(got, want, range(1, steps + 1), rel=1e-5)
    assert want[-1] != pytest.approx(emulate(2, steps, 3)[-1], rel=1e-5)
    from vit.reports.runlogs import Run

    assert Run(tmp_path / "d").sync_steps() == [6, 8]  # plot_logs.py's marks
    again = tmp_path / "again"
    step2 = tmp_path / "d" / "checkpoints" / "step2"
    r = launch([*local, "--local-start-step", 3, "--resume", step2, "--log-dir", again])
    assert r.ok, r
    for step, loss in train_losses(again).items():
        assert loss == pytest.approx(got[step], rel=1e-6), (step, loss, got)
    # workers that trained alone since step 3 cannot go back to DDP's steps
    step6 = tmp_path / "d" / "checkpoints" / "step6"
    back = launch([*local, "--local-start-step", 7, "--resume", step6, "--log-dir", tmp_path / "b"])
    assert not back.ok
    assert (
        "--local-start-step 7: the checkpoint of step 6 is past its DDP steps (--local-start-step "
        "3), and workers that trained alone cannot go back to DDP; give at most 6"
    ) in back.outputs[0]
    assert not list((tmp_path / "b").glob("metrics_rank*.jsonl"))
    ddp = launch(["--engine", "ddp", *common, "--no-save", "--log-dir", tmp_path / "ddp"])
    assert ddp.ok, ddp
    whole = launch([*local, "--local-start-step", steps, "--no-save", "--log-dir", tmp_path / "w"])
    assert whole.ok, whole
    want, got = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "w")
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)


@pytest.mark.ranks
@pytest.mark.timeout(420)
def test_a_resume_between_syncs_repeats_the_losses(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    # the paper's outer step, so that the outer optimizer's momentum must come back too
    common = ["--engine", "diloco", "--sync-every", 4, "--log-interval", 1, "--steps", 10, *PAPER]
    common += [*EQUAL, *EXACT]
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
    # another --sync-every goes on from there, in windows of the new H: syncs after 9 and 10
    other = tmp_path / "other"
    r = launch([*common, "--resume", step6, "--sync-every", 3, "--log-dir", other], timeout=300)
    assert r.ok, r
    changed = emulate(2, 10, lambda step: 4 if step <= 6 else 3)
    got = train_losses(other)
    for step in got:
        assert got[step] == pytest.approx(changed[step - 1], rel=1e-5), (step, got, changed)
    assert got[10] != pytest.approx(want[10], rel=1e-6)
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
def test_a_slower_worker_takes_fewer_steps_and_weighs_as_asked(tmp_path):
    """Rank 1 slowed x3: the census gives it fewer inner steps a window (--local-steps auto), it
    only draws the batches of the others, and the average weighs it as --outer-weighting fednova
    says (the default, steps: test_a_sync_measures_the_next_windows...); each sync sets the next
    windows' steps from the ranks' times in the last one (a line says when they change), as the
    emulator is told."""
    steps, sync_every = 13, 4
    slow = ["--simulate-slowdown", "1=3", "--local-steps", "auto", "--outer-weighting", "fednova"]
    r = launch(diloco_args(tmp_path, steps, sync_every, *slow), timeout=360)
    assert r.ok, r
    local = json.loads((tmp_path / "cluster.json").read_text())["local_steps"]
    assert local[0] == sync_every and 1 <= local[1] < sync_every, local
    assert f"inner steps in each window of {sync_every}, by rank: {local}" in r.outputs[0]
    changed = steps_changed(r.outputs[0], sync_every)
    assert set(changed) <= {4, 8, 12}, changed

    def local_at(step):  # the steps of the window that holds `step`
        began = sync_every * ((step - 1) // sync_every)
        return next((changed[at] for at in sorted(changed, reverse=True) if at <= began), local)

    assert all(local_at(step)[1] < sync_every for step in range(1, steps + 1)), changed
    want = emulate(2, steps, sync_every, local=local_at, weighting="fednova")
    got = train_losses(tmp_path)
    for step, loss in got.items():
        assert loss == pytest.approx(want[step - 1], rel=1e-5), (step, got, want)
    equal = emulate(2, steps, sync_every)
    assert want[-1] != pytest.approx(equal[-1], rel=1e-5)  # the schedule changed what is learned
    by_steps = emulate(2, steps, sync_every, local=local_at)
    assert want[-1] != pytest.approx(by_steps[-1], rel=1e-5)  # and so did the weighting
    summary = json.loads((tmp_path / "summary.json").read_text())  # images trained, not drawn
    trained = summary["images_per_s"] * summary["train_s_this_run"]
    shares = [sum(local_at(step)) / (2 * sync_every) for step in range(1, steps + 1)]
    assert trained == pytest.approx(GLOBAL_BATCH * sum(shares), rel=1e-6)


def steps_changed(output: str, sync_every: int) -> dict[int, list[int]]:
    """The lines of rank 0 that say a sync set new local steps: {step: steps by rank}."""
    line = (
        rf"step (\d+): inner steps in each window of {sync_every}, by rank: (\[[\d, ]+\]) "
        r"\(from each worker's time per step in the last window\)"
    )
    return {int(m[1]): json.loads(m[2]) for m in re.finditer(line, output)}


@pytest.mark.ranks
@pytest.mark.timeout(420)
@pytest.mark.parametrize("fragments", [1, 2])
def test_a_sync_measures_the_next_windows_and_a_resume_keeps_the_checkpoints(tmp_path, fragments):
    """Rank 1 slowed x5, saved at step 6, resumed with rank 0 slowed x5 instead: the resumed run
    goes on with the checkpoint's local steps (not its own census's) through the window it did not
    time whole (to step 8) and the next; the end of the window of step 12 gives rank 0 the fewer
    steps, with fragments too (they kept the census's steps for the whole run). The losses are the
    emulator's on that schedule."""
    first, second, H = tmp_path / "first", tmp_path / "second", 4
    common = ["--engine", "diloco", "--sync-every", H, "--log-interval", 1, "--steps", 16, *PAPER]
    # x5 and proportional: on a loaded machine x3 looked like 1.3x to auto (within its noise band)
    common += [*EXACT, "--fragments", fragments, "--local-steps", "proportional"]
    slow1 = ["--simulate-slowdown", "1=5", "--save-interval", 6, "--log-dir", first]
    r = launch([*common, *slow1], timeout=300)
    assert r.ok, r
    census = json.loads((first / "cluster.json").read_text())["local_steps"]
    before = steps_changed(r.outputs[0], H)
    step6 = first / "checkpoints" / "step6"
    slow0 = ["--simulate-slowdown", "0=5", "--resume", step6, "--log-dir", second]
    r = launch([*common, *slow0], timeout=300)
    assert r.ok, r
    after = steps_changed(r.outputs[0], H)
    kept = before.get(4, census)  # the window of step 6's
    assert kept[1] < H and set(after) == {12} and after[12][0] < H, (census, before, after)
    assert f"by rank: {kept} (the checkpoint's, until a sync measures them again)" in r.outputs[0]

    def local_at(step):
        return census if step <= 4 else kept if step <= 12 else after[12]

    want = emulate(2, 16, H, local=local_at, fragments=fragments)
    assert_losses(train_losses(second), want, range(7, 17), rel=1e-5)


H4 = ["--engine", "diloco", "--sync-every", 4, "--log-interval", 1, "--steps", 10]
H4 += [*PAPER, *EQUAL, *EXACT]


@pytest.fixture(scope="module")
def fragmented_run(tmp_path_factory):
    """The 2-rank run of H4 with --fragments N, saved at steps 5 and 10, by N: started by the first
    test that asks for it (within that test's timeout), shared by the next (N = 2: two tests). A
    resume writes into other folders."""
    runs = {}

    def saved(fragments: int):
        if fragments not in runs:
            d = tmp_path_factory.mktemp(f"fragments{fragments}")
            args = [*H4, "--fragments", fragments, "--save-interval", 5, "--log-dir", d]
            r = launch(args, timeout=300)
            assert r.ok, r
            runs[fragments] = d
        return runs[fragments]

    return saved


@pytest.mark.ranks
@pytest.mark.timeout(420)
def test_streaming_fragments_as_the_emulator_and_a_resume_with_one_in_flight(
    tmp_path, fragmented_run
):
    """--fragments 2, H = 4: the first half of the parameters go after steps 2, 6 (and are applied
    after 4, 8), the second after 4 and 8 (applied after 6, and at the end with every fragment).
    The checkpoint of step 5 holds the second fragment's mean, on the wire since step 4."""
    full, resumed = fragmented_run(2), tmp_path / "resumed"
    common = [*H4, "--fragments", 2]
    want = emulate(2, 10, 4, fragments=2)
    got = train_losses(full)
    assert_losses(got, want, range(1, 11), rel=1e-5)
    whole = emulate(2, 10, 4)
    assert want[6] != pytest.approx(whole[6], rel=1e-5)  # streaming is another schedule
    step5 = full / "checkpoints" / "step5"
    r = launch([*common, "--resume", step5, "--log-dir", resumed])
    assert r.ok, r
    again = train_losses(resumed)
    assert sorted(again) == [6, 7, 8, 9, 10]
    for step in again:
        assert again[step] == pytest.approx(got[step], rel=1e-6), (step, again, got)
    # resumed with --fragments 1: the fragment in flight is applied at once (before, it waited for
    # the last step and counted the workers' steps since the checkpoint twice)
    whole_now = tmp_path / "whole"
    r = launch([*common, "--fragments", 1, "--resume", step5, "--log-dir", whole_now])
    assert r.ok, r
    want = emulate(2, 10, 4, fragments=2, refragment=(5, 1))
    assert_losses(train_losses(whole_now), want, range(6, 11), rel=1e-5)


@pytest.mark.ranks
@pytest.mark.timeout(420)
@pytest.mark.parametrize("saved, now", [(1, 2), (2, 4), (4, 2)])
def test_a_resume_with_other_fragments_is_the_emulator_on_the_new_schedule(
    tmp_path, fragmented_run, saved, now
):
    """H = 4, saved at step 5 with `saved` fragments and resumed with `now`: the fragment on the
    wire at step 5 (none with 1, the second half since step 4 with 2, the first quarter since step
    5 with 4) is applied, with its old parameters, at step 6, the new schedule's first fragment
    turn, and the new fragments go on from there."""
    second = tmp_path / "second"
    step5 = fragmented_run(saved) / "checkpoints" / "step5"
    r = launch([*H4, "--fragments", now, "--resume", step5, "--log-dir", second], timeout=300)
    assert r.ok, r
    want = emulate(2, 10, 4, fragments=saved, refragment=(5, now))
    assert_losses(train_losses(second), want, range(6, 11), rel=1e-5)
    kept = emulate(2, 10, 4, fragments=saved)
    assert want[-1] != pytest.approx(kept[-1], rel=1e-5)  # the new schedule is another one


@pytest.mark.ranks
@pytest.mark.timeout(420)
def test_a_resume_with_another_sync_every_trains_every_step_of_the_new_windows(tmp_path):
    """Saved at step 5 with H = 2, resumed with H = 4: the checkpoint's 2 inner steps per window
    do not carry over to windows of 4 (before, each worker trained 2 of every 4 steps); the
    losses are the emulator's with H = 2 to step 5 and 4 after."""
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--engine", "diloco", "--log-interval", 1, "--steps", 10, *PAPER, *EQUAL, *EXACT]
    r = launch([*common, "--sync-every", 2, "--save-interval", 5, "--log-dir", first], timeout=300)
    assert r.ok, r
    step5 = first / "checkpoints" / "step5"
    r = launch([*common, "--sync-every", 4, "--resume", step5, "--log-dir", second], timeout=300)
    assert r.ok, r
    assert (
        "--resume with --sync-every 4 (the checkpoint's: 2): inner steps by rank [4, 4]"
        in (r.outputs[0])
    )
    want = emulate(2, 10, lambda step: 2 if step <= 5 else 4)
    assert_losses(train_losses(second), want, range(6, 11), rel=1e-5)


@pytest.mark.ranks
@pytest.mark.timeout(420)
def test_a_resume_on_fewer_ranks_goes_on_from_the_global_weights(tmp_path):
    """A workstation down: the checkpoint of 2 ranks resumes on 1, from the global weights."""
    first, alone = tmp_path / "two", tmp_path / "one"
    common = ["--engine", "diloco", "--sync-every", 4, "--log-interval", 1, "--steps", 8, *EQUAL]
    r = launch([*common, "--save-interval", 6, "--log-dir", first], timeout=300)
    assert r.ok, r
    step6 = first / "checkpoints" / "step6"
    one = ["--micro-batch-size", GLOBAL_BATCH, "--resume", step6, "--log-dir", alone]
    r = launch([*common, *one], nprocs=1, timeout=300)
    assert r.ok, r
    assert (
        "--resume of --engine diloco saved by 2 ranks on 1: every worker goes on from"
        in r.outputs[0]
    )
    got = train_losses(alone)
    assert sorted(got) == [7, 8] and all(math.isfinite(v) for v in got.values())
    # one worker from the global weights of step 4: with the outer step the mean, step 7's loss is
    # that of the mean of the two workers' weights after step 4, not of rank 0's own after step 6
    assert got[7] != pytest.approx(train_losses(first)[7], rel=1e-6)


def test_fragments_are_contiguous_near_equal_and_cover_every_tensor():
    sizes = [5, 100, 3, 100, 3, 100, 3, 7]
    for f in range(1, len(sizes) + 1):
        ends = fragment_bounds(sizes, f)
        assert len(ends) == f and ends == sorted(set(ends)) and ends[-1] == len(sizes), (f, ends)
    assert fragment_bounds(sizes, 3) == [3, 5, 8]  # 108, 103 and 110 elements
    with pytest.raises(ConfigError, match="^--fragments 9 exceeds the model's 8 tensors$"):
        fragment_bounds(sizes, 9)


def test_the_defaults_are_the_fast_setting_and_auto_fragments_divide_h():
    """H = 10, int8, 5 fragments: as fast as H = 50 on the simulated hosts (docs/benchmarks.md);
    --fragments auto is the largest F up to 5 that divides any other H; equal local steps (a
    slowed rank's proportional steps lost 4 points for 1.08x the images/s)."""
    s = parse(["--engine", "diloco"])
    assert (s.local.sync_every, s.local.outer_wire, s.local.fragment_count) == (10, "int8", 5)
    assert s.local.local_steps == "equal"
    counts = {h: parse(["--engine", "diloco", "--sync-every", str(h)]).local.fragment_count
              for h in (1, 4, 7, 12, 50)}  # fmt: skip
    assert counts == {1: 1, 4: 4, 7: 1, 12: 4, 50: 5}
    assert parse(["--engine", "diloco", "--fragments", "2"]).local.fragment_count == 2


def test_local_steps_follow_speed_beyond_the_noise():
    assert local_steps(50, [10.0, 20.0, 10.5], "auto") == [50, 25, 48]
    assert local_steps(50, [10.0, 12.0], "auto") is None  # within the noise: equal
    assert local_steps(50, [10.0, 12.0], "proportional") == [50, 42]
    assert local_steps(50, [10.0, 20.0], "equal") is None
    assert local_steps(4, [1.0, 100.0], "proportional") == [4, 1]  # at least one step


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_each_weighting_is_the_emulators_on_every_rank(weighting):
    """The engine's factor on each rank's pseudo-gradient before the mean over the ranks is the
    emulator's weight of that worker, for 1 to 4 workers of unequal steps."""
    for h in ([4], [4, 2], [10, 5], [10, 3, 7], [1, 4, 4, 2]):
        got = [worker_weight(h, rank, weighting) for rank in range(len(h))]
        assert got == pytest.approx(weights(h, weighting), rel=1e-12), h
    assert [worker_weight([3, 3], r, weighting) for r in (0, 1)] == [1.0, 1.0]  # equal: the mean


@pytest.mark.ranks
@pytest.mark.timeout(420)
@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_a_smaller_wire_trains_near_fp32(tmp_path, wire):
    steps = 8
    r = launch(diloco_args(tmp_path, steps, 2, "--outer-wire", wire, *EQUAL), timeout=300)
    assert r.ok, r
    got = train_losses(tmp_path)
    exact = emulate(2, steps, 2)
    assert got[1] == pytest.approx(exact[0], rel=1e-5)  # before the first sync: the same
    for step in range(3, steps + 1):  # after it: the rounding of the wire, no more
        assert got[step] == pytest.approx(exact[step - 1], rel=2e-2), (step, got, exact)
    assert got[3] != pytest.approx(exact[2], rel=1e-7)  # the wire was really narrower


def test_the_wire_rounds_as_it_says():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * BLOCK, generator=g) * torch.linspace(1e-3, 10, 4 * BLOCK)
    for wire, bound in (("bf16", 2**-8), ("int8", 1 / 127)):
        payload, scales = compress(x.clone(), wire)
        back = decompress(payload, scales)
        per_block = x.view(-1, BLOCK).abs().amax(dim=1).repeat_interleave(BLOCK)
        limit = bound * (x.abs() if wire == "bf16" else per_block / 2 * 1.0001)
        assert (back - x).abs().le(limit).all(), wire
    assert (
        compress(x.clone(), "int8")[0].dtype == torch.int8
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
        (["--fragments", "3"], "--fragments 3 does not divide --sync-every 10"),
        (["--fragments", "0"], "argument --fragments: must be positive, got 0"),
        (
            ["--sync-every", "12", "--fragments", "5"],
            "--fragments 5 does not divide --sync-every 12",
        ),
        (["--local-start-step", "-1"], "--local-start-step must not be negative, got -1"),
        (["--local-steps", "fast"], "argument --local-steps: invalid choice: 'fast'"),
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
    said = (
        "--sync-every has no effect without --engine diloco (or --engine auto --auto-allow diloco)"
    )
    for engine in (["ddp"], ["auto"], ["auto", "--auto-allow", "powersgd"]):
        with pytest.raises(ConfigError) as e:
            parse(["--engine", *engine, "--sync-every", "20"])
        assert str(e.value) == said


def test_auto_that_may_choose_diloco_keeps_its_options():
    """--engine auto --auto-allow diloco passes --sync-every and --fragments on to the diloco it may
    choose (they were refused as having no effect), checked as diloco checks them."""
    s = parse(
        ["--engine", "auto", "--auto-allow", "diloco", "--sync-every", "20", "--fragments", "4"]
    )
    assert (s.parallel.engine, s.local.sync_every, s.local.fragments) == ("auto", 20, 4)
    with pytest.raises(ConfigError, match="^--fragments 3 does not divide --sync-every 20 "):
        parse(
            ["--engine", "auto", "--auto-allow", "diloco", "--sync-every", "20", "--fragments", "3"]
        )


WIRE_RANK = """
import json, sys
import torch, torch.distributed as dist
from vit.engines.diloco.wire import mean_over_ranks, padded_length
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
length = padded_length(100_000, "int8", 2)
report = {}
for wire in ("fp32", "bf16", "int8"):
    flat = torch.randn(length, generator=torch.Generator().manual_seed(rank))
    want = sum(torch.randn(length, generator=torch.Generator().manual_seed(r)) for r in (0, 1)) / 2
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        out = mean_over_ranks(flat, wire)
    made = sum(max(0, e.self_cpu_memory_usage) for e in prof.events())
    error = float((out - want).abs().max() / want.abs().max())
    report[wire] = {"in_place": out is flat, "made": made / (4 * length), "error": error}
print(json.dumps(report))
"""


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_the_wire_averages_in_place(tmp_path):
    """Two gloo ranks: each wire writes the mean over its input; fp32 allocates nothing beyond it
    (it cloned the pseudo-gradient and divided into another copy: 8 bytes a value), bf16 and int8
    round as their dtypes do."""
    outs = gloo_pair(WIRE_RANK, tmp_path / "store")
    report = json.loads(outs[0].splitlines()[-1])
    assert all(r["in_place"] for r in report.values()), report
    assert report["fp32"]["made"] < 1e-3 and report["fp32"]["error"] < 1e-6, report
    assert report["bf16"]["error"] < 2**-7 and report["int8"]["error"] < 1 / 127, report


def test_the_memory_model_counts_the_wires_buffers():
    """What the sync holds beyond the weights, by wire: the flat pseudo-gradient, and for bf16 and
    int8 a bound on their buffers: four compressed copies and one fp32 share."""
    from vit.engines.diloco import SPEC

    fp32 = SPEC.state_bytes("fp32", {}, dp_size=2)
    int8 = SPEC.state_bytes("fp32", {}, dp_size=2, compression="outer-int8")
    bf16 = SPEC.state_bytes("fp32", {}, dp_size=4, compression="outer-bf16")
    assert fp32["pseudo-gradient"] == 4 and not any("wire" in k for k in fp32)
    assert int8["int8 wire buffers"] == pytest.approx(4 * (1 + 4 / BLOCK) + 4 / 2)
    assert bf16["bf16 wire buffers"] == pytest.approx(4 * 2 + 4 / 4)
