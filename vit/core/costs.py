"""The cost model's vocabulary: the ranks as measured, the links, the job's layers, the fixed costs,
one candidate way to run the job and its predicted step; and the primitives every engine's costs are
made of (a ring all-reduce over the ranks' hosts, a point-to-point message, what a GPU keeps free).
Each engine prices its own step from these (its spec's predict, vit/engines/<engine>/); the planner
searches over them (vit.planner). Pure: no torch, no files (docs/planner.md states every formula).
"""

import math
from dataclasses import dataclass, field

ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
TORCH_GRAD_BYTES = 4  # engines that autocast keep fp32 weights: fp32 gradients and activations
# plans leave 10% of the free memory for the allocator's fragmentation and the unforeseen
USABLE_MEMORY = 0.9
# What a GPU rank holds outside the weights, gradients, optimizer state and activations a plan
# counts: NCCL's buffers (NCCL_BUFFSIZE 4 MiB per channel, send and receive, on the rings and trees
# of each communicator) and the cuBLAS and cuBLASLt workspaces (up to 32 MiB each per stream in
# recent torch). An engine's own buffers (ZeRO's buckets) come from its spec
# (EngineSpec.bucket_bytes).
NCCL_BYTES = 384 * 2**20
CUBLAS_BYTES = 2 * 32 * 2**20
# a frozen layer keeps its weights only (fp32 at most): no gradients, no optimizer state
FROZEN_BYTES_PER_PARAM = 4


@dataclass(frozen=True)
class Rank:
    """One rank as the census measured it: per-layer forward and backward seconds per sample (the
    census's layer_ms at its micro-batch, divided by it), the bytes a plan may fill, whether it is a
    GPU, the machine whose processors it shares with the other ranks there (one kernel: several
    ranks on a host's CPU cores, or on one GPU) and its contention: its layer times with every rank
    computing at once over its times alone (1: nothing shared, or not measured)."""

    host: str
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    # USABLE_MEMORY of the free memory; the candidate's GPU headroom comes off it
    capacity_bytes: float
    gpu: bool = False
    machine: str = ""  # "": its own
    contention: float = 1.0


@dataclass(frozen=True)
class Layer:
    """One entry of the layer list: parameters, activation bytes kept for backward per sample (in
    the run's precision), output elements per sample (what a pipeline boundary after it sends), and
    its weight matrices as (rows, columns), what PowerSGD compresses (every other parameter travels
    whole)."""

    params: int
    act_bytes: float
    out_elems: int
    matrices: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Workload:
    """What is trained: the layers, the global batch, the precision (fp32, fp16 or bf16), and by
    engine name what that engine's price reads of the run's options besides (its spec's
    planner_input: PowerSGD's rank, DiLoCo's steps between syncs; opaque here and to the planner,
    which passes it through)."""

    layers: tuple[Layer, ...]
    global_batch: int
    precision: str
    inputs: dict[str, object] = field(default_factory=dict, hash=False)

    @property
    def params(self) -> int:
        return sum(x.params for x in self.layers)


@dataclass(frozen=True)
class Network:
    """Each host's link in bytes/s (a star: every host's NIC to one switch), optional per-pair
    overrides (the slower of the pair's NICs and the override bounds a pair), one latency for a
    message between hosts, and the bandwidth between two ranks on one host (assumed, not measured).
    """

    host_bytes_s: dict[str, float]
    latency_s: float = 0.0
    pair_bytes_s: dict[tuple[str, str], float] = field(default_factory=dict)
    same_host_bytes_s: float = 5e9

    def bytes_s(self, a: str, b: str) -> float:
        if a == b:
            return self.same_host_bytes_s
        pair = self.pair_bytes_s.get((a, b), self.pair_bytes_s.get((b, a), math.inf))
        return min(self.host_bytes_s.get(a, math.inf), self.host_bytes_s.get(b, math.inf), pair)


@dataclass(frozen=True)
class Calibration:
    """Fixed costs and measured factors. The fixed costs are defaults, to be measured at start-up (a
    few empty steps of each engine); the factors were measured on gloo (docs/benchmarks.md "Which
    engine wins on Ethernet")."""

    step_s: float = 0.002  # per step: optimizer step, data loading, the step's bookkeeping
    micro_s: float = 0.0005  # per micro-batch: the loop, kernel launches, a pipeline's instructions
    # per message (a ring step, a p2p send): the backend's own cost beyond the latency
    message_s: float = 0.0002
    # ZeRO stage's communication time / DDP's
    zero_comm_factor: tuple[float, ...] = (1.0, 1.46, 1.46, 1.75)
    ddp_bucket_bytes: float = 25 * 2**20  # torch DDP's bucket_cap_mb
    ddp_overlap: bool = True  # DDP's buckets all-reduce during backward
    # a pipeline's p2p runs while other stages compute (else each slot pays it)
    pipe_overlap: bool = True
    # measured per engine, with its compression: its micro_s
    engine_micro_s: dict = field(default_factory=dict)

    def micro_of(self, calibration_key: str, engine_key: str) -> float:
        """The engine's measured micro_s with its compression (a cast each way costs CPU time), else
        the engine's, else the default (EngineSpec.calibration_key and key name them)."""
        return self.engine_micro_s.get(
            calibration_key, self.engine_micro_s.get(engine_key, self.micro_s)
        )


@dataclass(frozen=True)
class Candidate:
    """One way to run the job. stages 1: data parallel over every rank; more: a pipeline on stages x
    (ranks // stages) ranks, stage s holding layers parts[s]:parts[s+1]. split: each data-parallel
    rank's micro-batch (--batch-split proportional), else micro_batch each."""

    engine: str
    zero_stage: int
    stages: int
    micro_batch: int
    grad_accum: int
    compression: str = "none"
    split: tuple[int, ...] | None = None
    parts: tuple[int, ...] | None = None


PARTS = ("compute", "link", "bubble", "fixed")


@dataclass(frozen=True)
class Prediction:
    """One candidate's predicted step: time split into compute, link (communication not hidden),
    bubble (a pipeline's fill and drain) and fixed costs, and each rank's memory against what it may
    fill."""

    candidate: Candidate
    compute_s: float
    link_s: float
    bubble_s: float
    fixed_s: float
    mem_bytes: tuple[float, ...]  # per rank
    capacity_bytes: tuple[float, ...]  # per rank: what the candidate may fill
    # a pipeline's busy slots: how many times each stage's compute per micro-batch counts
    slots_paid: float = 0.0

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


def ring_allreduce_s(
    nbytes: float, hosts: list[str], net: Network, calib: Calibration, messages: int = 1
) -> float:
    """Seconds of a ring all-reduce of nbytes over ranks on `hosts` (in rank order), in `messages`
    collectives (buckets x rounds). Each ring edge carries 2(n-1)/n x nbytes; a host's NIC carries
    every edge that leaves it (and every edge that enters it), so the slowest NIC or same-host edge
    sets the bandwidth term; each collective pays 2(n-1) steps of latency + message_s."""
    n = len(hosts)
    if n <= 1 or nbytes <= 0:
        return 0.0
    per_edge = 2 * (n - 1) / n * nbytes
    edges = [(hosts[i], hosts[(i + 1) % n]) for i in range(n)]
    out_count, in_count = {}, {}
    worst = 0.0
    for a, b in edges:
        if a == b:
            worst = max(worst, per_edge / net.same_host_bytes_s)
            continue
        out_count[a] = out_count.get(a, 0) + 1
        in_count[b] = in_count.get(b, 0) + 1
        worst = max(worst, per_edge / net.bytes_s(a, b))
    for counts in (out_count, in_count):
        for host, k in counts.items():
            worst = max(worst, k * per_edge / net.host_bytes_s.get(host, math.inf))
    latency = net.latency_s if out_count else 0.0
    return worst + messages * 2 * (n - 1) * (latency + calib.message_s)


def p2p_s(nbytes: float, a: str, b: str, net: Network, calib: Calibration) -> float:
    """Seconds of one point-to-point message from a rank on host a to one on host b."""
    latency = 0.0 if a == b else net.latency_s
    return nbytes / net.bytes_s(a, b) + latency + calib.message_s


def pipeline_inflight(stages: int, grad_accum: int) -> list[int]:
    """Micro-batches whose activations stage s holds at once under 1F1B."""
    return [max(1, min(stages - s, grad_accum)) for s in range(stages)]
