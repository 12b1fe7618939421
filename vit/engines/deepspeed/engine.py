"""What the two DeepSpeed engines (ZeRO and pipeline) share: DeepSpeed's comm layer, its
checkpoints, its loss scaler's skipped steps, and the optimizer state a rebuilt engine continues
from (--freeze)."""

import itertools

import torch
import torch.distributed as dist

import vit.engines.deepspeed as deepspeed_specs
from vit.engines.base import Engine, EngineContext, ScalerStats
from vit.training.optim import (
    adam_state,
    make_scheduler,
    move_schedule,
    put_adam_state,
    schedule_position,
)


def deepspeed_comm() -> None:
    """DeepSpeed's comm layer over the torch.distributed group that is already running."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())


class DeepSpeedEngine(Engine):
    """A subclass builds its module and optimizer and hands them to initialize(), which sets
    ds_engine (the DeepSpeedEngine or PipelineEngine that deepspeed.initialize returned)."""

    _in_a_row, _skipped = 0, None

    def initialize(self, ctx: EngineContext, module, optimizer) -> None:
        """deepspeed.initialize over `module` (an nn.Module, or a PipelineModule: this rank's stage)
        with our optimizer, its LR schedule and the JSON; sets ds_engine, optimizer, scheduler and
        device."""
        import deepspeed
        from deepspeed.checkpoint.constants import (
            UNIVERSAL_CHECKPOINT_VERSION_KEY,
            UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        )

        scheduler = make_scheduler(optimizer, ctx.optim, ctx.total_steps)
        # what DeepSpeed's ds_to_universal needs in a checkpoint to convert it to other ranks or
        # stages (saved by save_checkpoint from this module attribute)
        module.universal_checkpoint_info = {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE
        }
        self.ds_engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=ctx.ds_config,
            dist_init_required=False,
        )
        if ctx.compile:
            self.ds_engine.compile()  # PipelineModule.compile: each layer of this stage
        self.device = self.ds_engine.device

    def scaler(self, logging):
        """DeepSpeed counts its skipped steps on the host (its step reads the overflow flag there):
        its counts at every step (the first call takes what a resumed run had skipped before)."""
        if not self.ds_engine.fp16_enabled():
            return None
        skipped = self.ds_engine.skipped_steps
        if self._skipped is not None:
            self._in_a_row = self._in_a_row + 1 if skipped > self._skipped else 0
        self._skipped = skipped
        scale = float(self.ds_engine.optimizer.loss_scale)
        return ScalerStats(skipped, self._in_a_row, self._in_a_row, scale)

    def save(self, save_dir, tag, client_state):
        # No 'latest' from DeepSpeed: vit.checkpoints.checkpoint points at a checkpoint once it is
        # complete.
        self.ds_engine.save_checkpoint(
            save_dir, tag=tag, client_state=client_state, save_latest=False
        )

    def load(self, load_dir, tag):
        path, client_state = self.ds_engine.load_checkpoint(load_dir, tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {load_dir}")
        return client_state

    def handover(self):
        ds, module = self.ds_engine, self.live_module()
        zopt = ds.optimizer
        names = {p: n for n, p in module.named_parameters()}
        # Everything on the host: the old engine's memory is freed before the new one is built.
        if partitions(zopt):  # fp32 weights and Adam state flat and partitioned
            adam = {
                names[p]: whole
                for i in range(len(partitions(zopt)[0]))
                for p, whole in whole_adam_state(zopt, i).items()
            }
            step = next(iter(zopt.optimizer.state.values()))["step"].clone()
        # FP16_UnfusedOptimizer: our AdamW steps an fp32 copy of each parameter
        elif hasattr(zopt, "fp32_groups"):
            adam = {
                names[lp]: {
                    "master": hp.detach().cpu(),
                    **{
                        k: v.cpu() if k in ADAM_KEYS else v
                        for k, v in zopt.optimizer.state[hp].items()
                    },
                }
                for lp, hp in fp32_copies(zopt)
            }
            step = None
        # no ZeRO, fp32: DeepSpeed steps our AdamW itself
        elif isinstance(zopt, torch.optim.Optimizer):
            adam, step = adam_state(zopt, module), None
        else:
            raise RuntimeError(
                f"--freeze cannot move the state of DeepSpeed's {type(zopt).__name__}"
            )
        # The loss scale: ZeRO's loss_scaler, FP16_UnfusedOptimizer's loss_scale_config
        # (BF16_Optimizer has none).
        scaler = {
            a: getattr(zopt, a) for a in ("loss_scaler", "loss_scale_config") if hasattr(zopt, a)
        }
        return {
            "adam": adam,
            "step": step,
            "schedule": schedule_position(self.scheduler),
            "counters": (ds.global_steps, ds.global_samples, ds.skipped_steps),
            "loss_scaler": scaler,
        }

    def take_over(self, state):
        ds, zopt = self.ds_engine, self.ds_engine.optimizer
        names = {p: n for n, p in self.live_module().named_parameters()}
        if partitions(zopt):
            for flat, params, _ in zip(*partitions(zopt)):
                zopt.optimizer.state[flat] = flat_adam_state(
                    flat, [(p, state["adam"][names[p]]) for p in params], state["step"]
                )
        elif hasattr(zopt, "fp32_groups"):
            with torch.no_grad():
                for lp, hp in fp32_copies(zopt):
                    whole = dict(state["adam"][names[lp]])
                    hp.copy_(whole.pop("master"))  # handover() left it on the host
                    zopt.optimizer.state[hp] = {
                        k: v.to(hp.device) if k in ADAM_KEYS else v for k, v in whole.items()
                    }
        else:
            put_adam_state(zopt, self.live_module(), state["adam"])
        for attr, value in state["loss_scaler"].items():
            setattr(zopt, attr, value)
        move_schedule(self.scheduler, state["schedule"])
        ds.global_steps, ds.global_samples, ds.skipped_steps = state["counters"]

    def close(self):
        self.ds_engine.destroy()
        # the module, its gradients, the optimizer state
        self.ds_engine = self.optimizer = self.scheduler = None


ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def partitions(zopt) -> tuple | None:
    """(fp32 partitions, their low-precision parameters, data-parallel groups), one of each per
    parameter group, of a DeepSpeed optimizer that keeps the fp32 weights flat and partitioned over
    the data-parallel ranks, its parameters linked to their partition by _hp_mapping: ZeRO 1 and 2,
    and BF16_Optimizer (bf16 on the pipeline or ZeRO 1 with fp32 gradient accumulation); None for
    any other."""
    if hasattr(zopt, "bit16_groups"):
        return zopt.single_partition_of_fp32_groups, zopt.bit16_groups, zopt.real_dp_process_group
    if hasattr(zopt, "bf16_groups"):
        return zopt.fp32_groups_flat_partition, zopt.bf16_groups, zopt.real_dp_process_group
    return None


def fp32_copies(zopt):
    """(parameter, its fp32 copy that the optimizer steps) of FP16_UnfusedOptimizer (fp16 or bf16
    without ZeRO)."""
    for low, high in zip(zopt.fp16_groups, zopt.fp32_groups):
        yield from zip(low, high)


def _fragments(flat: torch.Tensor, state: dict, params: list):
    """(parameter, this rank's part of each of its values in the partition, where that part lies in
    the whole parameter) for the parameters of one ZeRO group that reach into this rank's partition
    (DeepSpeed's _hp_mapping)."""
    for p in params:
        m = p._hp_mapping  # noqa: SLF001
        if m is not None:
            hp, lp = m.get_hp_fragment_address(), m.lp_fragment_address
            parts = {
                key: t.narrow(0, hp.start, hp.numel)
                for key, t in (("master", flat), *((k, state[k]) for k in ADAM_KEYS))
            }
            yield p, parts, (lp.start, lp.numel)


@torch.no_grad()
def whole_adam_state(zopt, group: int) -> dict:
    """Collective over the data-parallel ranks: each parameter of ZeRO group `group` with its whole
    fp32 weights and Adam moments (flat), assembled from every rank's partition, on the host. The
    group goes through one device buffer of HANDOVER_CHUNK elements a row
    (DeepSpeedSpec.handover_bytes), summed in one all-reduce a chunk (an all-reduce a tensor took up
    to 0.3 s a rebuild for vit_digits on 2 CPU ranks)."""
    flats, groups, dp_groups = partitions(zopt)
    flat, params = flats[group], groups[group]
    keys = ("master", *ADAM_KEYS)
    offsets = dict(zip(params, itertools.accumulate((p.numel() for p in params), initial=0)))
    total = sum(p.numel() for p in params)
    host = torch.empty(len(keys), total, dtype=flat.dtype)
    mine = [
        (offsets[p] + start, numel, parts)
        for p, parts, (start, numel) in _fragments(flat, zopt.optimizer.state[flat], params)
    ]
    size = min(deepspeed_specs.HANDOVER_CHUNK, total)
    buffer = torch.empty(len(keys) * size, dtype=flat.dtype, device=flat.device)
    for lo in range(0, total, size):
        hi = min(lo + size, total)
        chunk = buffer[: len(keys) * (hi - lo)].view(len(keys), hi - lo).zero_()  # contiguous
        for at, numel, parts in mine:  # this rank's fragments that fall into [lo, hi)
            a, b = max(lo, at), min(hi, at + numel)
            if a < b:
                for row, key in zip(chunk, keys):
                    row.narrow(0, a - lo, b - a).copy_(parts[key].narrow(0, a - at, b - a))
        dist.all_reduce(chunk, group=dp_groups[group])
        host[:, lo:hi].copy_(chunk)
    return {
        p: {k: row.narrow(0, offsets[p], p.numel()) for k, row in zip(keys, host)} for p in params
    }


@torch.no_grad()
def flat_adam_state(flat: torch.Tensor, params: list, step: torch.Tensor) -> dict:
    """The torch AdamW state of one ZeRO partition `flat` (and its fp32 weights), from whole
    per-parameter values: each parameter's slice that falls into this rank's partition (DeepSpeed's
    _hp_mapping says where)."""
    state = {"step": step.clone(), **{k: torch.zeros_like(flat) for k in ADAM_KEYS}}
    wholes = dict(params)
    for p, parts, (start, numel) in _fragments(flat, state, list(wholes)):
        for key, part in parts.items():
            part.copy_(wholes[p][key].flatten().narrow(0, start, numel))
    return state
