"""Training augmentation with timm's pipeline, as a function of (seed, step, sample), and timm's
Mixup/CutMix.

Every engine, data-parallel width and number of workers must see the same augmented global batch, or
the engines would not train the same network. So:

- a training sample is asked for by key step x N + index
  (vit.data.sampling.TrainBatches(keyed=True)), and `Augmented` runs timm's create_transform on it
  with torch's, numpy's and Python's generators seeded from (seed, step, index), in a forked state
  that leaves the model's (drop-path's) generator alone;
- timm's Mixup mixes a batch with its reverse (sample p with sample B-1-p) with one lam per batch,
  drawn from numpy's generator. `Mixed` seeds it from (seed, step). A single process mixes the
  global batch of G as it is; a data-parallel rank or a micro-step gets its samples followed by
  their partners (global positions G-1-p) in reverse order (TrainBatches(partners=True)), so the
  same call pairs each of its samples with the same partner under the same lam, and keeps the first
  half.
"""

import random
from dataclasses import replace

import numpy as np
import torch
from timm.data import Mixup, create_transform
from torch.utils.data import Dataset, TensorDataset

from vit.core.errors import ConfigError
from vit.core.settings import RecipeSettings
from vit.data.sampling import TrainBatches, fetch, make_loader


def _seed(*parts: int) -> int:
    s = 0
    for p in parts:
        s = (s * 1_000_003 + int(p)) % 2**63
    return s


class Augmented(Dataset):
    """Sample `index` of `raw` (PIL image, label) through `transform`, asked for by key step x
    len(raw) + index."""

    def __init__(self, raw: Dataset, transform, seed: int):
        self.raw, self.transform, self.seed = raw, transform, seed

    def __len__(self):
        return len(self.raw)

    def __getitem__(self, key: int):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[int]) -> list:
        """The DataLoader's batched fetch: each sample under its own seeds, the caller's generators
        saved and restored once per batch (per sample, that cost four times the crop itself)."""
        py, npy = random.getstate(), np.random.get_state()
        samples = []
        with torch.random.fork_rng(devices=[]):
            for key in keys:
                step, index = divmod(key, len(self.raw))
                image, label = self.raw[index]
                s = _seed(self.seed, step, index)
                # torch.manual_seed would seed every device's too
                torch.default_generator.manual_seed(s)
                random.seed(s)
                np.random.seed(s % 2**32)
                samples.append((self.transform(image), label))
        random.setstate(py)
        np.random.set_state(npy)
        return samples


class LabelsOnly(Dataset):
    """A data set's labels, each with a blank image: what a rank that uses only the labels (a
    pipeline's last stage) reads instead of the images. Mixup still gets images of the right shape
    to mix."""

    def __init__(self, labels: torch.Tensor, blank: torch.Tensor):
        self.labels, self.blank = labels, blank

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, key: int):
        return self.blank, self.labels[key % len(self.labels)]  # keyed (step x N + index) or not


class ImagesUnless(Dataset):
    """`ds`, but a sample in `skip` (looked up as it is fetched) comes from `blank` (LabelsOnly)
    without reading its image: --freeze-cache holds its features already
    (vit.freeze.activation_cache)."""

    def __init__(self, ds: Dataset, blank: LabelsOnly, skip):
        self.ds, self.blank, self.skip = ds, blank, skip

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, key: int):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[int]) -> list:
        skipped = [k in self.skip for k in keys]
        got = iter(fetch(self.ds, [k for k, s in zip(keys, skipped) if not s]))
        samples = []
        for k, s in zip(keys, skipped):
            x, y = self.blank[k] if s else next(got)
            # one type of label: a batch may collate some of each
            samples.append((x, torch.as_tensor(y)))
        return samples


def without_images(ds: Dataset, data) -> Dataset:
    """`ds` for a rank that uses only its labels: LabelsOnly where they come without the images (a
    TensorDataset's second tensor, or `targets` as torchvision's data sets and this project's have
    them), else `ds` itself."""
    labels = ds.tensors[1] if isinstance(ds, TensorDataset) else getattr(ds, "targets", None)
    if labels is None:
        return ds
    return LabelsOnly(
        torch.as_tensor(labels), torch.zeros(data.in_chans, data.img_size, data.img_size)
    )


def train_transform(r: RecipeSettings, in_chans: int, img_size: int, mean, std):
    """timm's training transform: random-resized-crop (identity without --scale), flip, --aa,
    --color-jitter, normalisation, --reprob random erasing."""
    return create_transform(
        input_size=(in_chans, img_size, img_size),
        is_training=True,
        scale=tuple(r.scale or (1.0, 1.0)),
        ratio=(3 / 4, 4 / 3) if r.scale else (1.0, 1.0),
        hflip=r.hflip,
        vflip=0.0,
        color_jitter=r.color_jitter or None,
        auto_augment=r.aa,
        interpolation="bilinear",
        mean=tuple(mean),
        std=tuple(std),
        re_prob=r.reprob,
        re_mode="pixel",
        re_count=1,
    )


def data_recipe(r: RecipeSettings, data) -> RecipeSettings:
    """The recipe as it applies to `data`: the data set's default crop where --scale is not given,
    and no augmentation at all with --no-aug."""
    if r.no_aug:
        return replace(r, scale=None, aa=None, reprob=0.0, color_jitter=0.0, hflip=0.0)
    if r.scale is None and data.default_scale:
        return replace(r, scale=tuple(data.default_scale))
    return r


def train_dataset(data, r: RecipeSettings, seed: int) -> tuple[Dataset, bool]:
    """(the training set, whether it is keyed by step): augmented when any augmentation option is
    on."""
    if not r.augments:
        return data.train, False
    if data.raw_train is None:
        raise ConfigError(
            "augmentation (--aa, --reprob, --color-jitter, --hflip, --scale) needs images; "
            "this data set has none (synthetic noise)"
        )
    transform = train_transform(r, data.in_chans, data.img_size, data.mean, data.std)
    return Augmented(data.raw_train, transform, seed), True


def make_mixup(r: RecipeSettings, num_classes: int) -> Mixup | None:
    if not r.mixes:
        return None
    return Mixup(
        mixup_alpha=r.mixup,
        cutmix_alpha=r.cutmix,
        prob=r.mixup_prob,
        switch_prob=r.mixup_switch_prob,
        mode="batch",
        label_smoothing=r.smoothing,
        num_classes=num_classes,
    )


class Mixed:
    """(images, soft targets) from batches of (images, labels): timm's Mixup with lam a function of
    (seed, step).

    halves=True: each batch holds this rank's samples and then their partners in reverse order; the
    first half is kept. halves=False: the batch is the whole global batch (the single-process
    reference)."""

    def __init__(
        self, batches, mixup: Mixup, seed: int, start_step: int, grad_accum: int, halves: bool
    ):
        self.batches, self.mixup, self.seed = iter(batches), mixup, seed
        self.start, self.grad_accum, self.halves, self.count = start_step, grad_accum, halves, 0

    def __iter__(self):
        return self

    def __next__(self):
        x, y = next(self.batches)
        step = self.start + self.count // self.grad_accum
        self.count += 1
        state = np.random.get_state()
        np.random.seed(_seed(self.seed, step, 7) % 2**32)
        x, y = self.mixup(x, y)
        np.random.set_state(state)
        if self.halves:
            n = len(x) // 2
            x, y = x[:n], y[:n]
        return x, y


def train_batches(
    data,
    r: RecipeSettings,
    seed: int,
    *,
    partners: bool = True,
    workers: int = 0,
    pin_memory: bool = False,
    labels_only: bool = False,
    cached=None,
    **sampler,
):
    """This rank's training batches: vit.data.sampling.TrainBatches(**sampler) over the (augmented)
    training set, mixed when --mixup or --cutmix is on. partners=False: the single-process
    reference, which mixes whole global batches. labels_only: the same labels (and mixed targets)
    with blank images, where the data set can give its labels without its images (without_images).
    cached: the samples whose images are not needed (their features are in --freeze-cache's cache),
    also given blank where the labels come without the images."""
    r = data_recipe(r, data)
    dataset, keyed = train_dataset(data, r, seed)
    if labels_only:
        dataset = without_images(data.train, data)
    elif (
        cached is not None
        and not keyed
        and isinstance(blank := without_images(data.train, data), LabelsOnly)
    ):
        dataset = ImagesUnless(dataset, blank, cached)
    mixup = make_mixup(r, data.num_classes)
    order = TrainBatches(
        num_samples=len(data.train),
        seed=seed,
        keyed=keyed,
        partners=partners and bool(mixup),
        **sampler,
    )
    loader = make_loader(dataset, order, workers, pin_memory)
    if mixup is None:
        return iter(loader)
    return Mixed(loader, mixup, seed, order.start_step, order.grad_accum, halves=partners)
