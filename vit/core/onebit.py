"""DeepSpeed's communication-efficient optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB): refused, by
the name a user would try, in one line before any process group, because the DeepSpeed this project
pins has none of them.

What the installed DeepSpeed 0.19.8 (requirement.txt pins it) says, read from its source under
site-packages/deepspeed:
- runtime/config.py:52-66: DEEPSPEED_OPTIMIZERS is adagrad, adam, adamw, lamb, muadam, muadamw,
  musgd, lion, muon; the ONEBIT_ADAM / ZERO_ONE_ADAM / ONEBIT_LAMB names of earlier releases are
  gone.
- runtime/engine.py:1985-1986 (_is_supported_optimizer) and 2016-2019 (_do_sanity_check): a JSON
  optimizer type outside that list and not a torch.optim class fails deepspeed.initialize with
  "OneBitAdam is not a supported DeepSpeed Optimizer" (an AssertionError, after the process group is
  up).
- runtime/engine.py:2476-2550 (_configure_basic_optimizer): no branch builds a 1-bit optimizer.
- runtime/fp16/ holds fused_optimizer.py, loss_scaler.py and unfused_optimizer.py: no onebit/
  package; runtime/comm/ holds only coalesced_collectives.py: no nccl.py, mpi.py, hccl.py or
  compressed.py backend (the cupy and mpi4py users); ops/op_builder/ has no packbits builder, on any
  accelerator. DeepSpeed removed the optimizers in deepspeedai/DeepSpeed#8490 (tracking issue #8489;
  PR #8547's description says so, while removing the compressed-allreduce backends left behind;
  those are absent from 0.19.8 as listed above). So the claims made of them for older releases (the
  engine builds them from the JSON, ZeRO stage 0 only, fp16 only, nccl/mpi backends needing cupy)
  describe code that no longer exists here, and nothing of it can run on any host of this project,
  GPU or CPU. What compresses gradients instead: --engine ddp --comm-hook fp16|bf16|powersgd, or
  communication_data_type in the JSON for the DeepSpeed engines (docs/ethernet.md).
  tests/test_onebit.py checks the installed DeepSpeed still lacks them, so an upgrade that changes
  this fails there.

Should an optimizer built by DeepSpeed from the JSON ever be wired in, our LR schedule has to reach
it as a callable: deepspeed.initialize(model_parameters=<our param groups>, lr_scheduler=lambda opt:
make_scheduler(opt, ...)), which runtime/engine.py:1885-1887 calls with the optimizer it built; a
scheduler object needs an optimizer object to exist first (and engine.py:2026-2028 asserts a client
optimizer beside a torch _LRScheduler).
"""

import argparse

from vit.core.errors import ConfigError

# --opt name (lower case, as timm's names) -> (DeepSpeed's JSON optimizer type in the releases that
# had it, what it is).
ONEBIT = {
    "onebitadam": ("OneBitAdam", "1-bit Adam"),
    "zerooneadam": ("ZeroOneAdam", "0/1 Adam"),
    "onebitlamb": ("OneBitLamb", "1-bit LAMB"),
}
ALTERNATIVES = (
    "for smaller gradients use --engine ddp --comm-hook fp16, bf16 or powersgd, or "
    "communication_data_type fp16 or bf16 in the DeepSpeed JSON (docs/ethernet.md)"
)


def onebit_type(name) -> str | None:
    """DeepSpeed's type name when `name` (an --opt value or a JSON optimizer type, any case:
    DeepSpeed lower-cased them) is one of the 1-bit optimizers; else None."""
    return ONEBIT[name.lower()][0] if isinstance(name, str) and name.lower() in ONEBIT else None


def removed(name: str) -> str:
    """The one-line reason the 1-bit optimizer `name` cannot be used."""
    kind, what = ONEBIT[name.lower()]
    return (
        f"DeepSpeed's {what} (optimizer type {kind}) was removed from DeepSpeed "
        "(deepspeedai/DeepSpeed#8490): the pinned 0.19.8 would refuse it at deepspeed.initialize "
        f"('not a supported DeepSpeed Optimizer'); {ALTERNATIVES}"
    )


def check_opt_name(text: str) -> str:
    """argparse type of --opt: a 1-bit optimizer's name is refused with the reason (the choices say
    the rest)."""
    if onebit_type(text):
        raise argparse.ArgumentTypeError(f"{text}: {removed(text)}")
    return text


def check_json_optimizer(cfg: dict, name: str) -> None:
    """A JSON `optimizer` section naming a 1-bit optimizer: refused with the reason (any other type
    is refused by vit.run.ds_config.resolve: the optimizer comes from the command line)."""
    kind = cfg.get("optimizer", {}).get("type") if isinstance(cfg.get("optimizer"), dict) else None
    if onebit_type(kind):
        raise ConfigError(f"DeepSpeed config {name}: optimizer {kind!r}: {removed(kind)}")
