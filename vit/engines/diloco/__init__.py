"""DiLoCo (Douillard et al. 2023): every worker trains alone with the command line's optimizer for
--sync-every H steps, then the workers average their pseudo-gradients (the global weights minus
their own) and an outer SGD with Nesterov momentum moves the global weights, from which every
worker goes on. The engine (engine.py), its wire (wire.py: fp32, bf16 or int8 with a scale per
block) and what it declares (SPEC): a data-parallel step whose link is one all-reduce of the
weights every H steps, two more fp32 copies of the weights, and a step that learns otherwise than
DDP's (auto leaves it to the user)."""

from dataclasses import dataclass, replace

from vit.core.costs import ring_allreduce_s
from vit.core.errors import ConfigError
from vit.engines.diloco.options import DEFAULT_SYNC_EVERY, LocalStepSettings, fragment_count
from vit.engines.step_cost import DataParallelSpec, autocast_state

BLOCK = 256  # int8 on the wire: values per fp32 scale (wire.py)
WIRE_BYTES = {
    "none": 4.0,
    "outer-bf16": 2.0,
    "outer-int8": 1.0 + 4 / BLOCK,
}  # per value, with scales


def buffer_bytes(wire: str, n: int) -> float:
    """The sync's buffers beyond the flat pseudo-gradient, in bytes a value, on n ranks (wire.py),
    bounded: four compressed copies of the tensor and one fp32 share. torch.profiler's peak read
    between 2.5 and 3.5 compressed copies and a share, varying from run to run (gloo's buffers;
    docs/benchmarks-history.md)."""
    if wire == "fp32" or n == 1:
        return 0.0
    value = 2 if wire == "bf16" else 1 + 4 / BLOCK
    return 4 * value + 4 / n


@dataclass(frozen=True)
class DiLoCoWork:
    """What its price reads of the run's options: --sync-every and the fragments it makes."""

    sync_every: int = DEFAULT_SYNC_EVERY
    fragments: int = 1


class DiLoCoSpec(DataParallelSpec):
    option_groups = {"local": (LocalStepSettings, "local steps (--engine diloco)")}

    def planner_input(self, args):
        # a run recorded before --fragments: one fragment
        every = args.get("sync_every", DEFAULT_SYNC_EVERY)
        return DiLoCoWork(every, fragment_count(every, args.get("fragments", 1)))

    def check_options(self, settings):
        local = settings.local
        if local.sync_every % local.fragment_count:
            raise ConfigError(
                f"--fragments {local.fragments} does not divide --sync-every {local.sync_every} "
                "(each fragment syncs once a window, H / F steps after the one before)"
            )

    def check_layout(self, settings, world_size, grad_accum):
        workers = settings.local.worker_ranks
        if workers.isdigit() and world_size % int(workers):
            raise ConfigError(
                f"--worker-ranks {workers} does not divide the world size {world_size}"
            )

    def census_asks(self, settings):
        """--local-steps: each worker's inner steps in a window of --sync-every's H, from the
        census's speeds."""
        return {"local_steps": settings.local.local_steps, "sync_every": settings.local.sync_every}

    def compressions(self, precision):
        return tuple(WIRE_BYTES)

    def compression_of(self, settings, ds_config):
        wire = settings.local.outer_wire
        return "none" if wire == "fp32" else f"outer-{wire}"

    def compression_options(self, compression):
        wire = compression.removeprefix("outer-") if compression != "none" else "fp32"
        return {"outer_wire": wire}, {}

    def changes_learning(self, c):
        return (
            "DiLoCo changes what is learned (local steps, an outer optimizer): --engine diloco is "
            "yours to choose (or --auto-allow diloco)"
        )

    def state_bytes(self, precision, ds_config, dp_size=1, stashed_copies=0, compression="none"):
        terms = autocast_state(precision)
        terms["global weights"] = 4  # engine.py: the global model, which the outer optimizer moves
        terms["outer momentum"] = 4  # torch.optim.SGD's momentum_buffer
        # engine.py sync: the flat difference, averaged in place; with F > 1 fragments a fragment's
        # difference and the worker's weights when it went (launch), 8 / F bytes, no more than 4
        terms["pseudo-gradient"] = 4
        wire = compression.removeprefix("outer-") if compression != "none" else "fp32"
        if buffers := buffer_bytes(wire, dp_size):  # bf16, int8: the compressed tensor and more
            terms[f"{wire} wire buffers"] = buffers
        return terms

    def link_s(self, c, hosts, net, work, calib, backward_s):
        """One all-reduce of the weights' difference every --sync-every steps, in the wire's
        bytes, amortised over the H steps."""
        nbytes = work.params * WIRE_BYTES[c.compression]
        return ring_allreduce_s(nbytes, hosts, net, calib) / self.work_input(work).sync_every

    def predict(self, c, ranks, net, work, calib):
        """Streaming (--fragments F > 1): each fragment's all-reduce (1 / F of the bytes) runs
        behind the H / F steps that follow it; what of it those steps' compute does not cover."""
        p, local = super().predict(c, ranks, net, work, calib), self.work_input(work)
        if local.fragments == 1:
            return p
        every = local.sync_every / local.fragments  # steps between fragments
        nbytes = work.params * WIRE_BYTES[c.compression] / local.fragments
        send = ring_allreduce_s(nbytes, [r.host for r in ranks], net, calib)
        return replace(p, link_s=max(0.0, send - every * p.compute_s) / every)

    def sync_steps(self, args, total_steps):
        """Every --sync-every steps from --local-start-step (DDP's steps before it are no sync),
        and the last."""
        every, start = args.get("sync_every"), args.get("local_start_step") or 0
        if not isinstance(every, int):
            return []
        return sorted({*range(start + every, total_steps + 1, every), total_steps})


SPEC = DiLoCoSpec(
    "diloco",
    "vit.engines.diloco.engine",
    zero_stages=(0,),
    default_ds_config="zero0.json",
    local_steps=True,
)
