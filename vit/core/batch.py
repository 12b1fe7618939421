"""The batch arithmetic: global batch = micro-batch x gradient accumulation x data-parallel size."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Batch:
    micro_batch: int
    grad_accum: int
    dp_size: int

    @property
    def global_size(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp_size

    def arithmetic(self) -> str:
        return (
            f"global batch {self.global_size} = micro-batch {self.micro_batch} x grad accum "
            f"{self.grad_accum} "
            f"x data-parallel {self.dp_size}"
        )
