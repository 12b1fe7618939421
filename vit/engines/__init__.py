"""Training engines, a folder each (zero/, pipeline/, async_pipeline/, ddp/; deepspeed/ holds what
DeepSpeed's two share), behind one interface (vit.engines.base.Engine) and one registry row each
(vit.engines.registry). A folder's __init__.py declares the engine's spec (vit.core.spec.EngineSpec:
its options, precisions, memory terms, step cost, names; no torch) and its engine.py the engine:

    engine = build(name, ctx)          # ctx: EngineContext
    loss = engine.train_step(batches)  # one optimizer step; this rank's share of the loss
    engine.mean_loss(loss); engine.evaluate(batches); engine.save(...); engine.load(...)
    rebuilt.take_over(engine.handover())  # --freeze: an engine on other trainable layers goes on

Nothing outside this package and vit.run.compat knows which engine runs: the rest asks the
engine's spec. Importing the package is light (the registry needs no torch); Engine, EngineContext
and build load on first use.
"""

import importlib

__all__ = ["Engine", "EngineContext", "build"]
_WHERE = {
    "Engine": "vit.engines.base",
    "EngineContext": "vit.engines.base",
    "build": "vit.engines.registry",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'vit.engines' has no attribute {name!r}")
