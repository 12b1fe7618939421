"""--engine ddp's options (vit.core.settings.option fields): torch's DDP communication hooks. Its
spec declares the group as `comm`."""

from dataclasses import dataclass

from vit.core.settings import option

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class CommSettings:
    """--engine ddp: torch's DDP communication hooks
    (torch.distributed.algorithms.ddp_comm_hooks)."""

    comm_hook: str = option(
        "none",
        "compress DDP's gradient all-reduce: fp16 or bf16 (half the bytes), or powersgd (low-rank, "
        "with error feedback); none registers no hook",
        choices=COMM_HOOKS,
    )
    powersgd_rank: int = option(
        4, "powersgd: matrix approximation rank (lower: fewer bytes)", "positive", needs="powersgd"
    )
    powersgd_start_step: int = option(
        10,
        "powersgd: optimizer steps of plain all-reduce before compressing (torch's "
        "start_powerSGD_iter, at least 2)",
        "non_negative",
        needs="powersgd",
    )
