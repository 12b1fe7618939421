"""--engine async-pipeline with real gloo ranks, against a single-process emulator of its
asynchronous schedule.

The emulator is the specification. Stage s runs, for each micro-batch k of a step, the forward of k
and then the backward of k - (stages - 1 - s) (once there is one); the last step is followed by the
backwards still in flight. A stage applies its update after every `interval` backwards. A forward
sees d = k // interval - (updates applied) updates of staleness; with d > 0 it uses the weights d
zero-gradient optimizer steps ahead (msnag) or the current ones, and its backward uses those same
weights (stashing) or the weights of the backward's time (no stashing). Gradients are clipped per
stage. Any order of the stages' passes that respects their data dependencies gives the same numbers,
so the emulator runs them one process, stage after stage.
"""

import copy
import json
import os
import signal
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from helpers import (
    ROOT,
    base_env,
    launch,
    plan_in_process,
    plugin_env,
    read_jsonl,
    train_losses,
)
from torch.func import functional_call

from vit.core.errors import ConfigError
from vit.data.augment import train_batches
from vit.data.datasets import load_dataset
from vit.model.layers import build_layers, loss_fn, model_shape
from vit.run.cli import defaults, parse
from vit.training.optim import make_optimizer, make_scheduler
from vit.training.reference import reference_losses

STEPS, MICRO, ACCUM, CLIP = 8, 16, 4, 1.0  # deepspeed_configs/pipeline.json: 16 x 4, clipping 1.0


class Stage:
    def __init__(self, layers, lo, hi, s, updates):
        self.module = torch.nn.Sequential(OrderedDict((str(i), layers[i]) for i in range(lo, hi)))
        self.opt = make_optimizer(self.module, s.optim, num_layers=len(layers))
        self.sched = make_scheduler(self.opt, s.optim, updates)
        self.version, self.inflight = 0, {}

    def now(self):
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def ahead(self, d):
        """The weights after d optimizer steps with zero gradients, the optimizer itself
        untouched."""
        memo = {}
        opt = copy.deepcopy(self.opt, memo)
        for _ in range(d):
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            opt.step()
        return {n: memo[id(p)].detach().clone() for n, p in self.module.named_parameters()}


@pytest.mark.parametrize(
    "opt,options",
    [
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.8, dampening=0.3, weight_decay=0.05)),
        (torch.optim.SGD, dict(lr=0.1, weight_decay=0.1)),
        (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    ],
)
@pytest.mark.parametrize("updates", [0, 2])
def test_prediction_is_the_optimizers_own_steps_with_no_new_gradient(opt, options, updates):
    """msnag's weights d updates ahead are those d zero-gradient steps of the optimizer itself give
    (the emulator's definition), before the first update too; for SGD with momentum alone, FTPipe's
    closed form."""
    from vit.engines.async_pipeline.msnag import predict

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    optimizer = opt(layer.parameters(), **options)
    for _ in range(updates):
        layer(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    before = [p.detach().clone() for p in layer.parameters()]
    predicted = predict(optimizer, 3)
    # the live weights untouched
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before))
    stage = Stage.__new__(Stage)
    stage.opt, stage.module = optimizer, layer
    want = stage.ahead(3)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(predicted[p], want[name], rtol=1e-6, atol=1e-7)
    if opt is torch.optim.SGD and options == dict(lr=0.1, momentum=0.9) and updates:
        v = optimizer.state[layer.weight]["momentum_buffer"]
        closed = layer.weight - 0.1 * (0.9 - 0.9**4) / (1 - 0.9) * v
        torch.testing.assert_close(predicted[layer.weight], closed, rtol=1e-6, atol=1e-7)
    if updates == 0 and not options.get("weight_decay"):
        assert all(torch.equal(predicted[p], b) for p, b in zip(layer.parameters(), before))


# The schedule written out step by step in one function: the specification the engine is tested
# against.
def emulate(s, batches, stages, steps, interval=ACCUM, stashing=True, prediction=True):  # noqa: C901, PLR0915
    """Per-step mean losses of the asynchronous schedule; `batches`: the micro-batches in order,
    ACCUM a step."""
    from deepspeed.runtime import utils as ds_utils

    data = digits(s)
    layers = build_layers(
        s.model.model, data.num_classes, data.in_chans, data.img_size, s.train.seed
    )
    parts = ds_utils.partition_balanced(
        [sum(p.numel() for p in layer.parameters()) for layer in layers], stages
    )
    st = [
        Stage(layers, parts[i], parts[i + 1], s, steps * ACCUM // interval) for i in range(stages)
    ]
    total = steps * ACCUM
    ops = []
    for i in range(stages):
        lag = stages - 1 - i
        mine = [op for k in range(total) for op in [("F", k), ("B", k - lag)] if op[1] >= 0]
        ops.append(mine + [("B", k) for k in range(total - lag, total)])
    acts, grads, losses, done = {}, {}, {}, set()

    def ready(i, op):
        kind, k = op
        if kind == "F":
            return i == 0 or ("F", i - 1, k) in done
        return i == stages - 1 or ("B", i + 1, k) in done

    def forward(i, k):
        stage = st[i]
        d = k // interval - stage.version
        w = stage.ahead(d) if prediction and d > 0 else stage.now()
        x = batches[k][0] if i == 0 else acts[(i - 1, k)]
        with torch.no_grad():
            out = functional_call(stage.module, w, (x,))
            if i == stages - 1:
                losses[k] = loss_fn(out, batches[k][1], s.recipe.smoothing).item()
        acts[(i, k)] = out
        stage.inflight[k] = (x, w)

    def backward(i, k):
        stage = st[i]
        x, w = stage.inflight.pop(k)
        w = {n: t.clone().requires_grad_() for n, t in (w if stashing else stage.now()).items()}
        x = x.detach().requires_grad_(i > 0)
        out = functional_call(stage.module, w, (x,))
        if i == stages - 1:
            (loss_fn(out, batches[k][1], s.recipe.smoothing) / interval).backward()
        else:
            out.backward(grads[(i + 1, k)])
        grads[(i, k)] = x.grad
        for n, p in stage.module.named_parameters():
            p.grad = w[n].grad if p.grad is None else p.grad + w[n].grad
        if (k + 1) % interval == 0:
            torch.nn.utils.clip_grad_norm_(stage.module.parameters(), CLIP)
            stage.opt.step()
            stage.sched.step()
            stage.opt.zero_grad(set_to_none=True)
            stage.version += 1

    pointers = [0] * stages
    while any(pointers[i] < len(ops[i]) for i in range(stages)):
        moved = False
        for i in range(stages):
            while pointers[i] < len(ops[i]) and ready(i, ops[i][pointers[i]]):
                kind, k = ops[i][pointers[i]]
                (forward if kind == "F" else backward)(i, k)
                done.add((kind, i, k))
                pointers[i] += 1
                moved = True
        assert moved, "the schedule deadlocks"
    return [
        sum(losses[k] for k in range(n * ACCUM, (n + 1) * ACCUM)) / ACCUM
        for n in range(len(losses) // ACCUM)
    ]


def digits(s):
    return load_dataset("digits", None, model_shape(s.model.model).img_size, seed=s.train.seed)


def digits_batches(s, steps):
    data = digits(s)
    return list(
        train_batches(
            data,
            s.recipe,
            s.train.seed,
            micro_batch=MICRO,
            grad_accum=ACCUM,
            dp_rank=0,
            dp_size=1,
            start_step=0,
            end_step=steps,
        )
    )


def assert_close(got: list[float], want: list[float], rel=1e-5):
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want), 1):
        assert g == pytest.approx(w, rel=rel), (step, got, want)


def losses_of(log_dir) -> list[float]:
    got = train_losses(log_dir)
    return [got[step] for step in sorted(got)]


@pytest.mark.ranks
@pytest.mark.timeout(240)
def test_one_stage_equals_the_synchronous_reference(tmp_path):
    # 2 data-parallel copies of a 1-stage pipeline: the per-stage all-reduce; global batch 16 x 4 x
    # 2.
    r = launch(
        [
            "--engine",
            "async-pipeline",
            "--pipeline-stages",
            1,
            "--steps",
            6,
            "--log-interval",
            1,
            "--no-save",
            "--log-dir",
            tmp_path,
        ],
        nprocs=2,
        timeout=200,
    )
    assert r.ok, r
    assert_close(losses_of(tmp_path), reference_losses(defaults(), 128, 6, clip=CLIP), rel=2e-5)


CASES = {  # name: (stages, options, emulator settings)
    "2 stages, adamw, msnag": (2, ["--simulate-slowdown", "0=1.5"], {}),
    "3 stages, adamw, msnag": (3, [], {}),
    "2 stages, sgd, msnag": (
        2,
        ["--opt", "sgd", "--momentum", 0.9, "--lr", 0.05, "--weight-decay", 0],
        {},
    ),
    "2 stages, sgd nesterov, weight decay, msnag": (
        2,
        ["--opt", "sgd", "--nesterov", "--lr", 0.05],
        {},
    ),
    "3 stages, no stashing, no prediction": (
        3,
        ["--weight-stashing", "off", "--weight-prediction", "none"],
        {"stashing": False, "prediction": False},
    ),
    "2 stages, update every 2 micro-batches": (2, ["--async-update-interval", 2], {"interval": 2}),
}


@pytest.mark.ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_stages_match_the_emulator(tmp_path, case):
    stages, options, emulated = CASES[case]
    trace = tmp_path / "trace"
    r = launch(
        [
            "--engine",
            "async-pipeline",
            "--pipeline-stages",
            stages,
            "--steps",
            STEPS,
            "--log-interval",
            1,
            "--no-save",
            "--log-dir",
            tmp_path / "run",
            *options,
        ],
        nprocs=stages,
        timeout=240,
        env=plugin_env(async_trace=str(trace)),
    )
    assert r.ok, r
    s = parse(["--engine", "async-pipeline", *map(str, options)])
    want = emulate(s, digits_batches(s, STEPS), stages, STEPS, **emulated)
    assert_close(losses_of(tmp_path / "run"), want)
    # Asynchrony shows: from the second step on, the synchronous loop trains otherwise.
    sync = reference_losses(s, MICRO * ACCUM, STEPS, clip=CLIP)
    # (curves may cross)
    assert max(abs(a - b) for a, b in zip(want[2:], sync[2:])) > 1e-3, (want, sync)
    records = [rec for rank in range(stages) for rec in read_jsonl(f"{trace}_rank{rank}.jsonl")]
    assert len(records) == stages * STEPS * ACCUM  # every micro-batch's backward ran on every stage
    stale = [rec for rec in records if rec["staleness"] > 0]
    # the last stage is never stale
    assert stale and all(rec["stage"] < stages - 1 for rec in stale)
    assert all(
        rec["backward_version"] - rec["forward_version"] == rec["staleness"] for rec in records
    )
    same = [rec["forward_weights"] == rec["backward_weights"] for rec in stale]
    if emulated.get("stashing", True):
        assert all(same), "a backward used other weights than its forward"
    else:
        assert not any(same), "without stashing a stale backward uses the updated weights"
    train = [
        rec
        for rec in read_jsonl(tmp_path / "run" / "metrics_rank0.jsonl")
        if rec["kind"] == "train"
    ]
    # the step breakdown
    assert all(rec["pipe_send_s"] > 0 and rec["pipe_recv_s"] > 0 for rec in train)


def test_the_wire_is_the_training_precision_unless_given():
    given = parse(["--engine", "async-pipeline", "--pipe-wire-dtype", "fp32"]).asynchrony
    default = parse(["--engine", "async-pipeline"]).asynchrony
    assert (default.wire_dtype("fp32"), default.wire_dtype("bf16")) == ("fp32", "bf16")
    assert given.wire_dtype("bf16") == "fp32"  # as bf16 runs sent before the option: allowed


# Largest relative loss difference from the fp32 wire over STEPS steps of 2 stages, and the
# tolerance: bf16 measured 2.4e-5, fp16 7.3e-6 (fp16 carries 3 more mantissa bits; its gradients'
# range is docs/async-pipeline.md's matter).
WIRES = {"fp32": 1e-5, "bf16": 2e-4, "fp16": 1e-4}


@pytest.mark.ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("wire", WIRES)
def test_a_narrower_wire_halves_the_bytes_and_trains_alike(tmp_path, wire):
    """fp32 training with --pipe-wire-dtype: the emulator's losses (the fp32 wire's) within the
    tolerance, and half the bytes: each step, stage 0 sends ACCUM activations and stage 1 ACCUM
    gradients of MICRO x 17 tokens x 64."""
    trace = tmp_path / "trace"
    r = launch(
        [
            "--engine",
            "async-pipeline",
            "--pipeline-stages",
            2,
            "--steps",
            STEPS,
            "--log-interval",
            1,
            "--eval-interval",
            4,
            "--no-save",
            "--log-dir",
            tmp_path / "run",
            "--pipe-wire-dtype",
            wire,
        ],
        timeout=240,
        env=plugin_env(async_trace=str(trace)),
    )
    assert r.ok, r
    s = parse(["--engine", "async-pipeline"])
    assert_close(
        losses_of(tmp_path / "run"), emulate(s, digits_batches(s, STEPS), 2, STEPS), rel=WIRES[wire]
    )
    full = ACCUM * MICRO * 17 * 64 * 4
    for rank in range(2):
        train = [
            rec
            for rec in read_jsonl(tmp_path / "run" / f"metrics_rank{rank}.jsonl")
            if rec["kind"] == "train"
        ]
        # no eval's
        assert [rec["wire_bytes"] for rec in train] == [
            full if wire == "fp32" else full / 2
        ] * STEPS
    for name in ("config.json", "summary.json"):
        assert json.loads((tmp_path / "run" / name).read_text())["pipe_wire_dtype"] == wire
    received = {rec["input"] for rec in read_jsonl(f"{trace}_rank1.jsonl")}
    # cast back on arrival; its gradient goes back
    assert received == {"float32, leaf requiring grad"}


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_resume_is_exact(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = [
        "--engine",
        "async-pipeline",
        "--pipeline-stages",
        2,
        "--log-interval",
        1,
        "--eval-interval",
        3,
    ]
    r = launch([*common, "--steps", 8, "--save-interval", 4, "--log-dir", full], timeout=240)
    assert r.ok, r
    r = launch(
        [*common, "--steps", 8, "--resume", full / "checkpoints" / "step4", "--log-dir", resumed],
        timeout=240,
    )
    assert r.ok, r
    want, got = train_losses(full), train_losses(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got, want)
    evals = [
        [rec for rec in read_jsonl(d / "metrics_rank0.jsonl") if rec["kind"] == "eval"][-1]
        for d in (full, resumed)
    ]
    assert evals[0]["eval_loss"] == pytest.approx(evals[1]["eval_loss"], rel=1e-6)
    # The checkpoint's stages are whole weights for --pretrained-path, under timm's names.
    from vit.model.weights import read_state

    state = read_state(str(full / "checkpoints" / "step8"))
    assert {"cls_token", "patch_embed.proj.weight", "head.weight"} <= set(state)


@pytest.mark.ranks
@pytest.mark.timeout(420)
def test_a_checkpoint_of_two_stages_resumes_on_one_rank(tmp_path):
    """The weights, AdamW state and --model-ema's average by parameter name. A checkpoint drains
    the pipeline, so with one every step and no per-stage clipping the 2-stage run takes the 1-stage
    run's steps: the resumed run's next 10 losses are its."""
    two, one = tmp_path / "two", tmp_path / "one"
    common = ["--engine", "async-pipeline", "--steps", 13, "--log-interval", 1, "--clip-grad", 0]
    common += ["--eval-interval", 0, "--save-interval", 1, "--keep-checkpoints", 20]
    common += ["--model-ema", "--model-ema-decay", 0.9]
    r = launch([*common, "--pipeline-stages", 2, "--log-dir", two], timeout=300)
    assert r.ok, r
    step3 = two / "checkpoints" / "step3"
    args = [*common, "--pipeline-stages", 1, "--resume", step3, "--log-dir", one]
    r = launch(args, nprocs=1, timeout=300)
    assert r.ok, r
    said = "--resume: async-pipeline checkpoint of 2 stages on 1: weights and AdamW state"
    assert said in r.outputs[0], r.outputs[0]
    want, got = train_losses(two), train_losses(one)
    assert sorted(got) == list(range(4, 14)), got
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got, want)
    # one step on, AdamW's step count went on from 3
    state = torch.load(one / "checkpoints" / "step4" / "async_stage0.pt", weights_only=False)
    adam = state["optimizer"]["state"]
    assert adam and all(float(st["step"]) == 4 for st in adam.values())
    # --model-ema's average, each stage's layers taken by name: one step on, it is 0.9 x the saved
    # one + 0.1 x the weights. (The 2-stage run's own goes on otherwise: stage 0 has not applied a
    # step's update yet when the average takes its weights.)
    ema3 = {
        k: v
        for f in step3.glob("ema_rank*.pt")
        for k, v in torch.load(f, weights_only=True).items()
    }
    ema4 = torch.load(one / "checkpoints" / "step4" / "ema_rank0.pt", weights_only=True)
    assert ema4.keys() == ema3.keys() == state["module"].keys()
    for k, w in state["module"].items():
        assert torch.allclose(ema4[k], 0.9 * ema3[k] + 0.1 * w, rtol=1e-5, atol=1e-7), k


def partial_batch_worker(out: str) -> None:
    """One rank of a 2-stage engine, built directly: two steps whose last micro-batch has 5 samples,
    then the logits of 7 images."""
    import torch.distributed as dist

    from vit.core.batch import Batch
    from vit.engines import EngineContext, build

    dist.init_process_group("gloo")
    s = defaults()
    batches = digits_batches(s, 2)
    batches[-1] = (batches[-1][0][:5], batches[-1][1][:5])
    data = digits(s)
    layers = build_layers(
        s.model.model, data.num_classes, data.in_chans, data.img_size, s.train.seed
    )
    engine = build(
        "async-pipeline",
        EngineContext(
            layers,
            {"gradient_clipping": CLIP},
            Batch(MICRO, ACCUM, 1),
            torch.device("cpu"),
            s.optim,
            2,
            "fp32",
            pipeline_stages=2,
            smoothing=s.recipe.smoothing,
        ),
    )
    it = iter(batches)
    losses = [engine.mean_loss(engine.train_step(it)).item() for _ in range(2)]
    logits = engine.eval_logits(data.test[0][0][None].repeat(7, 1, 1, 1), None)
    if dist.get_rank() == 1:
        Path(out).write_text(json.dumps({"losses": losses, "logits": list(logits.shape)}))
    engine.links.flush()
    dist.destroy_process_group()


@pytest.mark.ranks
@pytest.mark.timeout(180)
def test_the_last_partial_batch_goes_through(tmp_path):
    from vit.runtime.dist_env import free_port

    out, port = tmp_path / "out.json", free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, str(out)],
            cwd=ROOT,
            env=base_env(
                RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
            ),
            start_new_session=True,
        )
        for rank in range(2)
    ]
    try:
        assert [p.wait(timeout=150) for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    got = json.loads(out.read_text())
    s = defaults()
    batches = digits_batches(s, 2)
    batches[-1] = (batches[-1][0][:5], batches[-1][1][:5])
    # the partial micro-batch weighs as a whole one
    assert_close(got["losses"], emulate(s, batches, 2, 2))
    assert got["logits"] == [7, 10]


BAD = {
    "stashing option with another engine": (
        ["--engine", "zero", "--weight-stashing", "off"],
        "--weight-stashing has no effect without --engine async-pipeline",
    ),
    "wire dtype with another engine": (
        ["--engine", "ddp", "--pipe-wire-dtype", "bf16"],
        "--pipe-wire-dtype has no effect without --engine async-pipeline",
    ),
    "interval does not divide the accumulation": (
        ["--engine", "async-pipeline", "--pipeline-stages", "1", "--async-update-interval", "3"],
        "--async-update-interval 3 does not divide the gradient-accumulation count 4",
    ),
    "nesterov with adamw": (["--nesterov"], "--nesterov needs --opt sgd"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_combinations_are_one_line(tmp_path, monkeypatch, case):
    """Refused before any process group (in-process; test_train.py runs one refusal through the
    entry point: exit 2, the line)."""
    args, message = BAD[case]
    with pytest.raises(ConfigError) as e:
        plan_in_process(monkeypatch, [*args, "--log-dir", tmp_path / "run"])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists()


if __name__ == "__main__":  # a rank of test_the_last_partial_batch_goes_through
    partial_batch_worker(sys.argv[1])
