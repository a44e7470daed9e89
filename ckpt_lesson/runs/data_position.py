"""A data position for a plain ``torch.utils.data.DataLoader``: ``cl.resumable(loader)``.

A ``DataLoader(shuffle=True)`` draws its order from the global generator when
each pass starts, so restoring the generator mid-epoch does not bring the
order back, and a resumed loop starts its epoch over. ``resumable`` gives the
loader a position, a part of the training state (``state_dict`` / ``load_state_dict``):
the epoch (which pass), the batches of it already handed out, and the seed
every pass derives its randomness from, so pass ``e`` is the same pass in every
process:

- every random choice a pass makes is derived from ``(seed, epoch)``: the
  sampler's generator (swapped in while the pass starts, so a generator the
  user passed is never advanced), ``set_epoch`` for samplers that have one
  (``DistributedSampler``), the global generator forked and seeded for
  samplers that draw from it, and the loader's generator (the workers' base
  seed). Nothing is drawn from the global generator when a pass starts.
- each batch carries a seed derived from ``(seed, epoch, batch)``; the fetch
  runs under it (torch, ``random`` and NumPy global generators), so a random
  augmentation draws the same numbers whichever worker fetches the batch and
  whether or not the process was restarted mid-epoch.

The first ``iter()`` after ``load_state_dict`` continues the saved pass at
the next batch; every other ``iter()`` starts the next pass, as a DataLoader's
does. The loader is adapted in place, not replaced: it stays the object the
loop iterates (its class becomes a subclass with the position), and iterates
a shallow copy of itself whose index sampler (:class:`PassBatches`) yields the
remaining batches and whose dataset (:class:`SeededFetch`) fetches each batch
under its derived seed. Its sampler, batch_sampler, generator and dataset are
left as they were; persistent workers, pinning, collation and worker_init_fn
are the user's.

Cost: a pass's indices come from the user's sampler as before (``randperm``
for a ``RandomSampler``: O(N) per pass); skipping k batches on restore costs
the sampler's work for k batches of indices (O(k * batch_size) integers) and
no dataset read or collation at all. The state is six integers.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ckpt_lesson.errors import CheckpointError, StateMismatchError

__all__ = ["ResumableLoader", "resumable"]

#: Written into every state dict; a later layout would get a new number and a reader of both.
FORMAT = 1


class ResumableLoader(DataLoader):
    """A DataLoader with a data position; :func:`resumable` turns a loader into one, in place.

    Never constructed directly: ``DataLoader.__init__`` ran when the user built the loader, and
    :func:`resumable` adds the position to that same object (so a loop keeps iterating the object
    it already holds, and ``{"loader": cl.resumable(train_loader)}`` is all a state needs).
    """

    _cl_seed: int
    _cl_seed_given: bool
    _cl_passes: PassBatches
    _cl_inner: DataLoader
    _cl_epoch: int
    _cl_consumed: int
    _cl_started: bool
    _cl_finished: bool
    _cl_resume_pending: bool

    # -- the position ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The pass in progress (0-based), or the next one once a pass has run to its end.

        A loop resumes with ``for epoch in range(loader.epoch, epochs)``: a save inside the pass
        resumes that pass, a save after it (scheduler stepped) starts the next.
        """
        return self._cl_epoch + 1 if self._cl_finished else self._cl_epoch

    @property
    def batches_consumed(self) -> int:
        """Batches of the current pass handed out so far."""
        return self._cl_consumed

    @property
    def seed(self) -> int:
        """Where every pass's randomness derives from (the saved one after a restore)."""
        return self._cl_seed

    def __iter__(self) -> Iterator[Any]:
        if self._cl_resume_pending:
            self._cl_resume_pending = False
        elif self._cl_started or self._cl_finished:
            self._cl_epoch, self._cl_consumed = self._cl_epoch + 1, 0
        self._cl_started, self._cl_finished = True, False
        epoch = self._cl_epoch
        self._cl_passes.start(seed=self._cl_seed, epoch=epoch, skip=self._cl_consumed)
        # The workers' base seed comes from the pass too: nothing is drawn from the global generator.
        self._cl_inner.generator = torch.Generator().manual_seed(derive_seed(self._cl_seed, epoch, "workers"))
        return self._run(iter(self._cl_inner), epoch)

    def _run(self, batches: Iterator[Any], epoch: int) -> Iterator[Any]:
        for batch in batches:
            if self._cl_epoch != epoch:
                return  # a newer pass started: this iterator is stale
            self._cl_consumed += 1  # counted when handed out: a save after this batch skips it
            yield batch
        if self._cl_epoch == epoch:
            self._cl_finished = True

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The position as plain ints (a fresh dict; loads under ``weights_only=True``).

        Example:
            >>> loader = resumable(DataLoader(range(10), batch_size=4, shuffle=True), seed=1)
            >>> sorted(loader.state_dict())
            ['batches', 'consumed', 'epoch', 'finished', 'format', 'seed']
        """
        return {
            "format": FORMAT,
            "seed": self._cl_seed,
            "epoch": self._cl_epoch,
            "consumed": self._cl_consumed,
            "finished": int(self._cl_finished),
            "batches": len(self),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next ``iter()`` yields the saved pass's remaining batches.

        Args:
            state: A dict from :meth:`state_dict` (a restore passes it; the saved seed is adopted).

        Raises:
            StateMismatchError: The state is malformed, from a loader with another number of
                batches per pass, or from another seed than the ``seed=`` given here.
        """
        keys = ("format", "seed", "epoch", "consumed", "finished", "batches")
        if not isinstance(state, dict) or any(type(state.get(k)) is not int for k in keys):
            raise StateMismatchError(
                f"data position: malformed state (needs int {', '.join(keys)}); it was not saved by "
                "cl.resumable's loader."
            )
        if state["format"] != FORMAT:
            raise StateMismatchError(
                f"data position: format {state['format']} is not {FORMAT}; it was saved by another "
                "version of ckpt_lesson: resume with that version."
            )
        if state["batches"] != len(self):
            raise StateMismatchError(
                f"data position: the save's loader had {state['batches']} batches per epoch, this one has "
                f"{len(self)}; build the loader with the saving run's dataset, batch_size, drop_last "
                "and sampler."
            )
        if not 0 <= state["consumed"] <= state["batches"] or state["epoch"] < 0:
            raise StateMismatchError(f"data position: epoch/consumed out of range in {state}.")
        if self._cl_seed_given and state["seed"] != self._cl_seed:
            raise StateMismatchError(
                f"data position: the save's seed is {state['seed']}, but seed={self._cl_seed} was given; "
                "pass the saving run's seed (or leave seed= out: the saved one is used)."
            )
        self._cl_seed = state["seed"]
        self._cl_epoch, self._cl_consumed = state["epoch"], state["consumed"]
        self._cl_finished = bool(state["finished"])
        self._cl_started = True
        self._cl_resume_pending = not self._cl_finished

    def __repr__(self) -> str:
        where = f"epoch {self._cl_epoch}, batch {self._cl_consumed}"
        return f"<resumable {type(self).__name__}, seed {self._cl_seed}, at {where}>"


#: DataLoader subclass -> its resumable subclass (a user's loader class keeps its own methods).
_CLASSES: dict[type, type] = {DataLoader: ResumableLoader}


def _adopt(loader: DataLoader, seed: int | None) -> ResumableLoader:
    """Give ``loader`` its position, in place: state first, then the class (nothing half-done)."""
    given = loader.generator
    index_sampler = loader.batch_sampler
    owners = [loader.sampler, index_sampler, getattr(index_sampler, "sampler", None)]
    unique = [o for i, o in enumerate(owners) if o is not None and all(o is not p for p in owners[:i])]
    passes = PassBatches(index_sampler, generator_owners=unique, length=len(loader))
    # A shallow copy, iterated in the loader's place: its index sampler yields the remaining
    # batches and its dataset fetches each under the batch's seed. DataLoader refuses setattr
    # for these names after __init__, so they go into the copy's __dict__.
    inner = copy.copy(loader)
    inner.__dict__.update(batch_sampler=passes, dataset=SeededFetch(loader.dataset), _iterator=None)
    chosen = seed if seed is not None else given.initial_seed() if given else torch.initial_seed()
    vars(loader).update(
        _cl_seed=int(chosen), _cl_seed_given=seed is not None, _cl_passes=passes, _cl_inner=inner,
        _cl_epoch=0, _cl_consumed=0, _cl_started=False, _cl_finished=False, _cl_resume_pending=False,
    )  # fmt: skip
    cls = type(loader)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Resumable{cls.__name__}", (ResumableLoader, cls), {})
    loader.__class__ = _CLASSES[cls]
    return loader  # type: ignore[return-value]


def resumable(loader: DataLoader, *, seed: int | None = None) -> ResumableLoader:
    """Give a plain DataLoader a data position, so a run killed mid-epoch resumes exactly.

    The loader itself gains the position (the same object comes back), so it goes into the state
    like any part: ``{"loader": cl.resumable(train_loader)}``. Every pass's shuffle, worker seeds
    and per-batch augmentation seeds derive from ``(seed, epoch)``.

    Args:
        loader: A ``torch.utils.data.DataLoader`` over a map-style dataset (any sampler, a
            ``batch_sampler``, ``DistributedSampler``, ``drop_last``, ``num_workers``, a
            ``generator``). Its sampler, generator and dataset are not changed.
        seed: Where every pass's randomness derives from. Default: the loader's generator's
            ``initial_seed()``, else ``torch.initial_seed()`` (so ``torch.manual_seed(s)`` sets
            it). A restore uses the saved seed.

    Returns:
        ``loader``, now a :class:`ResumableLoader`: ``state_dict()``/``load_state_dict()``,
        ``.epoch`` (where a resumed epoch loop starts), ``.batches_consumed``, ``.seed``.
        Called again on it, the same loader.

    Raises:
        CheckpointError: An ``IterableDataset`` (no indices to skip to), ``batch_size=None``,
            a loader that already has ``state_dict()`` (a ``StatefulDataLoader``: use it as is),
            or another ``seed=`` for a loader already resumable.

    Example:
        >>> loader = DataLoader(dataset, batch_size=64, shuffle=True)  # doctest: +SKIP
        >>> state = {"model": model, "optimizer": opt, "loader": cl.resumable(loader)}  # doctest: +SKIP
        >>> restored = mgr.restore_latest(state)  # doctest: +SKIP
        >>> for epoch in range(loader.epoch, epochs):  # doctest: +SKIP
        ...     for x, y in loader: ...
    """
    if isinstance(loader, ResumableLoader):
        if seed is not None and seed != loader.seed:
            raise CheckpointError(
                f"cl.resumable: the loader already derives from seed {loader.seed}, not {seed}."
            )
        return loader
    if callable(getattr(loader, "state_dict", None)):
        raise CheckpointError(
            f"cl.resumable: {type(loader).__name__} already saves its own position (it has "
            "state_dict()); put it in the state as it is."
        )
    if not isinstance(loader, DataLoader):
        raise CheckpointError(
            f"cl.resumable: expected a torch.utils.data.DataLoader, got {type(loader).__name__}."
        )
    if isinstance(loader.dataset, IterableDataset):
        raise CheckpointError(
            f"cl.resumable: {type(loader.dataset).__name__} is an IterableDataset: it has no indices to "
            "skip to, so a mid-epoch resume cannot be exact from the loader alone. It needs a position "
            "of its own: give the dataset state_dict()/load_state_dict() and use torchdata's "
            "StatefulDataLoader (saved as a part as it is), or make it a map-style Dataset "
            "(__getitem__/__len__)."
        )
    if loader.batch_sampler is None:
        raise CheckpointError(
            "cl.resumable: batch_size=None (no automatic batching) is not supported; give the "
            "DataLoader a batch_size or a batch_sampler."
        )
    return _adopt(loader, seed)


# -- one pass: reproducible from (seed, epoch), started at any batch ------------------------------


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``parts`` (the same in every process and on every machine).

    Example:
        >>> derive_seed(7, 0) == derive_seed(7, 0) != derive_seed(7, 1)
        True
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


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
        shuffle = torch.Generator().manual_seed(derive_seed(seed, epoch, "sampler"))
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
