"""What the freeze rules measure of each freezable layer (vit.freeze.freezer): grad's gradient norms
and their change between decision points (PipeTransformer's and AutoFreeze's measure), settled's
weight moves."""

import torch
import torch.distributed as dist
from torch import nn


def layer_of(name: str) -> int:
    """The layer list index of a parameter of the sequential model ('3.attn.qkv.weight' -> 3)."""
    return int(name.split(".")[0])


def changes(previous: list[float], now: list[float]) -> list[float]:
    """Each layer's relative change of its accumulated gradient norm between two decision points
    (PipeTransformer's and AutoFreeze's measure of how much a layer still learns): |now - previous|
    / previous."""
    return [abs(n - p) / max(p, 1e-12) for p, n in zip(previous, now)]


class GradNorms:
    """Each freezable layer's gradient norm, summed over the steps of an interval and over the
    ranks. Tensor hooks see each micro-batch's local gradient before any engine reduces or
    partitions it; the sums stay on the device until a decision reads them."""

    def __init__(self, num_freezable: int, device: torch.device):
        self.sums = torch.zeros(num_freezable, dtype=torch.float64, device=device)

    def attach(self, module: nn.Module) -> None:
        for name, p in module.named_parameters():
            layer = layer_of(name)
            if p.requires_grad and layer < len(self.sums):
                p.register_hook(lambda g, i=layer: self._add(i, g))

    def _add(self, layer: int, grad: torch.Tensor) -> None:
        self.sums[layer] += grad.detach().double().pow(2).sum()

    def take(self) -> list[float]:
        """Collective: the interval's norms, the same on every rank; starts the next interval."""
        total = self.sums.clone()
        dist.all_reduce(total)
        self.sums.zero_()
        return total.sqrt().tolist()

    def state_dict(self) -> list[float]:
        """Collective: the current interval's sums over all ranks (a checkpoint holds one copy)."""
        total = self.sums.clone()
        dist.all_reduce(total)
        return total.tolist()

    def load_state_dict(self, sums: list[float]) -> None:
        self.sums.copy_(torch.tensor(sums, dtype=torch.float64)).div_(dist.get_world_size())


class WeightMoves:
    """settled's measure: how far each freezable layer's weights moved over the last interval per
    unit of learning rate, ||W_now - W_then|| / ||W_then|| / (the sum of the interval's per-step
    learning rates), as a share of the largest such move that layer has made in any interval so far
    (1: as fast as ever; near 0: settled). Dividing by the learning rate leaves what the optimizer's
    steps do: Adam's shrink when a layer's gradients turn into noise around zero, while the LR
    schedule's decay alone does not count. W_then is a host copy taken at the previous decision
    point, of the trained layers this rank holds: host memory for one more copy of them. A move is
    measured only over a whole interval: after a resume the first decision point has none."""

    def __init__(self, num_freezable: int, interval_steps: int):
        self.num_freezable, self.interval_steps = num_freezable, interval_steps
        self.then: dict[str, torch.Tensor] = {}
        self.since = None  # the step of the copy
        # the learning rates of the steps since (a device tensor under fused Adam)
        self.lr_sum = 0.0
        self.peak = [0.0] * num_freezable

    def stepped(self, lr) -> None:
        """After each step: the learning rate it (or the next one, alike for every interval) trains
        at."""
        self.lr_sum = self.lr_sum + lr

    def snapshot(self, engine, step: int) -> None:
        """Collective under ZeRO-3 (it gathers the weights): copy the trained freezable layers'
        weights."""
        with engine.gathered():
            self.then = {
                n: p.detach().to("cpu", torch.float32, copy=True)
                for n, p in engine.live_module().named_parameters()
                if p.requires_grad and layer_of(n) < self.num_freezable
            }
        self.since, self.lr_sum = step, 0.0

    def take(self, engine, step: int) -> list[float] | None:
        """Collective: each layer's move since the last copy per unit of learning rate as a share of
        its largest (0 for a frozen layer), or None when the copy is not one interval old or the
        rate was 0; then a new copy."""
        then, since, lr_sum = self.then, self.since, float(self.lr_sum)
        self.snapshot(engine, step)
        sums = torch.zeros(2, self.num_freezable, dtype=torch.float64)
        for name, now in self.then.items():
            if name in then:
                sums[0, layer_of(name)] += (now - then[name]).double().pow(2).sum()
                sums[1, layer_of(name)] += then[name].double().pow(2).sum()
        # A pipeline's other stages hold other layers (0 here); data-parallel copies and ZeRO-3's
        # gathered weights are alike on every rank.
        sums = sums.to(engine.device)
        dist.all_reduce(sums, op=dist.ReduceOp.MAX)
        if since is None or step - since != self.interval_steps or lr_sum <= 0:
            return None
        moves = ((sums[0] / sums[1].clamp_min(1e-30)).sqrt() / lr_sum).tolist()
        self.peak = [max(p, m) for p, m in zip(self.peak, moves)]
        return [m / p if p > 0 else 0.0 for m, p in zip(moves, self.peak)]
