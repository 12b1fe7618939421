"""A ZeRO checkpoint resumed on another number of ranks (vit.loop.universal: DeepSpeed's universal
checkpoint, converted by ds_to_universal at the resume): the same losses as the run that goes on
on its own ranks, the global batch kept."""

import pytest
from helpers import MPIRUN, ROOT, base_env, launch, run_cmd, train_losses

COMMON = ["--steps", 6, "--log-interval", 1, "--monitor-interval", 0, "--eval-interval", 0]


@pytest.mark.ranks
@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_a_zero_checkpoint_resumes_on_fewer_and_more_ranks(tmp_path, config):
    first = tmp_path / "first"
    ds = ["--ds-config", f"deepspeed_configs/{config}.json"]
    r = launch([*COMMON, *ds, "--save-interval", 3, "--log-dir", first], timeout=240)
    assert r.ok, r
    want = {s: v for s, v in train_losses(first).items() if s > 3}
    step3 = first / "checkpoints" / "step3"
    # 1 rank: 32 x 2 x 1, the global batch of 32 x 1 x 2
    one = tmp_path / "one"
    r = launch([*COMMON, *ds, "--resume", step3, "--grad-accum", 2, "--log-dir", one], nprocs=1)
    assert r.ok, r
    said = f"ZeRO-{config[-1]} state of 2 data-parallel ranks, loaded on 1 through DeepSpeed's"
    assert said in r.outputs[0], r.outputs[0]
    got = train_losses(one)
    assert sorted(got) == [4, 5, 6] and all(got[s] == pytest.approx(want[s], rel=1e-4) for s in got)
    assert not list(first.glob("checkpoints/.universal-*"))  # the converted copy is gone
    if config != "zero2":
        return
    # 4 ranks under mpirun: 16 x 1 x 4
    four = tmp_path / "four"
    args = [*COMMON, *ds, "--resume", step3, "--micro-batch-size", 16, "--log-dir", four]
    cmd = [*MPIRUN, "-np", "4", str(ROOT / "entry_cn.sh"), *map(str, args)]
    r = run_cmd(cmd, env=base_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = train_losses(four)
    assert sorted(got) == [4, 5, 6] and all(got[s] == pytest.approx(want[s], rel=1e-4) for s in got)
