"""One candidate's predicted step: time split into compute, link (communication not hidden), bubble (a pipeline's
fill and drain) and fixed costs, its bottleneck, and each rank's memory (vit.planner.memory's rules). Pure."""
import math
from collections import Counter
from dataclasses import dataclass

from vit.engines.registry import spec
from vit.planner.memory import ZERO_BUCKET_DEFAULT, gpu_reserved_bytes, state_bytes
from vit.planner.stages import pipeline_inflight
from vit.planner.cost import (
    Calibration,
    Candidate,
    Job,
    Network,
    Rank,
    allreduce_rounds,
    ds_config,
    grad_bytes,
    p2p_s,
    ring_allreduce_s,
    wire_bytes_per_elem,
)

PARTS = ("compute", "link", "bubble", "fixed")
SHARED = 1.2  # a rank's contention (its layer times with every rank at once over alone) above which it shares


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    compute_s: float
    link_s: float
    bubble_s: float
    fixed_s: float
    mem_bytes: tuple[float, ...]  # per rank
    capacity_bytes: tuple[float, ...]  # per rank: what the candidate may fill
    slots_paid: float = 0.0  # a pipeline's busy_slots: how many times each stage's compute per micro-batch counts

    @property
    def step_s(self) -> float:
        return self.compute_s + self.link_s + self.bubble_s + self.fixed_s

    @property
    def bottleneck(self) -> str:
        return max(PARTS, key=lambda p: getattr(self, f"{p}_s"))

    @property
    def fits(self) -> bool:
        return all(m <= c for m, c in zip(self.mem_bytes, self.capacity_bytes))

    def images_per_s(self, global_batch: int) -> float:
        return global_batch / self.step_s


def capacity(rank: Rank, engine_name: str, zero_stage: int, precision: str) -> float:
    """What a candidate may fill on `rank`: its usable memory less a GPU's headroom for NCCL, cuBLAS and ZeRO's
    buckets (footprint.gpu_reserved_bytes)."""
    reserved = gpu_reserved_bytes(ds_config(spec(engine_name), zero_stage), precision) if rank.gpu else 0.0
    return rank.capacity_bytes - reserved


def per_param_bytes(c: Candidate, job: Job, dp_size: int, stashed_copies: int = 0) -> float:
    engine = spec(c.engine)
    return sum(state_bytes(c.engine, job.precision, ds_config(engine, c.zero_stage), dp_size,
                           stashed_copies=stashed_copies).values())


def data_parallel(c: Candidate, ranks: list[Rank], net: Network, job: Job, calib: Calibration) -> Prediction:
    """Every rank holds the model. compute: the slowest rank's grad_accum x (its micro-batch x its per-sample
    forward and backward). DDP: its bucketed all-reduce overlaps the last micro-batch's backward on the slowest
    rank, except the last bucket: link = max(C_bucket, C - backward); ZeRO: not overlapped, C x the stage's
    measured factor, at every micro-batch from stage 2 on. C: a ring all-reduce of the gradients' wire bytes."""
    engine, n, a = spec(c.engine), len(ranks), c.grad_accum
    sizes = c.split or (c.micro_batch,) * n
    per_rank = [a * b * (sum(r.fwd_s) + sum(r.bwd_s)) for b, r in zip(sizes, ranks)]
    slow = max(range(n), key=lambda i: per_rank[i])
    hosts = [r.host for r in ranks]
    wire = grad_bytes(engine, job, job.layers, c.compression)
    rounds = allreduce_rounds(c.compression)
    if not engine.deepspeed:  # torch's DDP
        dense = grad_bytes(engine, job, job.layers, "none")  # DDP buckets the uncompressed gradients
        buckets = max(1, math.ceil(dense / calib.ddp_bucket_bytes))
        comm = ring_allreduce_s(wire, hosts, net, calib, buckets * rounds)
        tail = ring_allreduce_s(wire / buckets, hosts, net, calib, rounds)
        backward = sizes[slow] * sum(ranks[slow].bwd_s)
        link = max(tail, comm - backward) if calib.ddp_overlap else comm
    else:
        bucket = ds_config(engine, c.zero_stage)["zero_optimization"].get("reduce_bucket_size", ZERO_BUCKET_DEFAULT)
        buckets = max(1, math.ceil(sum(x.params for x in job.layers) / bucket))
        # deepspeed/runtime/engine.py allreduce_gradients: "ZeRO stage >= 2 communicates during non gradient
        # accumulation boundaries as well": every micro-batch reduces its gradients
        reductions = a if c.zero_stage >= 2 else 1
        # the gradients' reduction in the communication dtype, the rest of ZeRO's traffic (gathering the updated
        # parameters) in the model's: communication_data_type does not shrink it
        gather = (calib.zero_comm_factor[c.zero_stage] - 1) * ring_allreduce_s(
            grad_bytes(engine, job, job.layers, "none"), hosts, net, calib, buckets)
        link = reductions * ring_allreduce_s(wire, hosts, net, calib, buckets) + gather
    state = sum(x.params for x in job.layers) * per_param_bytes(c, job, n)
    act = sum(x.act_bytes for x in job.layers)
    return Prediction(c, per_rank[slow], link, 0.0, calib.step_s + a * calib.micro_of(c),
                      tuple(state + act * b for b in sizes),
                      tuple(capacity(r, c.engine, c.zero_stage, job.precision) for r in ranks))


def stage_transfer_s(c: Candidate, ranks: list[Rank], net: Network, job: Job, calib: Calibration, s: int, i: int,
                     j: int) -> float:
    """Seconds per micro-batch stage s's link is busy: it sends its activations on (after layer j-1) and its input's
    gradients back (the output of layer i-1), and receives as much (full duplex: the two directions overlap),
    plus latency and message_s per message; the slowest of the data-parallel copies."""
    dp, per = len(ranks) // c.stages, wire_bytes_per_elem(spec(c.engine), job.precision, c.compression)
    worst = 0.0
    for d in range(dp):
        here, busy = ranks[s * dp + d].host, 0.0
        for k, layer, there in ((s - 1, i - 1, -1), (s + 1, j - 1, 1)):
            if 0 <= k < c.stages:
                peer = ranks[k * dp + d].host
                busy += p2p_s(c.micro_batch * job.layers[layer].out_elems * per, here, peer, net, calib)
        worst = max(worst, busy)
    return worst


def stage_time_s(c: Candidate, ranks: list[Rank], net: Network, job: Job, calib: Calibration, s: int, i: int,
                 j: int) -> tuple[float, float]:
    """(compute, transfer) seconds per micro-batch of stage s holding layers i..j-1: its slowest rank's forward
    and backward with the engine's cost per micro-batch (its instructions: the stage's own CPU time, which the link
    can hide as it hides compute), and its link's (stage_transfer_s)."""
    dp = len(ranks) // c.stages
    compute = max(c.micro_batch * (sum(r.fwd_s[i:j]) + sum(r.bwd_s[i:j])) for r in ranks[s * dp:(s + 1) * dp])
    compute += calib.micro_of(c)
    return compute, stage_transfer_s(c, ranks, net, job, calib, s, i, j)


def slots(c: Candidate) -> int:
    """1F1B's slots a step: m + S - 1 with DeepSpeed's flush at every step; m for the async pipeline, which keeps
    micro-batches in flight across steps (PipeDream-2BW: no flush, no bubble)."""
    return c.grad_accum + (c.stages - 1 if not spec(c.engine).async_options else 0)


def busy_slots(c: Candidate, ranks: list[Rank]) -> float:
    """How many whole slots a step's compute costs. Layer times are measured with every rank computing at once
    (--engine auto). In slot j of slots(c), stage s computes when s <= j < s + m (the async pipeline: every stage in
    every slot). Where ranks share a machine's processors (Rank.contention k above SHARED), a slot in which only
    some of the machine's ranks compute runs faster: it costs max(1 / k, those computing / the machine's ranks) of a
    whole slot, the largest over the ranks computing. With nothing shared every slot is whole: slots(c)."""
    m, dp, bubble_free = c.grad_accum, len(ranks) // c.stages, bool(spec(c.engine).async_options)
    machine = [r.machine or f"rank {i}" for i, r in enumerate(ranks)]
    total = Counter(machine)

    def share(i: int, here: Counter) -> float:
        k = ranks[i].contention if ranks[i].contention > SHARED else 1.0
        return max(1 / k, here[machine[i]] / total[machine[i]])

    busy = 0.0
    for j in range(slots(c)):
        computing = [i for s in range(c.stages) if bubble_free or s <= j < s + m for i in range(s * dp, s * dp + dp)]
        here = Counter(machine[i] for i in computing)
        busy += max(share(i, here) for i in computing)
    return busy


def stage_step_s(c: Candidate, calib: Calibration, compute: float, transfer: float, busy: float) -> float:
    """What one stage alone makes the step: overlapped (calib.pipe_overlap), its compute over the busy slots
    (busy_slots) or its link over the m micro-batches, whichever is longer; else every slot pays both."""
    if calib.pipe_overlap:
        return max(busy * compute, c.grad_accum * transfer)
    return busy * compute + slots(c) * transfer


def stage_mem_bytes(c: Candidate, job: Job, dp: int, s: int, i: int, j: int) -> float:
    """Stage s's state for layers i..j-1 and the activations of the micro-batches it holds at once (1F1B); the
    async pipeline also keeps a weight copy per further micro-batch in flight (weight stashing)."""
    inflight = pipeline_inflight(c.stages, c.grad_accum)[s]
    stashed = inflight - 1 if spec(c.engine).async_options else 0
    layers = job.layers[i:j]
    return (sum(x.params for x in layers) * per_param_bytes(c, job, dp, stashed)
            + sum(x.act_bytes for x in layers) * c.micro_batch * inflight)


def pipeline(c: Candidate, ranks: list[Rank], net: Network, job: Job, calib: Calibration) -> Prediction:
    """1F1B over m = grad_accum micro-batches and S stages: the slowest stage's stage_step_s, split into compute
    (m x its compute), bubble (the other busy slots' compute) and link (the rest). Then each stage all-reduces its
    gradients among its data-parallel copies (not overlapped; ZeRO's factor on DeepSpeed's)."""
    engine, dp, m, parts = spec(c.engine), len(ranks) // c.stages, c.grad_accum, c.parts
    times = [stage_time_s(c, ranks, net, job, calib, s, parts[s], parts[s + 1]) for s in range(c.stages)]
    busy = busy_slots(c, ranks)
    worst = max(times, key=lambda t: stage_step_s(c, calib, *t, busy))  # the stage that sets the step
    step = stage_step_s(c, calib, *worst, busy)
    compute = max(t[0] for t in times) if calib.pipe_overlap else worst[0]
    factor = calib.zero_comm_factor[c.zero_stage] if engine.deepspeed else 1.0

    def reduce_s(s: int, compression: str) -> float:
        return ring_allreduce_s(grad_bytes(engine, job, job.layers[parts[s]:parts[s + 1]], compression),
                                [r.host for r in ranks[s * dp:(s + 1) * dp]], net, calib)
    reduce = max(reduce_s(s, c.compression) + (factor - 1) * reduce_s(s, "none") for s in range(c.stages))
    mems, caps = [], []
    for s in range(c.stages):
        mem = stage_mem_bytes(c, job, dp, s, parts[s], parts[s + 1])
        for r in ranks[s * dp:(s + 1) * dp]:
            mems.append(mem)
            caps.append(capacity(r, c.engine, c.zero_stage, job.precision))
    return Prediction(c, m * compute, step - busy * compute + reduce, (busy - m) * compute,
                      calib.step_s, tuple(mems), tuple(caps), busy)


def predict(c: Candidate, ranks: list[Rank], net: Network, job: Job, calib: Calibration) -> Prediction:
    return (pipeline if c.stages > 1 else data_parallel)(c, ranks, net, job, calib)
