"""A tiny, fully seeded training setup that makes checkpoint bugs visible.

Small enough to train in milliseconds on a laptop CPU, but with every
ingredient that a careless resume gets wrong:

* dropout, so the torch RNG matters;
* input jitter drawn from NumPy's global generator, so NumPy's RNG matters;
* AdamW, whose moment estimates are state (a fresh optimizer changes the run);
* a cosine schedule, whose position is state;
* epochs with a shuffled order, so "where in the epoch" is state.

The batch order of an epoch is a permutation derived from ``(seed, epoch)``
alone. Resuming at batch ``b`` therefore costs one ``randperm`` and a slice:
O(1) in ``b``, instead of replaying ``b`` batches through the data loader.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ckpt_lesson.files.checkpoint import TrainState

__all__ = [
    "EpochOrderCache",
    "StepRecord",
    "SyntheticRegression",
    "batch_loss",
    "batch_sample_ids",
    "epoch_order",
    "make_model",
    "make_optimizer_and_scheduler",
    "next_batch_ids",
    "seed_everything",
    "train",
    "train_step",
]

JITTER_STD = 0.01


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) from one integer.

    Also pins torch to one intra-op thread: reductions split over a different
    number of threads can round differently, and the lesson's claim is
    bit-for-bit equality.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.set_num_threads(1)


def make_model(in_dim: int = 8, hidden: int = 32, out_dim: int = 1, dropout: float = 0.1) -> nn.Module:
    """A two-hidden-layer MLP with dropout (so the RNG matters)."""
    return nn.Sequential(
        nn.Linear(in_dim, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, out_dim),
    )


def make_optimizer_and_scheduler(
    model: nn.Module, lr: float = 1e-2, total_steps: int = 100
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.CosineAnnealingLR]:
    """AdamW with weight decay and a cosine schedule over ``total_steps``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps))
    return optimizer, scheduler


class SyntheticRegression:
    """A learnable regression task: ``y = teacher(x) + noise`` with a fixed teacher.

    The data is made with integer arithmetic only (``torch.randint``, integer sums and
    ``clamp``), then divided by powers of two that every value survives exactly in
    float32. Float products (and ``randn``, ``tanh``) round differently on different
    CPUs (AVX2, AVX-512, a plain build), so data made from them, and its
    :meth:`fingerprint` that the resume contract compares, would change with the
    machine; these bytes are the same on every one.

    Args:
        n: Number of samples.
        in_dim: Input features.
        seed: Generates the data; the same seed gives the same bytes on every machine.
        out_dim: Targets per sample (``1`` gives the course's data, byte for byte).
    """

    def __init__(self, n: int = 256, in_dim: int = 8, seed: int = 0, *, out_dim: int = 1) -> None:
        g = torch.Generator().manual_seed(10_000 + seed)
        # Inputs on a grid of 1/32 in [-2, 2); teacher weights small integers.
        xi = torch.randint(-64, 64, (n, in_dim), generator=g)
        w1 = torch.randint(-16, 17, (in_dim, 16), generator=g)
        w2 = torch.randint(-8, 9, (16, out_dim), generator=g)
        # Hidden layer: x @ w1 scaled to about unit spread (x is in 1/32, so /32 * 1/32 = /1024),
        # then a hard tanh (clamp at +-1.0, i.e. +-1024): exact in int64, whatever the CPU.
        hidden = (xi.unsqueeze(2) * w1.unsqueeze(0)).sum(dim=1).clamp(-1024, 1024)
        yi = (hidden.unsqueeze(2) * w2.unsqueeze(0)).sum(dim=1)  # in units of 1/(1024*16)
        yi = yi + torch.randint(-1400, 1401, (n, out_dim), generator=g)  # noise of std ~0.05
        # |yi| < 16*1024*8 + 1400 < 2**24: every value, and each quotient, is exact in float32.
        self.x = xi.to(torch.float32) / 32
        self.y = yi.to(torch.float32) / (1024 * 16)
        self.seed = seed

    def __len__(self) -> int:
        return self.x.shape[0]

    def fingerprint(self) -> str:
        """sha256 of the data's shapes and bytes: changes if any sample changes."""
        h = hashlib.sha256()
        for t in (self.x, self.y):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()


def epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The sample order of ``epoch``: a permutation that depends on ``(seed, epoch)`` only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def batch_sample_ids(seed: int, epoch: int, batch_in_epoch: int, n: int, batch_size: int) -> list[int]:
    """Sample ids of one batch, computed directly: O(1) fast-forward on resume."""
    order = epoch_order(seed, epoch, n)
    start = batch_in_epoch * batch_size
    return order[start : start + batch_size].tolist()


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step did: its number (1-based), loss and sample ids."""

    step: int
    loss: float
    sample_ids: tuple[int, ...]


def batch_loss(model: nn.Module, data: SyntheticRegression, ids: list[int]) -> torch.Tensor:
    """Forward pass on the samples ``ids`` with NumPy input jitter; returns the loss tensor.

    The single place where a batch meets the model, so every training loop
    (plain, accumulating) draws from the generators in the same order:
    NumPy's jitter first, then torch's dropout masks.
    """
    model.train()
    x = data.x[ids]
    jitter = np.random.normal(0.0, JITTER_STD, size=tuple(x.shape)).astype(np.float32)
    return nn.functional.mse_loss(model(x + torch.from_numpy(jitter)), data.y[ids])


def next_batch_ids(state: TrainState, data: SyntheticRegression, *, seed: int, batch_size: int) -> list[int]:
    """Roll ``state`` into the next epoch when this one is used up; return the next batch's ids."""
    if state.batch_in_epoch >= len(data) // batch_size:
        state.epoch += 1
        state.batch_in_epoch = 0
    return batch_sample_ids(seed, state.epoch, state.batch_in_epoch, len(data), batch_size)


class EpochOrderCache:
    """:func:`next_batch_ids` for a loop: the epoch's permutation is drawn once per epoch.

    ``next_batch_ids`` recomputes the whole permutation for every batch: O(n)
    per step, 10 ms at a million samples. A loop keeps the current epoch's
    order and slices it; since the order depends on ``(seed, epoch)`` alone
    (its own generator, not the global one), the batches are bit-identical.

    Example:
        >>> data, cache = SyntheticRegression(64), EpochOrderCache(seed=0, n=64)
        >>> cache.next_ids(TrainState(), 16) == next_batch_ids(TrainState(), data, seed=0, batch_size=16)
        True
    """

    def __init__(self, seed: int, n: int) -> None:
        self.seed, self.n = seed, n
        self._epoch: int | None = None
        self._order: torch.Tensor | None = None

    def next_ids(self, state: Any, batch_size: int) -> list[int]:
        """Roll ``state`` into the next epoch when this one is used up; return the next batch's ids."""
        if state.batch_in_epoch >= self.n // batch_size:
            state.epoch += 1
            state.batch_in_epoch = 0
        if self._order is None or self._epoch != state.epoch:  # checked every step: callers may move state
            self._order, self._epoch = epoch_order(self.seed, state.epoch, self.n), state.epoch
        start = state.batch_in_epoch * batch_size
        return self._order[start : start + batch_size].tolist()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data: SyntheticRegression,
    ids: list[int],
) -> float:
    """One optimizer step on the samples ``ids``; returns the loss."""
    loss = batch_loss(model, data, ids)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return float(loss.detach())


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainState,
    data: SyntheticRegression,
    *,
    until_step: int,
    seed: int,
    batch_size: int = 16,
    after_step: Callable[[TrainState, StepRecord], bool | None] | None = None,
) -> list[StepRecord]:
    """Train from ``state`` up to ``until_step``, updating ``state`` in place.

    Args:
        model, optimizer, scheduler: The live training objects.
        state: Counters to continue from; ``state.step`` steps are already done.
        data: The dataset.
        until_step: Stop once ``state.step`` reaches this.
        seed: The order seed (see :func:`epoch_order`).
        batch_size: Samples per step; a last partial batch is dropped.
        after_step: Called after every step with the updated state and the
            step's record; return ``True`` to stop early (e.g. to save and exit).

    Returns:
        The records of the steps taken in this call.

    Raises:
        ValueError: ``batch_size`` is below 1 or larger than the dataset.

    Example:
        >>> seed_everything(0)
        >>> data, model = SyntheticRegression(n=64), make_model()
        >>> opt, sched = make_optimizer_and_scheduler(model)
        >>> len(train(model, opt, sched, TrainState(), data, until_step=3, seed=0))
        3
    """
    per_epoch = len(data) // batch_size if batch_size > 0 else 0
    if per_epoch == 0:
        # Without this check an epoch would hold no batch and every step would
        # train on an empty slice (a NaN loss) while the epoch counter raced ahead.
        raise ValueError(f"batch_size must be between 1 and len(data)={len(data)}, got {batch_size}.")
    records: list[StepRecord] = []
    orders = EpochOrderCache(seed, len(data))
    while state.step < until_step:
        ids = orders.next_ids(state, batch_size)
        loss = train_step(model, optimizer, scheduler, data, ids)
        state.step += 1
        state.batch_in_epoch += 1
        state.losses.append(loss)
        record = StepRecord(state.step, loss, tuple(ids))
        records.append(record)
        if after_step is not None and after_step(state, record):
            break
    return records
