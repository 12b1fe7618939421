"""--freeze-cache (PipeTransformer's AutoCache): the frozen prefix's output for each training sample, kept in host
memory (past --freeze-cache-gib in files under the log dir) and fed to the engine in place of the images, whose
frozen layers then pass their input through while training.

Valid only when a sample is the same every epoch: no random augmentation, no mixup. It is emptied at each new
freeze boundary. Dropout or drop-path inside the frozen layers would be drawn once per sample instead of per step.
"""
import os
import shutil

import torch

from vit.data.sets import TrainBatches


class FeatureCache:
    def __init__(self, limit_gib: float, spill_dir: str):
        self.limit_bytes, self.spill_dir = limit_gib * 2**30, spill_dir
        self.memory, self.spilled, self.bytes = {}, set(), 0

    def __contains__(self, i: int) -> bool:
        return i in self.memory or i in self.spilled

    def get(self, i: int) -> torch.Tensor:
        if i in self.memory:
            return self.memory[i]
        return torch.load(os.path.join(self.spill_dir, f"{i}.pt"), weights_only=True)

    def put(self, i: int, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.bytes + size <= self.limit_bytes:
            self.memory[i], self.bytes = t, self.bytes + size
            return
        os.makedirs(self.spill_dir, exist_ok=True)
        torch.save(t.clone(), os.path.join(self.spill_dir, f"{i}.pt"))
        self.spilled.add(i)

    def clear(self) -> None:
        self.memory, self.spilled, self.bytes = {}, set(), 0
        shutil.rmtree(self.spill_dir, ignore_errors=True)


def cached_batches(batches, order: TrainBatches, prefix, cache: FeatureCache, device: torch.device):
    """This rank's micro-batches with the images replaced by prefix(images): each sample's looked up in the cache,
    or computed (the missing ones together) and stored. `order` is the sampler the batches were drawn with, walked
    in step to name their samples; padding (index -1) is computed and never stored."""
    for (x, y), idx in zip(batches, order):
        missing = [k for k, i in enumerate(idx) if i < 0 or i not in cache]
        computed = {}
        if missing:
            out = prefix(x[missing].to(device, non_blocking=True)).cpu()
            for k, row in zip(missing, out):
                computed[k] = row
                if idx[k] >= 0:
                    cache.put(idx[k], row.clone())
        x = torch.stack([computed[k] if k in computed else cache.get(i) for k, i in enumerate(idx)])
        x = x.to(device, non_blocking=True)
        yield x, y


def directory(s, log_dir: str, rank: int) -> str | None:
    """Where this rank's cache spills, or None when --freeze-cache is off for settings `s`."""
    f, r = s.freeze, s.recipe
    on = f.freeze != "none" and (f.freeze_cache == "on" or (f.freeze_cache == "auto" and not (r.augments or r.mixes)))
    return os.path.join(log_dir, f"freeze_cache_rank{rank}") if on else None
