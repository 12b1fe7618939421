"""The cost model's inputs (the ranks, the links, the job's layers, the calibration, a candidate) and its
communication primitives: a ring all-reduce over the ranks' hosts, a point-to-point transfer, and the bytes each
engine and compression option puts on the wire. Pure: no torch, no files but the DeepSpeed JSONs
(docs/planner.md states every formula)."""
import copy
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from vit.engines.registry import SPECS, EngineSpec, spec

DS_CONFIGS = Path(__file__).resolve().parents[2] / "deepspeed_configs"
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
TORCH_GRAD_BYTES = 4  # DDP and the async pipeline keep fp32 weights under autocast: fp32 gradients and activations


@dataclass(frozen=True)
class Rank:
    """One rank as the census measured it: per-layer forward and backward seconds per sample (the census's
    layer_ms at its micro-batch, divided by it), the bytes a plan may fill, whether it is a GPU, the machine whose
    processors it shares with the other ranks there (one kernel: several ranks on a host's CPU cores, or on one GPU)
    and its contention: its layer times with every rank computing at once over its times alone (1: nothing shared,
    or not measured)."""
    host: str
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    capacity_bytes: float  # footprint.USABLE_MEMORY of the free memory; the candidate's GPU headroom comes off it
    gpu: bool = False
    machine: str = ""  # "": its own
    contention: float = 1.0


@dataclass(frozen=True)
class Layer:
    """One entry of the layer list: parameters, activation bytes kept for backward per sample (in the run's
    precision), output elements per sample (what a pipeline boundary after it sends), and its weight matrices as
    (rows, columns), what PowerSGD compresses (every other parameter travels whole)."""
    params: int
    act_bytes: float
    out_elems: int
    matrices: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Job:
    layers: tuple[Layer, ...]
    global_batch: int
    precision: str  # fp32, fp16 or bf16: what the run trains in
    powersgd_rank: int = 4


@dataclass(frozen=True)
class Network:
    """Each host's link in bytes/s (a star: every host's NIC to one switch), optional per-pair overrides (the
    slower of the pair's NICs and the override bounds a pair), one latency for a message between hosts, and the
    bandwidth between two ranks on one host (assumed, not measured)."""
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
    """Fixed costs and measured factors. The fixed costs are defaults, to be measured at start-up (a few empty
    steps of each engine); the factors were measured on gloo (docs/benchmarks.md "Which engine wins on
    Ethernet")."""
    step_s: float = 0.002  # per step: optimizer step, data loading, the step's bookkeeping
    micro_s: float = 0.0005  # per micro-batch: the loop, kernel launches, a pipeline's instructions
    message_s: float = 0.0002  # per message (a ring step, a p2p send): the backend's own cost beyond the latency
    zero_comm_factor: tuple[float, ...] = (1.0, 1.46, 1.46, 1.75)  # ZeRO stage's communication time / DDP's
    ddp_bucket_bytes: float = 25 * 2**20  # torch DDP's bucket_cap_mb
    ddp_overlap: bool = True  # DDP's buckets all-reduce during backward
    pipe_overlap: bool = True  # a pipeline's p2p runs while other stages compute (else each slot pays it)
    engine_micro_s: dict = field(default_factory=dict)  # measured per engine, with its compression: its micro_s

    def micro_of(self, c: "Candidate") -> float:
        """The engine's measured micro_s with c's compression (Candidate.calibration_key: a cast each way costs CPU
        time), else the engine's (Candidate.engine_key), else the default."""
        return self.engine_micro_s.get(c.calibration_key(), self.engine_micro_s.get(c.engine_key(), self.micro_s))


@dataclass(frozen=True)
class Candidate:
    """One way to run the job. stages 1: data parallel over every rank; more: a pipeline on stages x (ranks //
    stages) ranks, stage s holding layers parts[s]:parts[s+1]. split: each data-parallel rank's micro-batch
    (--batch-split proportional), else micro_batch each."""
    engine: str
    zero_stage: int
    stages: int
    micro_batch: int
    grad_accum: int
    compression: str = "none"
    split: tuple[int, ...] | None = None
    parts: tuple[int, ...] | None = None

    def engine_key(self) -> str:
        """The engine as a calibration names it: with its ZeRO stage where its DeepSpeed JSON sets it ('zero2')."""
        engine = spec(self.engine)
        return f"{self.engine}{self.zero_stage}" if engine.zero_stage is None and not engine.pipeline else self.engine

    def calibration_key(self) -> str:
        """The engine key with the compression, where there is one ('ddp bf16', 'zero1 comm-bf16')."""
        return self.engine_key() + ("" if self.compression == "none" else f" {self.compression}")

    def label(self) -> str:
        engine = spec(self.engine)
        if engine.zero_stage is not None:  # runs at one stage only
            what = self.engine
        else:  # "zero2"; "pipeline zero1"
            what = f"{self.engine}{' zero' if engine.pipeline else ''}{self.zero_stage}"
        if self.stages > 1:
            what += f" {self.stages} stages {list(self.parts) if self.parts else ''}".rstrip()
        what += f" mb {'/'.join(map(str, self.split)) if self.split else self.micro_batch} x{self.grad_accum}"
        return what + ("" if self.compression == "none" else f" {self.compression}")


def compressions(engine: EngineSpec, precision: str) -> tuple[str, ...]:
    """What each engine can compress with: torch's DDP hooks (--comm-hook), DeepSpeed's communication_data_type
    bf16 (its gradient reduction), the async pipeline's bf16 wire (its p2p activations and gradients); an option
    that changes nothing at this precision is left out."""
    if engine.comm_hooks:
        return "none", "fp16", "bf16", "powersgd"
    if engine.deepspeed:
        return ("none", "comm-bf16") if ELEMENT_BYTES[precision] > 2 else ("none",)
    if engine.pipeline:
        return "none", "wire-bf16"
    return ("none",)


def calibration_keys() -> list[str]:
    """Every key Calibration.engine_micro_s may hold: each engine's (at each ZeRO stage its JSON can set), alone or
    with a compression it has."""
    keys = []
    for name, engine in SPECS.items():
        zeros = engine.zero_stages if engine.zero_stage is None and not engine.pipeline else (0,)
        keys += [Candidate(name, z, 1, 1, 1, comp).calibration_key() for z in zeros
                 for comp in compressions(engine, "fp32")]
    return keys


def grad_bytes(engine: EngineSpec, job: Job, layers: tuple[Layer, ...], compression: str) -> float:
    """Bytes of `layers`' gradients one all-reduce sends (before the ring's 2(n-1)/n): fp16/bf16 hooks and
    communication_data_type bf16 halve fp32; PowerSGD sends (rows + columns) x rank per matrix where torch's hook
    compresses it (rows x columns > 2 x that, its min_compression_rate), every other parameter whole."""
    if compression == "powersgd":
        r, elems = job.powersgd_rank, 0
        for layer in layers:
            whole = layer.params - sum(n * m for n, m in layer.matrices)
            elems += whole + sum((n + m) * r if n * m > 2 * (n + m) * r else n * m for n, m in layer.matrices)
        return elems * TORCH_GRAD_BYTES
    per = TORCH_GRAD_BYTES if not engine.deepspeed else ELEMENT_BYTES[job.precision]
    if compression in ("fp16", "bf16", "comm-bf16"):
        per = min(per, 2)
    return sum(layer.params for layer in layers) * per


def allreduce_rounds(compression: str) -> int:
    """Collectives one bucket costs: PowerSGD all-reduces P, then Q, then the uncompressed tensors."""
    return 3 if compression == "powersgd" else 1


def wire_bytes_per_elem(engine: EngineSpec, precision: str, compression: str) -> int:
    """A pipeline boundary's element: DeepSpeed sends the model's dtype, the async pipeline autocast's fp32
    residual stream unless its wire is bf16."""
    if compression == "wire-bf16":
        return 2
    return ELEMENT_BYTES[precision] if engine.deepspeed else TORCH_GRAD_BYTES


def ring_allreduce_s(nbytes: float, hosts: list[str], net: Network, calib: Calibration, messages: int = 1) -> float:
    """Seconds of a ring all-reduce of nbytes over ranks on `hosts` (in rank order), in `messages` collectives
    (buckets x rounds). Each ring edge carries 2(n-1)/n x nbytes; a host's NIC carries every edge that leaves it
    (and every edge that enters it), so the slowest NIC or same-host edge sets the bandwidth term; each collective
    pays 2(n-1) steps of latency + message_s."""
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


@functools.lru_cache(maxsize=None)
def _json(name: str) -> str:
    return (DS_CONFIGS / name).read_text()


def ds_config(engine: EngineSpec, zero_stage: int) -> dict:
    """The engine's default DeepSpeed JSON at `zero_stage` (what footprint's memory rules read: buckets,
    gradient accumulation dtype); {} for an engine without DeepSpeed."""
    if not engine.deepspeed:
        return {}
    config = copy.deepcopy(json.loads(_json(engine.default_ds_config)))
    config.setdefault("zero_optimization", {})["stage"] = zero_stage
    return config
