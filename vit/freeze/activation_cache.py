"""--freeze-cache (PipeTransformer's AutoCache): the frozen prefix's output for each training
sample, kept in host memory (past --freeze-cache-gib in files under the log dir) and fed to the
engine in place of the images, whose frozen layers then pass their input through while training.
Where the loader reads in the training process (no workers) and the data set gives its labels
without its images, the images of a sample it holds are not read at all
(vit.data.augment.ImagesUnless).

Valid only when a sample is the same every epoch: no random augmentation, no mixup. At a new freeze
boundary each entry is carried through the newly frozen layers (`advance`) rather than computed
again from its image. Dropout or drop-path inside the frozen layers would be drawn once per sample
instead of per step.
"""

import os
import shutil

import torch

from vit.data.sampling import TrainBatches

ADVANCE_BATCH = 256  # entries carried through the newly frozen layers at a time


class FeatureCache:
    def __init__(self, limit_gib: float, spill_dir: str):
        self.limit_bytes, self.spill_dir = limit_gib * 2**30, spill_dir
        self.memory, self.spilled, self.bytes = {}, set(), 0
        self.depth = 0  # the entries are the output of the first `depth` layers

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

    def advance(self, depth: int, run, on_progress=None) -> None:
        """Make the entries the output of the first `depth` layers: run(x, start) is the frozen
        prefix from layer `start` on (host tensors in and out), applied to ADVANCE_BATCH entries at
        a time, on_progress() after each (a large spilled cache rewrites every file: the watchdog
        hears of it). A shorter prefix empties the cache."""
        if depth < self.depth:
            self.clear()
        keys, start = [*self.memory, *self.spilled], self.depth
        self.depth = depth
        if depth == start or not keys:
            return
        memory, spilled = self.memory, self.spilled
        self.memory, self.spilled, self.bytes = {}, set(), 0
        for first in range(0, len(keys), ADVANCE_BATCH):
            chunk = keys[first : first + ADVANCE_BATCH]
            old = torch.stack(
                [memory.pop(i) if i not in spilled else self._take_file(i) for i in chunk]
            )
            for i, row in zip(chunk, run(old, start)):
                self.put(i, row.clone())
            if on_progress is not None:
                on_progress()

    def _take_file(self, i: int) -> torch.Tensor:
        path = os.path.join(self.spill_dir, f"{i}.pt")
        t = torch.load(path, weights_only=True)
        os.remove(path)
        return t


def cached_batches(batches, order: TrainBatches, prefix, cache: FeatureCache, device: torch.device):
    """This rank's micro-batches with the images replaced by prefix(images): each sample's looked up
    in the cache, or computed (the missing ones together) and stored. `order` is the sampler the
    batches were drawn with, walked in step to name their samples; padding (index -1) is computed
    and never stored."""
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
        if device.type == "cuda":  # page-locked (torch's caching host allocator): the copy is async
            x = x.pin_memory()
        x = x.to(device, non_blocking=True)
        yield x, y


def directory(s, log_dir: str, rank: int) -> str | None:
    """Where this rank's cache spills, or None when --freeze-cache is off for settings `s`."""
    f, r = s.freeze, s.recipe
    on = f.freeze != "none" and (
        f.freeze_cache == "on" or (f.freeze_cache == "auto" and not (r.augments or r.mixes))
    )
    return os.path.join(log_dir, f"freeze_cache_rank{rank}") if on else None
