"""A ZeRO checkpoint resumed on another number of ranks, or under --engine ddp, and a pipeline's on
other stages (vit.checkpoints.universal: DeepSpeed's universal checkpoint, converted by
ds_to_universal at the resume): the same losses as the run that goes on on its own ranks, the global
batch kept."""

import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers import MPIRUN, ROOT, base_env, launch, plugin_env, run_cmd, train_losses

COMMON = ["--steps", 6, "--log-interval", 1, "--monitor-interval", 0, "--eval-interval", 0]
EMA = ["--model-ema", "--model-ema-decay", 0.9]  # far enough from the weights in 3 steps


@pytest.fixture(scope="module")
def saved_zero_run(tmp_path_factory):
    """The run of a ZeRO config (zero2, zero3) that the tests resume: 2 ranks, COMMON, checkpoints
    at steps 3 and 6; started by the first test that asks for it (within that test's timeout),
    shared by the next (ZeRO-3's: two tests). A resume writes into other folders."""
    runs = {}

    def saved(config: str):
        if config not in runs:
            first = tmp_path_factory.mktemp(config)
            ds = ["--ds-config", f"deepspeed_configs/{config}.json"]
            r = launch([*COMMON, *ds, "--save-interval", 3, "--log-dir", first], timeout=240)
            assert r.ok, r
            runs[config] = first
        return runs[config]

    return saved


@pytest.mark.ranks
@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_a_zero_checkpoint_resumes_on_fewer_and_more_ranks(tmp_path, saved_zero_run, config):
    first = saved_zero_run(config)
    ds = ["--ds-config", f"deepspeed_configs/{config}.json"]
    want = {s: v for s, v in train_losses(first).items() if s > 3}
    step3 = first / "checkpoints" / "step3"
    # 1 rank: 32 x 2 x 1, the global batch of 32 x 1 x 2 kept without being asked
    one = tmp_path / "one"
    r = launch([*COMMON, *ds, "--resume", step3, "--log-dir", one], nprocs=1)
    assert r.ok, r
    said = f"ZeRO-{config[-1]} state of 2 data-parallel ranks, loaded on 1 through DeepSpeed's"
    assert said in r.outputs[0], r.outputs[0]
    assert (
        "global batch 64 kept on 1 data-parallel ranks: micro-batch 32 x grad accum 2"
        in (r.outputs[0])
    )
    got = train_losses(one)
    assert sorted(got) == [4, 5, 6] and all(got[s] == pytest.approx(want[s], rel=1e-4) for s in got)
    assert not list(first.glob("checkpoints/.universal-*"))  # the converted copy is gone
    # 3 steps on, every parameter's weights and AdamW moments are the uninterrupted run's (ZeRO-3:
    # 2.9% off before vit.engines.zero.engine mended DeepSpeed's universal load)
    want6 = universal_state(tmp_path, first / "checkpoints" / "step6", "want")
    got6 = universal_state(tmp_path, one / "checkpoints" / "step6", "one")
    assert got6.keys() == want6.keys()
    for key, value in want6.items():
        assert torch.allclose(got6[key], value, rtol=1e-5, atol=1e-7), key
    if config != "zero2":
        return
    # 4 ranks under mpirun: 16 x 1 x 4, chosen by the resume
    four = tmp_path / "four"
    args = [*COMMON, *ds, "--resume", step3, "--log-dir", four]
    cmd = [*MPIRUN, "-np", "4", str(ROOT / "entry_cn.sh"), *map(str, args)]
    r = run_cmd(cmd, env=base_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "kept on 4 data-parallel ranks: micro-batch 16 x grad accum 1" in r.stdout + r.stderr
    got = train_losses(four)
    assert sorted(got) == [4, 5, 6] and all(got[s] == pytest.approx(want[s], rel=1e-4) for s in got)
    # 4 copies sum their gradients in another order: within 1e-3 of each tensor's largest value
    # (the attention's key bias: see the pipeline's test below)
    got6 = universal_state(tmp_path, four / "checkpoints" / "step6", "four")
    for key, value in want6.items():
        assert torch.allclose(got6[key], value, rtol=1e-5, atol=1e-3 * float(value.abs().max()))


@pytest.mark.ranks
@pytest.mark.timeout(600)
def test_a_zero3_resume_the_mend_does_not_fit_is_refused(tmp_path, saved_zero_run):
    """vit.engines.zero.engine's checks before it mends DeepSpeed's ZeRO-3 universal load: this
    run's parameter groups against the checkpoint's (another --layer-decay: another number of
    groups; another --weight-decay: the same number, other values), and the DeepSpeed release
    against the ones the mend was verified on. Each: one line on rank 0, exit 2. Before: another
    --weight-decay trained on with the checkpoint's (exit 0); another --layer-decay stopped at step
    0 with torch's LR scheduler's "zip() argument 2 is shorter than argument 1" (exit 1)."""
    ds = ["--ds-config", "deepspeed_configs/zero3.json"]
    step3 = saved_zero_run("zero3") / "checkpoints" / "step3"
    at = "checkpoint step3, loaded through DeepSpeed's universal checkpoint: "
    for case, (extra, env, said) in enumerate(
        [
            (
                ["--weight-decay", 0.1],
                None,
                f"{at}parameter group 0 has learning rate 0.002 and weight decay 0.05 there, 0.002 "
                "and 0.1 in this run: resume with the run's",
            ),
            (
                ["--layer-decay", 0.75],
                None,
                f"{at}its optimizer has 2 parameter groups, this run's 12 (--layer-decay makes one "
                "pair per layer): resume with the run's --lr, --layer-decay and --weight-decay",
            ),
            (
                [],
                plugin_env(deepspeed_version="0.20.0"),
                "checkpoint step3: ZeRO-3 state of another number of ranks, and DeepSpeed 0.20.0's "
                "universal load is not one this project has checked",
            ),
        ]
    ):
        again = tmp_path / f"again{case}"
        args = [*COMMON, *ds, *extra, "--resume", step3, "--log-dir", again]
        r = launch(args, nprocs=1, env=env)
        assert r.returncodes == [2], r
        assert said in r.outputs[0] and "Traceback" not in r.outputs[0], r
        assert not list(again.glob("checkpoints/step*")), r  # nothing trained, nothing saved


@pytest.mark.timeout(60)
def test_groups_the_load_left_otherwise_than_saved_are_refused():
    """The check after the load (vit.engines.zero.engine.check_loaded), on what DeepSpeed 0.19.8's
    ZeRO-3 load leaves before the mend: group 0's settings on every group."""
    from vit.core.errors import ConfigError
    from vit.engines.zero.engine import check_loaded

    saved = [{"lr": 1e-3, "weight_decay": 0.05}, {"lr": 1e-3, "weight_decay": 0.0}]
    check_loaded([dict(g) for g in saved], saved, "step3")
    said = "left parameter group 1 with learning rate 0.001 and weight decay 0.05, the checkpoint's"
    with pytest.raises(ConfigError, match=said):
        check_loaded([dict(saved[0]), dict(saved[0])], saved, "step3")


@pytest.mark.ranks
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])  # stage 3's universal checkpoint keeps AdamW's step apart
def test_a_zero_checkpoint_resumes_under_ddp_with_its_adam_state(tmp_path, stage):
    first, ddp = tmp_path / "first", tmp_path / "ddp"
    ds = ["--ds-config", f"deepspeed_configs/zero{stage}.json", "--precision", "fp32"]
    steps = ["--steps", 13, "--log-interval", 1, "--monitor-interval", 0, "--eval-interval", 0]
    every = ["--save-interval", 1, "--keep-checkpoints", 20]
    r = launch([*steps, *ds, *every, "--log-dir", first], timeout=240)
    assert r.ok, r
    want = {s: v for s, v in train_losses(first).items() if s > 3}
    step3 = first / "checkpoints" / "step3"
    args = [*steps, *every, "--engine", "ddp", "--resume", step3, "--log-dir", ddp]
    r = launch(args, timeout=240)
    assert r.ok, r
    said = (
        f"ZeRO-{stage} state of 2 data-parallel ranks of --engine zero, under --engine ddp, loaded"
    )
    assert said in r.outputs[0], r.outputs[0]
    got = train_losses(ddp)
    assert sorted(got) == list(range(4, 14)), got
    for step in got:  # the first 10 steps after the resume
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
    # one step on, ddp's AdamW holds what the ZeRO run's holds: its weights after step 4 are the
    # ZeRO run's (DeepSpeed's own zero_to_fp32 on its checkpoint of step 4), AdamW's step is 4
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    zero4 = get_fp32_state_dict_from_zero_checkpoint(str(first / "checkpoints"), "step4")
    ddp4 = torch.load(ddp / "checkpoints" / "step4" / "ddp.pt", weights_only=False)
    assert zero4.keys() <= ddp4["model"].keys()
    for name, w in zero4.items():
        got, w = comparable(name, ddp4["model"][name]), comparable(name, w)
        assert torch.allclose(got, w, rtol=1e-5, atol=1e-7), name
    adam = ddp4["optimizer"]["state"]
    assert len(adam) == len(zero4) and all(float(st["step"]) == 4 for st in adam.values())


def comparable(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What of a parameter another summation order of the gradients keeps: the attention's key
    bias has a gradient of zero in exact arithmetic (softmax ignores a shift shared by a row), so
    AdamW's update of it is the sign of rounding noise: of the qkv bias, q and v only."""
    if not name.endswith("attn.qkv.bias"):
        return tensor
    q, _, v = tensor.chunk(3)
    return torch.cat([q, v])


def universal_state(tmp_path, checkpoint, name) -> dict:
    """DeepSpeed's own converter on a checkpoint: every parameter's fp32 weights and AdamW moments
    by name."""
    from deepspeed.checkpoint import ds_to_universal

    out = tmp_path / name / "step"
    # in this process with one worker each (no process started): the command line it reads
    argv = ["ds_to_universal", "--input_folder", str(checkpoint), "--output_folder", str(out)]
    argv += ["--num_extract_workers", "1", "--num_merge_workers", "1"]
    with mock.patch.object(sys, "argv", argv):
        ds_to_universal.main(ds_to_universal.parse_arguments())
    loaded = {
        f"{p.name}/{k}": torch.load(p / f"{k}.pt", weights_only=False)
        for p in (out / "zero").iterdir()
        if p.is_dir()
        for k in ("fp32", "exp_avg", "exp_avg_sq")
    }
    return {k: v["param"] if isinstance(v, dict) else v for k, v in loaded.items()}  # ZeRO-3: bare


@pytest.mark.ranks
@pytest.mark.timeout(900)
def test_a_pipeline_checkpoint_resumes_on_one_rank_and_on_two_stages_by_two(tmp_path):
    """DeepSpeed's pipeline (ZeRO-1) saved as 2 stages on 2 ranks: resumed as 1 stage on 1 rank and
    as 2 stages x 2 data-parallel copies on 4, the global batch kept; the next 10 losses and, 3
    steps on, every parameter's weights and AdamW moments are the uninterrupted run's."""
    common = ["--engine", "pipeline", "--steps", 13, *COMMON[2:], "--save-interval", 3]
    common += ["--keep-checkpoints", 20]
    first = tmp_path / "first"
    r = launch([*common, "--pipeline-stages", 2, "--log-dir", first], timeout=300)
    assert r.ok, r
    want = {s: v for s, v in train_losses(first).items() if s > 3}
    want6 = universal_state(tmp_path, first / "checkpoints" / "step6", "want")
    step3 = first / "checkpoints" / "step3"
    for ranks, stages, said in [
        (1, 1, "ZeRO-1 state of 2 pipeline stages x 1 data-parallel ranks, loaded on 1 x 1"),
        (4, 2, "ZeRO-1 state of 1 data-parallel ranks, loaded on 2 through"),
    ]:
        out = tmp_path / f"on{ranks}"
        args = [*common, "--pipeline-stages", stages, "--resume", step3, "--log-dir", out]
        cmd = [*MPIRUN, "-np", str(ranks), str(ROOT / "entry_cn.sh"), *map(str, args)]
        r = run_cmd(cmd, env=base_env(), timeout=400)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert said in r.stdout + r.stderr, r.stdout[-3000:]
        got = train_losses(out)
        assert sorted(got) == list(range(4, 14)), got
        for step in got:
            assert got[step] == pytest.approx(want[step], rel=1e-5), (ranks, step, got, want)
        got6 = universal_state(tmp_path, out / "checkpoints" / "step6", f"got{ranks}")
        assert got6.keys() == want6.keys()
        for key, value in want6.items():
            # 2 data-parallel copies sum their gradients in another order; the attention's key
            # bias has a gradient of rounding noise only, which AdamW scales up to LR-sized steps
            # (1.6e-6 off on values of 1e-2 here): within 1e-3 of each tensor's largest value
            atol = 1e-7 if ranks == 1 else 1e-3 * float(value.abs().max())
            assert torch.allclose(got6[key], value, rtol=1e-5, atol=atol), (ranks, key)


def assert_same_ema(checkpoint, want_checkpoint) -> None:
    """Every rank's --model-ema file in `checkpoint` holds the whole model's average, equal to the
    one the ranks of `want_checkpoint` held between them (its stages' files joined) to rel 1e-5
    (the key bias aside: `comparable`)."""
    want = {
        k: v
        for f in Path(want_checkpoint).glob("ema_rank*.pt")
        for k, v in torch.load(f, weights_only=True).items()
    }
    files = sorted(Path(checkpoint).glob("ema_rank*.pt"))
    assert files and want
    for f in files:
        got = torch.load(f, weights_only=True)
        assert got.keys() == want.keys(), f
        for key, value in want.items():
            got_key, want_key = comparable(key, got[key]), comparable(key, value)
            assert torch.allclose(got_key, want_key, rtol=1e-5, atol=1e-7), (f.name, key)


@pytest.mark.ranks
@pytest.mark.timeout(600)
def test_the_ema_follows_a_zero_checkpoint_onto_one_and_three_ranks(tmp_path):
    """--model-ema's average is taken by name from whichever rank saved it: 3 steps on, on 1 rank
    and on 3 it is the uninterrupted 2-rank run's (before: rank 2 stopped, 'holds no EMA
    weights')."""
    first = tmp_path / "first"
    # global batch 12: 6 x 1 on each of 2 ranks, 6 x 2 on 1, 4 x 1 on 3
    args = [*COMMON, *EMA, "--micro-batch-size", 6, "--save-interval", 3]
    r = launch([*args, "--log-dir", first], timeout=240)
    assert r.ok, r
    for ranks in (1, 3):
        out = tmp_path / f"on{ranks}"
        r = launch([*args, "--resume", first / "checkpoints" / "step3", "--log-dir", out], ranks)
        assert r.ok, r
        assert_same_ema(out / "checkpoints" / "step6", first / "checkpoints" / "step6")


@pytest.mark.ranks
@pytest.mark.timeout(600)
def test_the_ema_follows_a_pipeline_of_two_stages_onto_one(tmp_path):
    """Each stage saved the average of its layers; one stage takes them all, by name, and 3 steps
    on holds the 2-stage run's (before: stage 0's layers loaded strictly into the whole model, a
    traceback). The async pipeline's: tests/test_async_pipeline.py."""
    first, one = tmp_path / "first", tmp_path / "one"
    args = [*COMMON, *EMA, "--engine", "pipeline", "--save-interval", 3]
    r = launch([*args, "--pipeline-stages", 2, "--log-dir", first], timeout=240)
    assert r.ok, r
    step3 = first / "checkpoints" / "step3"
    r = launch([*args, "--pipeline-stages", 1, "--resume", step3, "--log-dir", one], 1)
    assert r.ok, r
    assert_same_ema(one / "checkpoints" / "step6", first / "checkpoints" / "step6")
