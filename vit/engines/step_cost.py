"""The shapes of a step that engines share, for their specs: every rank holding the model
(DataParallelSpec: the slowest rank's compute, then the engine's own link_s) or a pipeline of stages
(PipelinedSpec: 1F1B's slots, each stage's compute and transfers, its all-reduce among data-parallel
copies). Pure: no torch (docs/planner.md states every formula)."""

from collections import Counter

from vit.core.costs import (
    ELEMENT_BYTES,
    TORCH_GRAD_BYTES,
    Calibration,
    Candidate,
    Network,
    Prediction,
    Rank,
    Workload,
    p2p_s,
    pipeline_inflight,
    ring_allreduce_s,
)
from vit.core.spec import EngineSpec

# a rank's contention (its layer times with every rank at once over alone) above which it shares
SHARED = 1.2


def autocast_state(precision: str) -> dict[str, float]:
    """fp32 parameters trained under torch.autocast with torch's AdamW (DDP, the async pipeline)."""
    # torch/optim/adamw.py: exp_avg, exp_avg_sq
    terms = {"fp32 weights": 4, "fp32 gradients": 4, "AdamW moments": 8}
    if precision != "fp32":
        # torch/amp/autocast_mode.py (cache_enabled): each fp32 weight's half cast is cached until
        # the autocast region exits, and backward keeps it for the matmuls' weight gradients
        terms["autocast half weights"] = 2
    return terms


class DataParallelSpec(EngineSpec):
    """Every rank holds the model and trains its share of the global batch."""

    pipeline = False
    micro_batch_auto = True

    def link_s(
        self,
        c: Candidate,
        hosts: list[str],
        net: Network,
        work: Workload,
        calib: Calibration,
        backward_s: float,
    ) -> float:
        """Seconds of the step's gradient communication not hidden behind compute (`backward_s`: the
        slowest rank's last backward)."""
        raise NotImplementedError

    def predict(self, c, ranks, net, work, calib):
        """compute: the slowest rank's grad_accum x (its micro-batch x its per-sample forward and
        backward); link: the engine's link_s."""
        n, a = len(ranks), c.grad_accum
        sizes = c.split or (c.micro_batch,) * n
        per_rank = [a * b * (sum(r.fwd_s) + sum(r.bwd_s)) for b, r in zip(sizes, ranks)]
        slow = max(range(n), key=lambda i: per_rank[i])
        link = self.link_s(
            c, [r.host for r in ranks], net, work, calib, sizes[slow] * sum(ranks[slow].bwd_s)
        )
        state = work.params * self.per_param_bytes(c, work, n)
        act = sum(x.act_bytes for x in work.layers)
        micro = calib.micro_of(self.calibration_key(c), self.key(c.zero_stage))
        return Prediction(
            c,
            per_rank[slow],
            link,
            0.0,
            calib.step_s + a * micro,
            tuple(state + act * b for b in sizes),
            tuple(self.capacity(r, c.zero_stage, work.precision) for r in ranks),
        )


class PipelinedSpec(EngineSpec):
    """Stages of contiguous layers, each on ranks // stages data-parallel copies, under 1F1B over m
    = grad_accum micro-batches."""

    pipeline = True
    micro_batch_auto = False

    def flushes(self) -> bool:
        """Whether every step fills and drains the pipeline (DeepSpeed's 1F1B), or micro-batches
        stay in flight across steps (PipeDream-2BW: no flush, no bubble)."""
        return True

    @property
    def async_schedule(self) -> bool:
        return not self.flushes()

    def bubble_slots(self, stages):
        return stages - 1 if self.flushes() else 0

    def slots(self, c: Candidate) -> int:
        """1F1B's slots a step: m + S - 1 with a flush at every step, m without."""
        return c.grad_accum + self.bubble_slots(c.stages)

    def wire_bytes_per_elem(self, precision: str, compression: str) -> int:
        """A stage boundary's element on the wire: the activations' dtype (fp32 where the engine
        autocasts)."""
        if compression == "wire-bf16":
            return 2
        return TORCH_GRAD_BYTES if self.autocast else ELEMENT_BYTES[precision]

    def stashed_copies(self, inflight: int) -> int:
        """Weight copies a stage keeps for `inflight` micro-batches at once (weight stashing)."""
        return 0

    def reduce_factor(self, c: Candidate, calib: Calibration) -> float:
        """The stages' all-reduce among data-parallel copies, as a multiple of a plain one."""
        return 1.0

    def stage_time_s(
        self,
        c: Candidate,
        ranks: list[Rank],
        net: Network,
        work: Workload,
        calib: Calibration,
        s: int,
        i: int,
        j: int,
    ) -> tuple[float, float]:
        """(compute, transfer) seconds per micro-batch of stage s holding layers i..j-1. compute:
        its slowest rank's forward and backward with the engine's cost per micro-batch (its
        instructions: the stage's own CPU time, which the link can hide as it hides compute).
        transfer: how long its link is busy: it sends its activations on (after layer j-1) and its
        input's gradients back (the output of layer i-1), and receives as much (full duplex: the two
        directions overlap), plus latency and message_s per message; the slowest of the
        data-parallel copies."""
        dp, per = len(ranks) // c.stages, self.wire_bytes_per_elem(work.precision, c.compression)
        compute = max(
            c.micro_batch * (sum(r.fwd_s[i:j]) + sum(r.bwd_s[i:j]))
            for r in ranks[s * dp : (s + 1) * dp]
        )
        compute += calib.micro_of(self.calibration_key(c), self.key(c.zero_stage))
        transfer = 0.0
        for d in range(dp):
            here, busy = ranks[s * dp + d].host, 0.0
            for k, layer in ((s - 1, i - 1), (s + 1, j - 1)):
                if 0 <= k < c.stages:
                    peer = ranks[k * dp + d].host
                    busy += p2p_s(
                        c.micro_batch * work.layers[layer].out_elems * per, here, peer, net, calib
                    )
            transfer = max(transfer, busy)
        return compute, transfer

    def busy_slots(self, c: Candidate, ranks: list[Rank]) -> float:
        """How many whole slots a step's compute costs. Layer times are measured with every rank
        computing at once (--engine auto). In slot j of slots(c), stage s computes when s <= j < s +
        m (without a flush: every stage in every slot). Where ranks share a machine's processors
        (Rank.contention k above SHARED), a slot in which only some of the machine's ranks compute
        runs faster: it costs max(1 / k, those computing / the machine's ranks) of a whole slot, the
        largest over the ranks computing. With nothing shared every slot is whole: slots(c)."""
        m, dp, bubble_free = c.grad_accum, len(ranks) // c.stages, not self.flushes()
        machine = [r.machine or f"rank {i}" for i, r in enumerate(ranks)]
        total = Counter(machine)

        def share(i: int, here: Counter) -> float:
            k = ranks[i].contention if ranks[i].contention > SHARED else 1.0
            return max(1 / k, here[machine[i]] / total[machine[i]])

        busy = 0.0
        for j in range(self.slots(c)):
            computing = [
                i
                for s in range(c.stages)
                if bubble_free or s <= j < s + m
                for i in range(s * dp, s * dp + dp)
            ]
            here = Counter(machine[i] for i in computing)
            busy += max(share(i, here) for i in computing)
        return busy

    def stage_step_s(
        self, c: Candidate, calib: Calibration, compute: float, transfer: float, busy: float
    ) -> float:
        """What one stage alone makes the step: overlapped (calib.pipe_overlap), its compute over
        the busy slots (busy_slots) or its link over the m micro-batches, whichever is longer; else
        every slot pays both."""
        if calib.pipe_overlap:
            return max(busy * compute, c.grad_accum * transfer)
        return busy * compute + self.slots(c) * transfer

    def stage_mem_bytes(
        self, c: Candidate, work: Workload, dp: int, s: int, i: int, j: int
    ) -> float:
        """Stage s's state for layers i..j-1 and the activations of the micro-batches it holds at
        once (1F1B), with the weight copies it stashes for them."""
        inflight = pipeline_inflight(c.stages, c.grad_accum)[s]
        layers = work.layers[i:j]
        return (
            sum(x.params for x in layers)
            * self.per_param_bytes(c, work, dp, self.stashed_copies(inflight))
            + sum(x.act_bytes for x in layers) * c.micro_batch * inflight
        )

    def predict(self, c, ranks, net, work, calib):
        """1F1B over m = grad_accum micro-batches and S stages: the slowest stage's stage_step_s,
        split into compute (m x its compute), bubble (the other busy slots' compute) and link (the
        rest). Then each stage all-reduces its gradients among its data-parallel copies (not
        overlapped; reduce_factor)."""
        dp, m, parts = len(ranks) // c.stages, c.grad_accum, c.parts
        times = [
            self.stage_time_s(c, ranks, net, work, calib, s, parts[s], parts[s + 1])
            for s in range(c.stages)
        ]
        busy = self.busy_slots(c, ranks)
        # the stage that sets the step
        worst = max(times, key=lambda t: self.stage_step_s(c, calib, *t, busy))
        step = self.stage_step_s(c, calib, *worst, busy)
        compute = max(t[0] for t in times) if calib.pipe_overlap else worst[0]
        factor = self.reduce_factor(c, calib)

        def reduce_s(s: int, compression: str) -> float:
            return ring_allreduce_s(
                self.grad_bytes(work, work.layers[parts[s] : parts[s + 1]], compression),
                [r.host for r in ranks[s * dp : (s + 1) * dp]],
                net,
                calib,
            )

        reduce = max(
            reduce_s(s, c.compression) + (factor - 1) * reduce_s(s, "none") for s in range(c.stages)
        )
        mems, caps = [], []
        for s in range(c.stages):
            mem = self.stage_mem_bytes(c, work, dp, s, parts[s], parts[s + 1])
            for r in ranks[s * dp : (s + 1) * dp]:
                mems.append(mem)
                caps.append(self.capacity(r, c.zero_stage, work.precision))
        return Prediction(
            c,
            m * compute,
            step - busy * compute + reduce,
            (busy - m) * compute,
            calib.step_s,
            tuple(mems),
            tuple(caps),
            busy,
        )
