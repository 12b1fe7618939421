"""--engine ddp-checked's option: how often the ranks compare their weights."""

from dataclasses import dataclass

from vit.core.settings import option


@dataclass(frozen=True)
class CheckSettings:
    check_every: int = option(
        1,
        "steps between checksums of the weights, all-reduced: ranks whose weights differ stop the "
        "run",
        "positive",
        needs="engine",
    )
