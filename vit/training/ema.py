"""--model-ema: timm's ModelEmaV3 over the layers this rank trains, evaluated beside the model.

The average is kept in fp32 on a copy of the layers taken before the engine exists (ZeRO-3
partitions the parameters in place), limited to the layers this rank holds (a pipeline stage's).
Each step it is updated from the engine's parameters, gathered whole under ZeRO-3 (engine.gathered).
To evaluate it, its values are copied into the engine's parameters and the originals put back
afterwards, so every engine evaluates it with its own forward (a pipeline stage swaps its own
layers); under ZeRO-3 rank 0's copy is scattered back to the partitions.
"""

import contextlib
from collections import OrderedDict

import torch
from timm.utils import ModelEmaV3
from torch import nn


class Ema:
    def __init__(self, layers: list[nn.Module], engine, decay: float):
        """`layers`: a copy of the whole layer list, taken before the engine was built."""
        held = {k.split(".")[0] for k in engine.live_module().state_dict()}
        mine = OrderedDict((str(i), layer) for i, layer in enumerate(layers) if str(i) in held)
        self.timm = ModelEmaV3(
            nn.Sequential(mine), decay=decay, device=engine.device, dtype=torch.float32
        )

    @torch.no_grad()
    def update(self, engine, step: int) -> None:
        with engine.gathered():
            self.timm.update(engine.live_module(), step)

    def state_dict(self) -> dict:
        return self.timm.module.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.timm.module.load_state_dict(state)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self, engine):
        """The engine's parameters hold the average inside this context, their own values again
        after it."""
        params = list(engine.live_module().parameters())
        with engine.gathered(modifier_rank=0):
            kept = [p.data.clone() for p in params]
            for p, e in zip(params, self.timm.module.parameters()):
                p.data.copy_(e.to(p.dtype))
        try:
            yield
        finally:
            with engine.gathered(modifier_rank=0):
                for p, k in zip(params, kept):
                    p.data.copy_(k)
