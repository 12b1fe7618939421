"""The planner's cost model (vit.planner) against hand-computed cases and brute force, its
monotonicity, and `python -m vit.planner` on a cluster.json in the run's format. Fast, in-process,
except the last test (a real 1-rank run whose log dir the planner reads)."""

import dataclasses
import itertools
import json
import random

import pytest
from helpers import launch

from vit.core.costs import Calibration, Candidate, Layer, Network, Rank, ring_allreduce_s
from vit.core.costs import Workload as Job
from vit.core.errors import ConfigError
from vit.engines.registry import SPECS, spec
from vit.planner import cli
from vit.planner.inputs import ranks_from_census
from vit.planner.predict import label, predict
from vit.planner.search import best_parts, rank_candidates
from vit.telemetry.metrics import write_json

ZERO_COST = Calibration(step_s=0.0, micro_s=0.0, message_s=0.0)
DP_ENGINE = next(e.name for e in SPECS.values() if e.comm_hooks)  # DDP, without naming it
ZERO_ENGINE = next(e.name for e in SPECS.values() if e.zero_stage is None and not e.pipeline)
DS_PIPE = next(e.name for e in SPECS.values() if e.pipeline and e.deepspeed)
ASYNC_PIPE = next(e.name for e in SPECS.values() if e.pipeline and not e.deepspeed)
BIG = 1e12  # memory that never binds


def two_hosts(fwd=(1e-3, 1e-3), bwd=(2e-3, 2e-3), slow=1.0) -> list[Rank]:
    return [
        Rank("a", fwd, bwd, BIG),
        Rank("b", tuple(slow * f for f in fwd), tuple(slow * b for b in bwd), BIG),
    ]


def job(n_layers=2, params=1000, out=5, precision="fp32", batch=8) -> Job:
    return Job(tuple(Layer(params, 10.0, out) for _ in range(n_layers)), batch, precision)


def net(bw: float, latency: float = 0.0) -> Network:
    return Network({"a": bw, "b": bw}, latency)


def test_ddp_step_is_compute_plus_the_all_reduce_not_hidden_by_backward():
    ranks, j = two_hosts(), job()
    c = Candidate(DP_ENGINE, 0, 1, 4, 1)
    # compute 4 x (2 + 4) ms; gradients 2000 params x 4 B, ring of 2: 2(n-1)/n x 8000 B = 8000 B on
    # each edge
    p = predict(c, ranks, net(1e6), j, ZERO_COST)
    assert p.compute_s == pytest.approx(24e-3)
    assert p.link_s == pytest.approx(8e-3)  # one bucket: nothing to overlap, it is the last bucket
    # four buckets: the last (2 ms) is never hidden; the rest hides behind the slowest rank's
    # backward (16 ms)
    four = Calibration(step_s=0.0, micro_s=0.0, message_s=0.0, ddp_bucket_bytes=2000)
    assert predict(c, ranks, net(1e6), j, four).link_s == pytest.approx(2e-3)
    # comm 80 ms - backward
    assert predict(c, ranks, net(1e5), j, four).link_s == pytest.approx(80e-3 - 16e-3)
    no_overlap = Calibration(
        step_s=0.0, micro_s=0.0, message_s=0.0, ddp_bucket_bytes=2000, ddp_overlap=False
    )
    assert predict(c, ranks, net(1e5), j, no_overlap).link_s == pytest.approx(80e-3)
    fixed = predict(
        Candidate(DP_ENGINE, 0, 1, 2, 2),
        ranks,
        net(1e6),
        j,
        Calibration(step_s=0.01, micro_s=0.001),
    )
    assert fixed.fixed_s == pytest.approx(0.012) and fixed.compute_s == pytest.approx(24e-3)
    assert p.step_s == pytest.approx(32e-3) and p.bottleneck == "compute"


def test_zero_stages_cost_their_measured_factors_and_bf16_halves_only_the_reduction():
    ranks, j = two_hosts(), job()
    ring = 8000 / 1e6  # 2000 fp32 gradients, ring of 2
    for stage, factor in enumerate(Calibration().zero_comm_factor):
        p = predict(Candidate(ZERO_ENGINE, stage, 1, 4, 1), ranks, net(1e6), j, ZERO_COST)
        assert p.link_s == pytest.approx(factor * ring), stage
        # communication_data_type bf16 halves the gradients' reduction, not the fp32 parameters'
        # gathering (measured at 7.5 Mbit/s on 5 hosts: ZeRO-1 and 2 with it took 2.0x ddp's
        # bf16-hook step, docs/planner.md)
        half = predict(
            Candidate(ZERO_ENGINE, stage, 1, 4, 1, "comm-bf16"), ranks, net(1e6), j, ZERO_COST
        )
        assert half.link_s == pytest.approx(ring / 2 + (factor - 1) * ring)
    assert Calibration().zero_comm_factor == (1.0, 1.46, 1.46, 1.75)
    # ZeRO-2 and 3 reduce at every micro-batch
    for stage, reductions in ((0, 1), (1, 1), (2, 2), (3, 2)):
        accum = predict(Candidate(ZERO_ENGINE, stage, 1, 2, 2), ranks, net(1e6), j, ZERO_COST)
        factor = Calibration().zero_comm_factor[stage]
        assert accum.link_s == pytest.approx(reductions * ring + (factor - 1) * ring), stage
    assert predict(
        Candidate(ZERO_ENGINE, 2, 1, 4, 1),
        ranks,
        net(1e6),
        job(precision="bf16"),
        # DeepSpeed reduces bf16 gradients
        ZERO_COST,
    ).link_s == pytest.approx(1.46 * ring / 2)


def test_pipeline_step_is_its_slowest_stage_over_its_slots_or_link_async_without_bubble():
    ranks, j = two_hosts(slow=2.0), job(batch=8)
    c = Candidate(DS_PIPE, 0, 2, 2, 4, parts=(0, 1, 2))
    # stage 0: 2 x 3 ms; stage 1 (slowed x2): 2 x 6 ms a micro-batch; the boundary: 2 samples x 5
    # fp32 = 40 B each way; at 1e4 B/s each stage's link is busy 4 ms a micro-batch (full duplex),
    # at 1e3 B/s 40 ms
    p = predict(c, ranks, net(1e4), j, ZERO_COST)
    # m + S - 1 slots of the slowest stage's compute
    assert p.step_s == pytest.approx((4 + 2 - 1) * 12e-3)
    assert (p.compute_s, p.link_s, p.bubble_s) == pytest.approx((4 * 12e-3, 0.0, 12e-3))
    slow = predict(c, ranks, net(1e3), j, ZERO_COST)
    assert slow.step_s == pytest.approx(4 * 40e-3) and slow.link_s == pytest.approx(
        4 * 40e-3 - 5 * 12e-3
    )
    assert slow.bottleneck == "link"
    additive = Calibration(step_s=0.0, micro_s=0.0, message_s=0.0, pipe_overlap=False)
    # every slot pays its transfer: (m + S - 1) x (12 + 4) ms
    each = predict(c, ranks, net(1e4), j, additive)
    assert each.step_s == pytest.approx(5 * 16e-3)
    assert (each.compute_s, each.link_s, each.bubble_s) == pytest.approx(
        (4 * 12e-3, 5 * 4e-3, 12e-3)
    )
    a = predict(Candidate(ASYNC_PIPE, 0, 2, 2, 4, parts=(0, 1, 2)), ranks, net(1e4), j, ZERO_COST)
    assert a.bubble_s == 0.0 and a.step_s == pytest.approx(4 * 12e-3)
    a_slow = predict(
        Candidate(ASYNC_PIPE, 0, 2, 2, 4, parts=(0, 1, 2)), ranks, net(1e3), j, ZERO_COST
    )
    wire = predict(
        Candidate(ASYNC_PIPE, 0, 2, 2, 4, "wire-bf16", parts=(0, 1, 2)),
        ranks,
        net(1e3),
        j,
        ZERO_COST,
    )
    # bf16 halves the p2p bytes
    assert (a_slow.step_s, wire.step_s) == pytest.approx((4 * 40e-3, 4 * 20e-3))


def test_ranks_sharing_a_machines_processors_pay_less_for_the_pipelines_fill_and_drain():
    same = [Rank(h, (1e-3,) * 5, (2e-3,) * 5, BIG, machine="m", contention=2.5) for h in "abcde"]
    j, c = job(n_layers=5, batch=10), Candidate(DS_PIPE, 0, 5, 2, 5, parts=(0, 1, 2, 3, 4, 5))
    # 9 slots; 1, 2, 3, 4, 5, 4, 3, 2, 1 of the 5 ranks compute; measured with all 5 at once (2.5x
    # alone), k of them take max(1 / 2.5, k / 5) of a slot: 0.4 + 0.4 + 0.6 + 0.8 + 1 + 0.8 + 0.6 +
    # 0.4 + 0.4 = 5.4 slots
    assert spec(c.engine).busy_slots(c, same) == pytest.approx(5.4)
    p = predict(c, same, net(1e9), j, ZERO_COST)  # each stage 2 x 3 ms a micro-batch
    assert (p.compute_s, p.bubble_s, p.slots_paid) == pytest.approx((5 * 6e-3, 0.4 * 6e-3, 5.4))
    # GPUs of one machine (nothing contended), ranks on machines of their own, and the async
    # pipeline: whole slots
    # within SHARED: noise, not sharing
    gpus = [dataclasses.replace(r, contention=1.1) for r in same]
    apart = [dataclasses.replace(r, machine="") for r in same]
    assert spec(c.engine).busy_slots(c, gpus) == spec(c.engine).busy_slots(c, apart) == 9
    assert spec(ASYNC_PIPE).busy_slots(dataclasses.replace(c, engine=ASYNC_PIPE), same) == 5
    # two machines of two ranks each, contended 2x: 7 slots, computing {0}, {0,1}, .., {3}; a slot
    # takes the largest share of its machines': 0.5 (1 of A's 2), 1, 1, 1, 1 (B's 2 of 2), 1, 0.5
    pairs = [
        Rank(h, (1e-3,) * 4, (2e-3,) * 4, BIG, machine=m, contention=2.0)
        for h, m in zip("abcd", "AABB")
    ]
    assert spec(DS_PIPE).busy_slots(
        Candidate(DS_PIPE, 0, 4, 2, 4, parts=(0, 1, 2, 3, 4)), pairs
    ) == pytest.approx(6.0)
    # the census gives both where --engine auto measured them; an older one neither
    census = [
        {"host": "a", "mem_free_gib": 1.0, "block_ms": 3.0, "machine": "m", "contention": 2.5},
        {"host": "b", "mem_free_gib": 1.0, "block_ms": 3.0},
    ]
    ranks, _ = ranks_from_census(census, [1.0, 1.0, 1.0], 1)
    assert [(r.machine, r.contention) for r in ranks] == [("m", 2.5), ("", 1.0)]


def test_pipeline_data_parallel_copies_all_reduce_their_stage_gradients():
    ranks = [Rank(h, (1e-3, 1e-3), (2e-3, 2e-3), BIG) for h in "abab"]
    n = Network({"a": 1e6, "b": 1e6})
    c = Candidate(DS_PIPE, 0, 2, 2, 2, parts=(0, 1, 2))
    # stage 0 on ranks 0, 1 (hosts a, b), stage 1 on ranks 2, 3 (a, b): each copy's boundary stays
    # on its host (hidden by compute); then each stage's 1000 fp32 gradients in a ring of 2 over a
    # and b
    p = predict(c, ranks, n, job(), ZERO_COST)
    assert p.link_s == pytest.approx(4000 / 1e6)
    assert p.step_s == pytest.approx(3 * 6e-3 + 4000 / 1e6)


def test_ring_bandwidth_is_set_by_the_busiest_nic():
    n = Network({"a": 1e6, "b": 1e6, "c": 5e5})
    contiguous = ring_allreduce_s(4000, ["a", "a", "b", "b"], n, ZERO_COST)
    interleaved = ring_allreduce_s(4000, ["a", "b", "a", "b"], n, ZERO_COST)
    assert contiguous == pytest.approx(1.5 * 4000 / 1e6)
    assert interleaved == pytest.approx(2 * contiguous)  # each NIC carries two ring edges
    # the slower NIC
    assert ring_allreduce_s(4000, ["a", "c"], n, ZERO_COST) == pytest.approx(4000 / 5e5)
    assert ring_allreduce_s(4000, ["a"], n, ZERO_COST) == 0.0
    lat = Network({"a": 1e6, "b": 1e6}, latency_s=1e-3)
    assert ring_allreduce_s(0.5, ["a", "b"], lat, ZERO_COST, messages=3) == pytest.approx(
        0.5 / 1e6 + 3 * 2 * 1e-3
    )


def every(sync_every: int, fragments: int = 1) -> Job:
    """job() with DiLoCo's planner input for --sync-every and --fragments."""
    args = {"sync_every": sync_every, "fragments": fragments}
    return dataclasses.replace(job(), inputs=cli.planner_inputs(args))


def test_diloco_pays_one_all_reduce_of_the_weights_every_sync_every_steps():
    ranks = two_hosts()
    c = Candidate("diloco", 0, 1, 4, 1)
    # 2000 params x 4 B, ring of 2: 8000 B on each edge at 1e6 B/s = 8 ms a sync, amortised over H
    for h in (1, 10, 50):
        j = every(h)
        assert predict(c, ranks, net(1e6), j, ZERO_COST).link_s == pytest.approx(8e-3 / h)
    int8 = dataclasses.replace(c, compression="outer-int8")
    j = every(10)
    assert predict(int8, ranks, net(1e6), j, ZERO_COST).link_s == pytest.approx(
        8e-3 / 10 * (1 + 4 / 256) / 4
    )
    # streaming, F = 2 of H = 10: 4 ms a fragment behind the 5 steps after it; the compute of
    # those steps hides it all, or all but 4 ms - 5 x compute, paid once in 5 steps
    whole = predict(c, ranks, net(1e6), j, ZERO_COST)
    two = predict(c, ranks, net(1e6), every(10, fragments=2), ZERO_COST)
    assert two.link_s == pytest.approx(max(0.0, 4e-3 - 5 * whole.compute_s) / 5)
    assert two.compute_s == whole.compute_s and two.link_s < whole.link_s


def test_powersgd_sends_low_rank_factors_of_the_matrices_it_compresses():
    layer = Layer(100 * 50 + 4 * 4 + 50, 0.0, 1, ((100, 50), (4, 4)))
    j = Job((layer,), 8, "fp32", cli.planner_inputs({"powersgd_rank": 4}))
    # 100x50: 5000 > 2 x 150 x 4, sends 150 x 4; 4x4: 16 <= 2 x 8 x 4, sends whole; the 50-vector
    # whole
    assert spec(DP_ENGINE).grad_bytes(j, j.layers, "powersgd") == (600 + 16 + 50) * 4


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_compression_never_increases_the_bytes(precision):
    j = Job((Layer(100 * 50 + 50, 0.0, 7, ((100, 50),)),), 8, precision)
    for engine in SPECS.values():
        if precision == "fp16" and not engine.fp16:
            continue
        for comp in engine.compressions(precision):
            assert engine.grad_bytes(j, j.layers, comp) <= engine.grad_bytes(j, j.layers, "none"), (
                engine,
                comp,
            )
            if engine.pipeline:
                assert engine.wire_bytes_per_elem(precision, comp) <= engine.wire_bytes_per_elem(
                    precision, "none"
                )


def test_a_slower_link_never_makes_a_candidate_faster():
    ranks, j = two_hosts(slow=1.5), job(n_layers=4, params=50_000, batch=16)
    cands = [
        Candidate(e.name, z, 1, 4, 2, comp)
        for e in SPECS.values()
        if not e.pipeline
        for z in ((e.zero_stage,) if e.zero_stage is not None else e.zero_stages)
        for comp in e.compressions("fp32")
    ]
    cands += [
        Candidate(e.name, 0, 2, 2, 4, comp, parts=(0, 2, 4))
        for e in SPECS.values()
        if e.pipeline
        for comp in e.compressions("fp32")
    ]
    for c in cands:
        steps = [
            predict(c, ranks, net(bw, 1e-4), j, Calibration()).step_s
            for bw in (1e10, 1e8, 1e6, 1e4)
        ]
        assert steps == sorted(steps), (label(c), steps)


@pytest.mark.parametrize("seed", range(8))
def test_best_partition_equals_an_exhaustive_search(seed):
    rng = random.Random(seed)
    num_layers, stages = rng.randint(4, 8), rng.choice([2, 3])
    hosts = [rng.choice("abc") for _ in range(stages)]
    ranks = [
        Rank(
            h,
            tuple(rng.uniform(1e-4, 3e-3) for _ in range(num_layers)),
            tuple(rng.uniform(1e-4, 6e-3) for _ in range(num_layers)),
            rng.uniform(2e5, 6e5),
        )
        for h in hosts
    ]
    j = Job(
        tuple(
            Layer(rng.randint(1000, 9000), rng.uniform(100, 2000), rng.randint(1, 400))
            for _ in range(num_layers)
        ),
        16,
        "fp32",
    )
    n = Network({"a": 1e6, "b": 3e5, "c": 2e6}, 1e-4)
    c = Candidate(ASYNC_PIPE if seed % 2 else DS_PIPE, 0, stages, 4, 4)
    calib = Calibration(message_s=0.0, pipe_overlap=seed < 3)
    found = best_parts(c, ranks, n, j, calib)
    options = [
        (0, *cuts, num_layers) for cuts in itertools.combinations(range(1, num_layers), stages - 1)
    ]
    predicted = {
        parts: predict(Candidate(c.engine, 0, stages, 4, 4, parts=parts), ranks, n, j, calib)
        for parts in options
    }
    fitting = [p for p in predicted.values() if p.fits]
    best = min(fitting or predicted.values(), key=lambda p: p.step_s)
    assert predicted[found].step_s == pytest.approx(best.step_s)
    assert predicted[found].fits == bool(fitting)
    if calib.pipe_overlap:  # of the splits as fast, the least compute on the busiest stage
        ties = [p for p in fitting or predicted.values() if p.step_s <= best.step_s * (1 + 1e-9)]
        assert predicted[found].compute_s == pytest.approx(min(p.compute_s for p in ties))


def test_where_the_link_sets_the_step_the_slow_rank_still_gets_less_compute():
    ranks = two_hosts(fwd=(1e-3,) * 6, bwd=(2e-3,) * 6, slow=2.0)
    j = job(n_layers=6, out=1000, batch=16)
    c = Candidate(DS_PIPE, 0, 2, 4, 4)
    # 16 kB each way at 10 kB/s: 1.6 s a micro-batch
    parts = best_parts(c, ranks, net(1e4), j, ZERO_COST)
    assert (
        predict(
            Candidate(DS_PIPE, 0, 2, 4, 4, parts=parts), ranks, net(1e4), j, ZERO_COST
        ).bottleneck
        == "link"
    )
    assert parts == (0, 4, 6)  # rank 1, twice as slow, holds 2 of the 6 layers


def test_the_slow_rank_gets_less_work_and_every_engine_is_ranked():
    ranks, j = (
        two_hosts(
            fwd=(1e-4,) + (1e-3,) * 6 + (1e-4,), bwd=(2e-4,) + (2e-3,) * 6 + (2e-4,), slow=2.0
        ),
        job(n_layers=8, params=20_000, out=64, batch=32),
    )
    found = rank_candidates(ranks, net(1.25e8, 1e-4), j, Calibration())
    assert {p.candidate.engine for p in found} == set(SPECS)
    steps = [p.step_s for p in found if p.fits]
    assert steps == sorted(steps) and len(steps) == len(found)
    for p in found:
        c = p.candidate
        if c.split:
            assert c.split[1] < c.split[0]  # rank 1 is twice as slow
            # only where --batch-split proportional runs (diloco refuses it: its steps follow speed)
            assert not spec(c.engine).pipeline and not spec(c.engine).local_steps, c
        if c.stages == 2:
            assert c.parts[2] - c.parts[1] < c.parts[1] - c.parts[0]
    assert any(p.candidate.split for p in found)
    slow_link = rank_candidates(ranks, net(1e4, 1e-4), j, Calibration())
    # 8 kB/s: the gradients' all-reduce dominates
    assert spec(slow_link[0].candidate.engine).pipeline


def test_memory_rules_out_what_does_not_fit():
    tight = [
        Rank("a", (1e-3,) * 2, (2e-3,) * 2, 1000 * 16 * 2 + 10 * 2 * 3),
        Rank("b", (1e-3,) * 2, (2e-3,) * 2, BIG),
    ]
    j = job(params=1000)
    ddp = predict(Candidate(DP_ENGINE, 0, 1, 4, 1), tight, net(1e6), j, ZERO_COST)
    # fp32 weights, gradients (DDP's buckets), moments
    assert ddp.mem_bytes[0] == 2000 * 16 + 20 * 4 and not ddp.fits
    zero3 = predict(Candidate(ZERO_ENGINE, 3, 1, 4, 1), tight, net(1e6), j, ZERO_COST)
    assert zero3.mem_bytes[0] < ddp.mem_bytes[0]


CENSUS_RANK = {
    "bf16": True,
    "capability": None,
    "device": "AMD EPYC",
    "fp16": False,
    "matmul_tflops": 0.1,
    "mem_reserved_gib": 0.0,
    "mem_total_gib": 11.7,
    "mem_free_gib": 11.0,
    "slowdown": 1.0,
}


def write_run(tmp_path, block_ms=(1.6, 3.2), hosts=("h0", "h1")):
    """cluster.json and config.json as vit.run.records.start_record writes them (write_json)."""
    census = [{**CENSUS_RANK, "host": h, "block_ms": b} for h, b in zip(hosts, block_ms)]
    write_json(
        str(tmp_path / "cluster.json"),
        {
            "census": census,
            "precision": "fp32",
            "precision_why": "cpu",
            "state_bytes_per_param": 24.0,
        },
    )
    write_json(
        str(tmp_path / "config.json"),
        {
            "args": {
                "model": "vit_digits",
                "dataset": "digits",
                "img_size": None,
                "powersgd_rank": 4,
            },
            "deepspeed": {"train_micro_batch_size_per_gpu": 16},
            "global_batch": 64,
            "precision": "fp32",
        },
    )


def test_the_cli_prints_the_ranked_table_and_writes_json(tmp_path, capsys):
    write_run(tmp_path)
    assert (
        cli.main(
            [
                str(tmp_path),
                "--link-mbit",
                "1000",
                "--json",
                str(tmp_path / "plan.json"),
                "--top",
                "5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "vit_digits, global batch 64, fp32; 2 ranks on 2 hosts" in out
    assert "ms/step" in out and "images/s" in out and "bottleneck" in out and "fits" in out
    assert len([line for line in out.splitlines() if line[:3].strip().isdigit()]) == 5
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["links_mbit"] == {"h0": 1000, "h1": 1000} and [
        r["host"] for r in plan["ranks"]
    ] == ["h0", "h1"]
    assert len(plan["ranks"][1]["layer_ms_per_sample"]) == 6  # vit_digits: embed, 4 blocks, head
    rows = plan["candidates"]
    assert {r["engine"] for r in rows} == set(SPECS)
    assert [r["step_ms"] for r in rows] == sorted(r["step_ms"] for r in rows)
    assert all(
        r["step_ms"]
        == pytest.approx(r["compute_ms"] + r["link_ms"] + r["bubble_ms"] + r["fixed_ms"])
        for r in rows
    )
    # rank 1 measured twice as slow
    assert any(r["split"] and r["split"][1] < r["split"][0] for r in rows)


def test_the_cli_takes_a_calibration_file(tmp_path, capsys):
    write_run(tmp_path)
    (tmp_path / "cal.json").write_text(
        '{"step_s": 0.5, "micro_s": 0.0, "zero_comm_factor": [1, 2, 2, 3]}'
    )
    assert (
        cli.main(
            [
                str(tmp_path),
                "--link-mbit",
                "1000",
                "--calibration",
                str(tmp_path / "cal.json"),
                "--json",
                str(tmp_path / "plan.json"),
            ]
        )
        == 0
    )
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["calibration"]["zero_comm_factor"] == [1, 2, 2, 3]
    assert all(
        r["fixed_ms"] == pytest.approx(500.0) and r["bottleneck"] == "fixed"
        for r in plan["candidates"]
    )


def test_the_cli_reads_doctors_link_lines(tmp_path, capsys):
    write_run(tmp_path)
    (tmp_path / "links.txt").write_text("doctor.sh: link from h0 to h1: 941.5 Mbit/s\n")
    assert cli.main([str(tmp_path), "--link-file", str(tmp_path / "links.txt"), "--top", "1"]) == 0
    assert "h1 941.5 Mbit/s" in capsys.readouterr().out


@pytest.mark.parametrize(
    "make, args, message",
    [
        (lambda p: None, [], "no such file"),
        (lambda p: (p / "cluster.json").write_text("{"), [], "not JSON"),
        (lambda p: (p / "cluster.json").write_text('{"census": []}'), [], "no census"),
        (write_run, [], "no link speed for host"),
        (write_run, ["--link-mbit", "1000", "--calibration", "CAL"], "unknown keys ['speed']"),
        (write_run, ["--link-mbit", "1000", "--calibration", "BADTYPE"], "step_s: a number"),
        (
            write_run,
            ["--link-mbit", "1000", "--global-batch", "0"],
            "--global-batch: must be positive, got 0",
        ),
        (write_run, ["--link-mbit", "fast"], "--link-mbit: not a number: 'fast'"),
        (
            write_run,
            ["--link-mbit", "nan"],
            "--link-mbit: must be a finite number above 0, got nan",
        ),
        (write_run, ["--link-mbit", "-5"], "--link-mbit: must be a finite number above 0, got -5"),
        (
            write_run,
            ["--link-mbit", "1000", "--latency-ms", "inf"],
            "--latency-ms: must be a finite number of at least",
        ),
        (write_run, ["--link-mbit", "1000", "--top", "0"], "--top: must be positive, got 0"),
        (write_run, ["--link-file", "missing.txt"], "--link-file missing.txt"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, make, args, message):
    make(tmp_path)
    (tmp_path / "cal.json").write_text('{"speed": 1}')
    (tmp_path / "badtype.json").write_text('{"step_s": "slow"}')
    files = {"CAL": str(tmp_path / "cal.json"), "BADTYPE": str(tmp_path / "badtype.json")}
    args = [files.get(a, a) for a in args]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(cli.main([str(tmp_path), *args]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.ranks
@pytest.mark.timeout(240)
def test_the_planner_reads_a_real_runs_log_dir(tmp_path, capsys):
    r = launch(
        [
            "--model",
            "vit_digits",
            "--dataset",
            "digits",
            "--engine",
            DP_ENGINE,
            "--steps",
            1,
            "--no-save",
            "--monitor-interval",
            0,
            "--log-dir",
            tmp_path,
        ],
        nprocs=1,
        timeout=200,
    )
    assert r.ok, r
    assert cli.main([str(tmp_path), "--top", "3"]) == 0  # one host: no link needed
    out = capsys.readouterr().out
    assert "1 ranks on 1 hosts" in out and " 1  " in out


def test_a_calibration_per_engine_is_taken_and_an_infinite_or_folder_one_refused(tmp_path):
    write_run(tmp_path)
    cal = tmp_path / "cal.json"
    # the bf16 hook's casts cost more
    cal.write_text('{"engine_micro_s": {"ddp": 0.25, "ddp bf16": 0.5}}')
    assert (
        cli.main(
            [
                str(tmp_path),
                "--link-mbit",
                "1000",
                "--calibration",
                str(cal),
                "--json",
                str(tmp_path / "plan.json"),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "plan.json").read_text())["candidates"]
    ddp = [r for r in rows if r["engine"] == "ddp"]
    assert {r["compression"] for r in ddp} == {"none", "fp16", "bf16", "powersgd"}
    for r in ddp:  # ddp bf16 its own, the other compressions the engine's
        assert r["fixed_ms"] == pytest.approx(
            2.0 + (500.0 if r["compression"] == "bf16" else 250.0) * r["grad_accum"]
        )
    for text in ('{"engine_micro_s": {"ddp": Infinity}}', '{"engine_micro_s": {"ddp": "fast"}}'):
        cal.write_text(text)
        with pytest.raises(
            ConfigError, match="engine_micro_s: an object of seconds >= 0 per engine"
        ):
            cli.calibration(str(cal))
    # a typo, a compression ddp lacks
    cal.write_text('{"engine_micro_s": {"dpp": 0.25, "ddp wire-bf16": 0.1}}')
    with pytest.raises(
        ConfigError,
        match=r"engine_micro_s: unknown keys \['ddp wire-bf16', "
        r"'dpp'\]; known: zero0, ",
    ):
        cli.calibration(str(cal))
    with pytest.raises(ConfigError, match="cannot be read as a file"):
        cli.calibration(str(tmp_path))


def test_the_link_probe_never_sends_more_than_its_cap():
    from vit.planner.links import PROBE_MAX_BYTES, grow

    sent = []

    def instant(n):  # a link faster than any probe: the message grows to the cap and stops
        sent.append(n)
        return 0.0

    n, _ = grow(instant, tiny=0.0)
    assert n == max(sent) == PROBE_MAX_BYTES  # 64 KiB x 8 x 8 x 8 = 32 MiB, then 64 MiB, not 256
    assert sent[:4] == [64 * 2**10, 512 * 2**10, 4 * 2**20, 32 * 2**20]
