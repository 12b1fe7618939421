"""DDP with a checksum of the weights all-reduced every --check-every steps (a host sync then)."""

import torch
import torch.distributed as dist

from vit.engines.base import EngineContext
from vit.engines.ddp.engine import DDPEngine


class CheckedEngine(DDPEngine):
    def __init__(self, ctx: EngineContext):
        super().__init__(ctx)
        self.check_every, self.steps = ctx.settings.checked.check_every, 0

    def train_step(self, batches):
        loss = super().train_step(batches)
        self.steps += 1
        if self.steps % self.check_every == 0:
            self.check()
        return loss

    def check(self) -> None:
        """The largest and smallest of the ranks' weight sums (in fp64) must be one number."""
        with torch.no_grad():
            total = sum(p.double().sum() for p in self.model.module.parameters())
        extremes = torch.stack([total, -total])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        high, low = extremes[0].item(), -extremes[1].item()
        if high != low:
            raise RuntimeError(
                f"--engine ddp-checked: after {self.steps} steps of this run the ranks' weights "
                f"differ (their sums run from {low!r} to {high!r})"
            )


def build(ctx: EngineContext):
    return CheckedEngine(ctx)
