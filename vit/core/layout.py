"""A pipeline's stages: how many, where each begins, and the micro-batches each data-parallel copy
takes a step (what --freeze-replan changes at a freeze point, and what a pipeline engine is built
on)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    stages: int
    parts: list[int]  # stage s holds layers parts[s] .. parts[s+1]-1
    grad_accum: int  # micro-batches per step and data-parallel copy
