"""One pass over a DataLoader's indices, reproducible from (seed, epoch) and started at any batch.

:mod:`ckpt_lesson.runs.data_position` keeps the position (epoch, batches
consumed); this module turns a position into the batches still to come:

- every random choice a pass makes is derived from ``(seed, epoch)``: the
  sampler's generator (swapped in while the pass starts, so a generator the
  user passed is never advanced), ``set_epoch`` for samplers that have one
  (``DistributedSampler``), the global generator forked and seeded for
  samplers that draw from it, and the loader's generator (the workers' base
  seed). Nothing is drawn from the global generator when a pass starts.
- the first ``consumed`` batches are skipped as index lists: the sampler's
  cost for them, no dataset reads, no collation.
- each batch carries a seed derived from ``(seed, epoch, batch)``; the fetch
  runs under it (torch, ``random`` and NumPy global generators), so a random
  augmentation draws the same numbers whichever worker fetches the batch and
  whether or not the process was restarted mid-epoch.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

__all__ = ["PassBatches", "SeededFetch", "TaggedBatch", "derive_seed", "seeded_generator", "seeded_globals"]


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``parts`` (the same in every process and on every machine).

    Example:
        >>> derive_seed(7, 0) == derive_seed(7, 0) != derive_seed(7, 1)
        True
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seeded_generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@contextlib.contextmanager
def seeded_globals(seed: int) -> Iterator[None]:
    """Run a block with torch's CPU, ``random``'s and NumPy's global generators seeded, then put them back.

    Only the CPU generator is touched (``torch.manual_seed`` would also reseed every CUDA device).
    """
    np = sys.modules.get("numpy")  # seeded only where the process uses NumPy at all
    saved = (torch.get_rng_state(), random.getstate(), np.random.get_state() if np else None)
    try:
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        if np is not None:
            np.random.seed(seed % 2**32)
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        if np is not None:
            np.random.set_state(saved[2])


class TaggedBatch(list):
    """A batch of dataset indices with the seed its fetch runs under (pickles to workers as a list)."""

    seed: int = 0


class SeededFetch(Dataset):
    """The user's map-style dataset, fetched a batch at a time under the batch's derived seed."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, batch: list) -> list:
        with seeded_globals(getattr(batch, "seed", 0)):
            own = getattr(self.dataset, "__getitems__", None)
            if own:
                return own(list(batch))
            return [self.dataset[i] for i in batch]


class PassBatches:
    """The index sampler the wrapped loader iterates: the remaining batches of the current pass.

    ``start(...)`` prepares a pass; ``iter()`` then returns that pass's iterator (a DataLoader
    iterator may call ``iter`` on its sampler twice before its first batch, so it must be the
    same one).
    """

    def __init__(self, index_sampler: Any, *, generator_owners: list[Any], length: int) -> None:
        self.index_sampler = index_sampler
        self.generator_owners = generator_owners
        self.length = length
        self._current: Iterator[TaggedBatch] = iter(())

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[TaggedBatch]:
        return self._current

    def start(self, *, seed: int, epoch: int, skip: int) -> None:
        """Prepare pass ``epoch`` from batch ``skip`` on (0-based); no data is read."""
        for owner in self.generator_owners:
            if callable(getattr(owner, "set_epoch", None)):
                owner.set_epoch(epoch)  # DistributedSampler: its own (seed + epoch) shuffle
        shuffle = seeded_generator(derive_seed(seed, epoch, "sampler"))
        swapped = [(o, o.generator) for o in self.generator_owners if hasattr(o, "generator")]
        indices = iter(self.index_sampler)
        first: list[Any] = []
        try:
            for owner, _ in swapped:
                owner.generator = shuffle
            # Samplers bind their generator, or draw their seed from the global one, at the
            # first index: take the skipped batches and the first kept one inside this block.
            with seeded_globals(derive_seed(seed, epoch, "global")):
                first = list(itertools.islice(indices, skip, skip + 1))
        finally:
            for owner, generator in swapped:
                owner.generator = generator
        self._current = _tagged(itertools.chain(first, indices), seed=seed, epoch=epoch, start=skip)


def _tagged(batches: Iterator[Any], *, seed: int, epoch: int, start: int) -> Iterator[TaggedBatch]:
    for position, indices in enumerate(batches, start):
        batch = TaggedBatch(indices)
        batch.seed = derive_seed(seed, epoch, position)
        yield batch
