"""Retention: which old checkpoints may be deleted, decided without touching disk.

Keeping only the last few saves bounds disk use, but a careless purge is how a
run ends up with *no* usable checkpoint. The two classic mistakes:

* deleting the oldest save *before* the new one is written (HF Accelerate's
  ``total_limit`` does this): a crash during the new save leaves nothing;
* counting saves instead of *good* saves: three corrupt saves "kept" and the
  one good save deleted.

So the rule here only counts saves that were verified (their manifest's parts
hash correctly). It finds the ``k`` newest verified steps and deletes what is
older than the oldest of them. With fewer than ``k`` verified saves it deletes
nothing at all. Consequences worth saying out loud:

* the newest verified save is never deleted;
* if one good save existed before a purge, one still exists after it;
* a corrupt or unverified save *newer* than the kept ones is left alone (it is
  evidence, and it costs a scan, not a restore).

Everything here is pure (lists of ints in, lists of ints out) so that it can be
tested exhaustively, and the manager calls it only *after* the new save is
published and verified.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.short_repr import short_repr

__all__ = ["KeepBest", "KeepLastK", "RetentionPolicy", "keep_last_k"]


class RetentionPolicy(Protocol):
    """Anything with ``to_delete(steps, verified) -> list[int]`` (ascending)."""

    def to_delete(self, steps: Sequence[int], verified: Collection[int]) -> list[int]: ...


def _check_k(k: int, name: str = "k") -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise CheckpointError(f"{name} must be an int >= 1 (keep at least one good save), got {k!r}.")


def keep_last_k(steps: Sequence[int], verified: Collection[int], k: int) -> list[int]:
    """Return the steps to delete so that the ``k`` newest verified saves remain.

    Args:
        steps: Every published step (any order; duplicates are ignored).
        verified: The steps known to verify. Steps not in ``steps`` are ignored.
        k: How many verified saves to keep (>= 1).

    Returns:
        Ascending steps to delete: empty when fewer than ``k`` steps are
        verified, otherwise every step (verified or not) older than the oldest
        of the ``k`` newest verified steps.

    Raises:
        CheckpointError: ``k`` is not an int >= 1.

    Example:
        >>> keep_last_k([10, 20, 30, 40], verified={20, 30, 40}, k=2)
        [10, 20]
        >>> keep_last_k([10, 20, 30, 40], verified={40}, k=2)  # too few good saves: keep all
        []
    """
    _check_k(k)
    present = sorted(set(steps))
    good = [s for s in present if s in verified]
    if len(good) < k:
        return []
    oldest_kept = good[-k]
    return [s for s in present if s < oldest_kept]


@dataclass(frozen=True)
class KeepLastK:
    """Policy object for :func:`keep_last_k`.

    Example:
        >>> KeepLastK(2).to_delete([1, 2, 3], verified=[1, 2, 3])
        [1]
    """

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    k: int

    def __post_init__(self) -> None:
        _check_k(self.k)

    def to_delete(self, steps: Sequence[int], verified: Collection[int]) -> list[int]:
        """Ascending steps to delete; see :func:`keep_last_k`."""
        return keep_last_k(steps, verified, self.k)


@dataclass(frozen=True)
class KeepBest:
    """Keep the last ``keep_last`` verified saves *and* the ``k_best`` best by a metric.

    A run that overfits late still wants its best-validation checkpoint, even
    when it is much older than the last few. This policy deletes what
    :func:`keep_last_k` would delete, except the ``k_best`` verified steps with
    the best metric (lowest when ``mode="min"``, highest for ``"max"``). Steps
    without a metric (missing, ``None``, NaN, or not a number) are never "best".
    Ties go to the older step (it came first).

    Args:
        metric_by_step: step -> metric value, e.g. validation loss. A live
            dict may keep growing; it is read at every call.
        k_best: How many best saves to protect (>= 1).
        keep_last: How many newest verified saves to keep (>= 1).
        mode: ``"min"`` or ``"max"``.

    Example:
        >>> policy = KeepBest({1: 0.5, 2: 0.1, 3: 0.4, 4: 0.3}, k_best=1, keep_last=1)
        >>> policy.to_delete([1, 2, 3, 4], verified={1, 2, 3, 4})
        [1, 3]
    """

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    metric_by_step: Mapping[int, float] = field(hash=False)
    k_best: int = 1
    keep_last: int = 1
    mode: str = "min"

    def __post_init__(self) -> None:
        _check_k(self.k_best, "k_best")
        _check_k(self.keep_last, "keep_last")
        if self.mode not in ("min", "max"):
            raise CheckpointError(f"mode must be 'min' or 'max', got {self.mode!r}.")

    def best_steps(self, verified: Collection[int]) -> list[int]:
        """The ``k_best`` verified steps with the best metric, ascending."""
        # NaN, None or a non-number is "no metric": NaN compares false with everything, so ranking
        # it would make the true best look no better than a diverged step (and None cannot rank).
        scores = {s: _metric(self.metric_by_step.get(s)) for s in set(verified)}
        scored = [s for s, m in scores.items() if m is not None]
        sign = 1.0 if self.mode == "min" else -1.0
        ranked = sorted(scored, key=lambda s: (sign * scores[s], s))  # type: ignore[operator]
        return sorted(ranked[: self.k_best])

    def to_delete(self, steps: Sequence[int], verified: Collection[int]) -> list[int]:
        """Ascending steps to delete: keep-last's list minus the protected best."""
        present = set(steps)
        protected = set(self.best_steps([s for s in verified if s in present]))
        return [s for s in keep_last_k(steps, verified, self.keep_last) if s not in protected]


def _metric(value: object) -> float | None:
    """The metric as a finite-or-infinite float, or ``None`` when there is none to rank."""
    if value is None or isinstance(value, (bool, str, bytes)):
        return None
    if not isinstance(value, (int, float)):
        try:
            value = float(value)  # type: ignore[arg-type]  # NumPy and 0-d tensor scalars
        except (TypeError, ValueError, RuntimeError):
            return None
    value = float(value)
    return None if math.isnan(value) else value
