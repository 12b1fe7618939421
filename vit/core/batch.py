"""The batch arithmetic: global batch = micro-batch x gradient accumulation x data-parallel size;
where the ranks take unequal shares of each micro-step, the sum of the shares x gradient
accumulation."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Batch:
    micro_batch: int  # the largest share where `split` gives them
    grad_accum: int
    dp_size: int
    # every data-parallel rank's micro-batch where they differ (a resume keeping a global batch its
    # ranks do not divide: vit.run.plan.keep_global_batch); None: micro_batch each
    split: tuple[int, ...] | None = None

    @property
    def global_size(self) -> int:
        per_micro_step = sum(self.split) if self.split else self.micro_batch * self.dp_size
        return per_micro_step * self.grad_accum

    def arithmetic(self) -> str:
        if self.split:
            return (
                f"global batch {self.global_size} = micro-batches "
                f"{' + '.join(map(str, self.split))} x grad accum {self.grad_accum} "
                f"(data-parallel {self.dp_size})"
            )
        return (
            f"global batch {self.global_size} = micro-batch {self.micro_batch} x grad accum "
            f"{self.grad_accum} x data-parallel {self.dp_size}"
        )
