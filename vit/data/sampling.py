"""The step-indexed sampling every engine shares, and the loaders over it.

Global batch k is a fixed function of (seed, k): a seeded permutation per epoch, cut into global
batches. Data-parallel rank r takes its micro-batches out of each global batch. A single process
with the whole global batch therefore sees the same samples in the same steps as any data-parallel
run, and resuming at step k needs no sampler state.
"""

import signal
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from vit.core.errors import ConfigError

PAD_LABEL = -100  # evaluation padding, ignored by the loss and by top-1


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    return num_samples // global_batch


@dataclass(eq=False)
class TrainBatches(Sampler):
    """Index lists of this rank's micro-batches, step after step, from `start_step` to `end_step`.

    Global batch k is cut into grad_accum chunks, one per micro-step; data-parallel rank r takes its
    micro-batch out of each chunk, after those of ranks 0..r-1. `sizes` gives every rank's
    micro-batch when they differ (--batch-split proportional); by default all are `micro_batch`.
    keyed: sample i of step k is asked for as k x N + i (vit.data.augment.Augmented); partners: each
    micro-batch is followed by its mixup partners (vit.data.augment.Mixed).
    """

    num_samples: int
    micro_batch: int
    grad_accum: int
    dp_rank: int
    dp_size: int
    seed: int
    start_step: int
    end_step: int
    sizes: list[int] | None = None
    keyed: bool = False
    partners: bool = False

    def __post_init__(self):
        self.sizes = self.sizes or [self.micro_batch] * self.dp_size
        self.global_batch = sum(self.sizes) * self.grad_accum
        self.per_epoch = steps_per_epoch(self.num_samples, self.global_batch)
        if self.per_epoch == 0:
            raise ConfigError(
                f"global batch {self.global_batch} is larger than the "
                f"{self.num_samples} training samples"
            )

    def _perm(self, epoch: int) -> torch.Tensor:
        return torch.randperm(
            self.num_samples,
            generator=torch.Generator().manual_seed(self.seed * 100003 + epoch),
        )

    def __iter__(self):
        perm, perm_epoch = None, -1
        for step in range(self.start_step, self.end_step):
            epoch, pos = divmod(step, self.per_epoch)
            if epoch != perm_epoch:
                perm, perm_epoch = self._perm(epoch), epoch
            batch = perm[pos * self.global_batch : (pos + 1) * self.global_batch]
            chunk, mine = sum(self.sizes), self.sizes[self.dp_rank]
            for j in range(self.grad_accum):
                first = j * chunk + sum(self.sizes[: self.dp_rank])
                idx = batch[first : first + mine]
                # then mixup's partners (global positions G-1-p), in reverse: see vit.data.augment
                if self.partners:
                    idx = torch.cat([idx, batch.flip(0)[first : first + mine].flip(0)])
                yield (idx + step * self.num_samples if self.keyed else idx).tolist()

    def __len__(self):
        return (self.end_step - self.start_step) * self.grad_accum


class _Padded(Dataset):
    """Index -1 is a padding sample: zeros with PAD_LABEL. The DataLoader fetches a batch at a time
    (__getitems__), and so does the data set below where it can (vit.data.augment.Augmented)."""

    def __init__(self, ds: Dataset):
        self.ds, self.pad = ds, torch.zeros_like(ds[0][0])

    def __len__(self):
        return len(self.ds)

    def __getitems__(self, keys: list[int]) -> list:
        got = iter(fetch(self.ds, [k for k in keys if k >= 0]))
        return [(self.pad, torch.tensor(PAD_LABEL)) if k < 0 else next(got) for k in keys]


def fetch(ds: Dataset, keys: list[int]) -> list:
    """`ds`'s samples `keys`, in one batched call where it has one (__getitems__)."""
    return ds.__getitems__(keys) if hasattr(ds, "__getitems__") else [ds[k] for k in keys]


def eval_batches(num_samples: int, micro_batch: int, dp_rank: int, dp_size: int) -> list[list[int]]:
    """This rank's share (r, r + dp, ...) in full micro-batches, padded with -1.

    Every rank gets the same number of micro-batches: ZeRO-3 and the pipeline need every rank to run
    every forward.
    """
    mine = list(range(dp_rank, num_samples, dp_size))
    per_rank = -(-num_samples // dp_size)
    count = -(-per_rank // micro_batch)
    mine += [-1] * (count * micro_batch - len(mine))
    return [mine[i * micro_batch : (i + 1) * micro_batch] for i in range(count)]


def make_loader(ds: Dataset, batches, workers: int, pin_memory: bool) -> DataLoader:
    """A DataLoader over precomputed index lists (a Sampler or a list of lists); its workers, if
    any, persist from one pass to the next (the evaluation loader is reused)."""
    return DataLoader(
        _Padded(ds),
        batch_sampler=batches,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        worker_init_fn=take_signals if workers else None,
    )


def take_signals(worker_id: int) -> None:
    """A loader worker leaves Ctrl-C to its rank and gives up the rank's way of stopping
    (vit.train.StopOnSignal: a pipe it shares after the fork), so that terminate() ends the worker
    as before instead of stopping its rank."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_DFL)


MAX_GPU_WORKERS = 4


def loader_workers(requested: int | None, device_type: str, cores: int) -> int:
    """--workers, or by default: none on a CPU (its cores train the model, and CPU runs stay as they
    were); on a GPU up to MAX_GPU_WORKERS, leaving one of the rank's cores (`cores`:
    vit.runtime.dist_env.rank_cores) to the loop."""
    if requested is not None:
        return requested
    return min(MAX_GPU_WORKERS, max(1, cores - 1)) if device_type == "cuda" else 0
