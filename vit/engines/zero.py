"""DeepSpeed ZeRO (stage 0-3, optional CPU offload), all from the JSON config."""
import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from vit.engines.base import EngineContext
from vit.engines.deepspeed_engine import DeepSpeedEngine, deepspeed_comm
from vit.model import Loss
from vit.optim import adam_state, make_optimizer, make_scheduler, move_schedule, put_adam_state, schedule_position
from vit.stats import PhaseTimer


class ZeroEngine(DeepSpeedEngine):
    def __init__(self, ctx: EngineContext):
        deepspeed_comm()
        model = nn.Sequential(*ctx.layers)
        offload = ctx.ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
        opt = make_optimizer(model, ctx.optim, cpu_offload=offload == "cpu", num_layers=len(ctx.layers),
                             device=ctx.device)
        sched = make_scheduler(opt, ctx.optim, ctx.total_steps)
        self.ds_engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=sched, config=ctx.ds_config, dist_init_required=False)
        self.device = self.ds_engine.device
        self.grad_accum, self.loss_weight = ctx.batch.grad_accum, ctx.loss_weight
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        self.timer = PhaseTimer(self.device)
        self.loss = Loss(ctx.smoothing)

    def train_step(self, batches):
        total, t = 0.0, self.timer
        t.start()
        for _ in range(self.grad_accum):
            x, y = next(batches)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            t.lap("data_s")
            # Weighted by this rank's share, so the average over ranks is the global batch's mean loss.
            loss = self.loss(self.ds_engine(x), y) * self.loss_weight
            t.lap("forward_s")
            self.ds_engine.backward(loss)
            t.lap("backward_s")
            self.ds_engine.step()  # steps the optimizer only at the accumulation boundary
            t.lap("optimizer_s")
            total = total + loss.detach()
        return total / self.grad_accum

    def eval_logits(self, x, y):
        return self.ds_engine(x.to(self.device, non_blocking=True))

    def train_mode(self, training):
        self.ds_engine.train(training)

    def live_module(self):
        return self.ds_engine.module

    def gathered(self, modifier_rank=None):
        if not self.ds_engine.zero_optimization_partition_weights():
            return super().gathered(modifier_rank)
        return deepspeed.zero.GatheredParameters(list(self.live_module().parameters()), modifier_rank=modifier_rank)

    def handover(self):
        ds, module = self.ds_engine, self.live_module()
        zopt = ds.optimizer
        if hasattr(zopt, "bit16_groups"):  # ZeRO 1 and 2: fp32 weights and Adam state flat and partitioned
            names = {p: n for n, p in module.named_parameters()}
            adam = {names[p]: whole for i in range(len(zopt.bit16_groups))
                    for p, whole in whole_adam_state(zopt, i).items()}
            step = next(iter(zopt.optimizer.state.values()))["step"]
        elif isinstance(zopt, torch.optim.Optimizer):  # no ZeRO, fp32: DeepSpeed steps our AdamW itself
            adam, step = adam_state(zopt, module), None
        else:
            raise RuntimeError(f"--freeze cannot move the state of DeepSpeed's {type(zopt).__name__}; use ZeRO "
                               "stage 1 or 2")
        return {"adam": adam, "step": step, "schedule": schedule_position(self.scheduler),
                "counters": (ds.global_steps, ds.global_samples, ds.skipped_steps),
                "loss_scaler": getattr(zopt, "loss_scaler", None)}

    def take_over(self, state):
        ds, zopt = self.ds_engine, self.ds_engine.optimizer
        if state["step"] is None:
            put_adam_state(zopt, self.live_module(), state["adam"])
        else:
            names = {p: n for n, p in self.live_module().named_parameters()}
            for flat, params in zip(zopt.single_partition_of_fp32_groups, zopt.bit16_groups):
                zopt.optimizer.state[flat] = flat_adam_state(flat, [(p, state["adam"][names[p]]) for p in params],
                                                             state["step"])
        if state["loss_scaler"] is not None:
            zopt.loss_scaler = state["loss_scaler"]
        move_schedule(self.scheduler, state["schedule"])
        ds.global_steps, ds.global_samples, ds.skipped_steps = state["counters"]

    def close(self):
        self.ds_engine.destroy()

    def layer_state(self):
        if self.ds_engine.zero_optimization_partition_weights():  # ZeRO-3: gathered onto rank 0 layer by layer
            return self.ds_engine._zero3_consolidated_16bit_state_dict()
        return super().layer_state()


ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _fragments(flat: torch.Tensor, state: dict, params: list):
    """(parameter, this rank's part of each of its values in the partition, where that part lies in the whole
    parameter) for the parameters of one ZeRO group that reach into this rank's partition (DeepSpeed's
    _hp_mapping)."""
    for p in params:
        m = p._hp_mapping  # noqa: SLF001
        if m is not None:
            hp, lp = m.get_hp_fragment_address(), m.lp_fragment_address
            parts = {key: t.narrow(0, hp.start, hp.numel) for key, t in (("master", flat), *(
                (k, state[k]) for k in ADAM_KEYS))}
            yield p, parts, (lp.start, lp.numel)


@torch.no_grad()
def whole_adam_state(zopt, group: int) -> dict:
    """Collective over the data-parallel ranks: each parameter of ZeRO group `group` with its whole fp32 weights
    and Adam moments (flat), assembled from every rank's partition."""
    flat = zopt.single_partition_of_fp32_groups[group]
    params = zopt.bit16_groups[group]
    out = {p: {k: torch.zeros(p.numel(), dtype=flat.dtype, device=flat.device) for k in ("master", *ADAM_KEYS)}
           for p in params}
    for p, parts, (start, numel) in _fragments(flat, zopt.optimizer.state[flat], params):
        for key, part in parts.items():
            out[p][key].narrow(0, start, numel).copy_(part)
    for whole in out.values():
        for t in whole.values():
            dist.all_reduce(t, group=zopt.real_dp_process_group[group])
    return out


@torch.no_grad()
def flat_adam_state(flat: torch.Tensor, params: list, step: torch.Tensor) -> dict:
    """The torch AdamW state of one ZeRO partition `flat` (and its fp32 weights), from whole per-parameter values:
    each parameter's slice that falls into this rank's partition (DeepSpeed's _hp_mapping says where)."""
    state = {"step": step.clone(), **{k: torch.zeros_like(flat) for k in ADAM_KEYS}}
    wholes = dict(params)
    for p, parts, (start, numel) in _fragments(flat, state, list(wholes)):
        for key, part in parts.items():
            part.copy_(wholes[p][key].flatten().narrow(0, start, numel))
    return state


def build(ctx: EngineContext):
    return ZeroEngine(ctx)
