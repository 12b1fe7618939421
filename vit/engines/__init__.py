"""Training engines, one module each, behind one interface (vit.engines.base.Engine):

    engine = build(name, ctx)          # ctx: EngineContext
    loss = engine.train_step(batches)  # one optimizer step; this rank's share of the loss, no host sync
    engine.mean_loss(loss); engine.evaluate(batches); engine.save(...); engine.load(...); engine.breakdown(steps)
    rebuilt.take_over(engine.handover())  # --freeze: an engine on other trainable layers goes on (vit.freeze)

Nothing outside this package knows which engine runs.
"""
import importlib

from vit.engines.base import Engine, EngineContext

__all__ = ["Engine", "EngineContext", "build"]


def build(name: str, ctx: EngineContext) -> Engine:
    return importlib.import_module(f"vit.engines.{name.replace('-', '_')}").build(ctx)
