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

The policies are pure (lists of ints in, lists of ints out) so that they can
be tested exhaustively, and the manager applies them only *after* the new save
is published and verified.

Off the training thread. Deleting an old save is slow (an ``rmtree`` of
gigabytes: 0.15 s for 192 MB here) and re-checking the kept ones reads them,
yet neither changes the save just published. So :class:`BackgroundRetention`
runs each retention pass (:func:`~ckpt_lesson.runs.reverify.retention_pass`)
on a thread of its own, the way Orbax deletes old checkpoints in the
background, and ``save()`` returns as soon as its save is published. The rules
that keep this safe:

* **At most one pass in flight.** The next :meth:`~BackgroundRetention.submit`
  (the next save) waits for the previous pass first: a deleter that falls
  behind slows training down rather than letting old saves pile up on a full disk.
* **The pass owns the manager's memory** (:class:`~ckpt_lesson.runs.reverify.KnownGood`).
  Every caller that reads or changes it first waits for the pass (:meth:`~BackgroundRetention.wait`).
* **A crash mid-delete is harmless.** Each doomed save is renamed aside to
  ``.deleting-...`` before its files go (see :func:`~ckpt_lesson.runs.commit.delete_save`);
  a kill leaves either the save, still a good save, or that leftover, which the
  next manager removes when it opens the run directory.
* **Errors are logged, never raised**: the save is already durable.

The scrub (``scrub_bytes_per_s``) spends idle time after a pass hashing the
other kept saves, least recently hashed first, at no more than that many bytes
per second on average, so bit rot is found before a deletion leans on it. It
stops as soon as a new pass is wanted.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.runs.layout import inspect_save, step_dir_name
from ckpt_lesson.runs.reverify import Emit, KnownGood, RetentionPolicy, retention_pass
from ckpt_lesson.short_repr import short_repr

__all__ = ["BackgroundRetention", "KeepBest", "KeepLastK", "RetentionPolicy", "keep_last_k"]

log = logging.getLogger("ckpt_lesson.runs.manager")


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


# Live workers, so that interpreter exit lets a pass finish (and stops a scrub) instead of
# killing a daemon thread halfway through an rmtree.
_LIVE: weakref.WeakSet[BackgroundRetention] = weakref.WeakSet()


@atexit.register
def _finish_all() -> None:  # pragma: no cover - runs at interpreter exit
    for worker in list(_LIVE):
        worker.wait()


class BackgroundRetention:
    """Run retention passes on a background thread, one at a time.

    Args:
        run_dir: The run directory.
        policy: ``to_delete(steps, verified)``, e.g. ``KeepLastK(3)``.
        emit: Event hook (called on the background thread): ``retention_delete``
            before each deletion, ``retention_renamed`` once it is renamed aside,
            ``scrubbed`` (info ``step``, ``ok``) after the scrub hashed a save.
        after_pass: Called on the background thread after each pass (cleanup of
            stale staging folders), errors logged.
        scrub_bytes_per_s: Rate of the idle-time scrub; ``None`` (default) for none.
        background: ``False`` runs every pass on the caller's thread (the old behaviour).

    Example:
        >>> worker = BackgroundRetention(run_dir, KeepLastK(2), emit=no_events)  # doctest: +SKIP
        >>> worker.submit(40, checked=True)  # returns at once; deletion goes on behind  # doctest: +SKIP
        >>> worker.wait()  # doctest: +SKIP
    """

    def __init__(
        self,
        run_dir: Path,
        policy: RetentionPolicy,
        *,
        emit: Emit,
        after_pass: Callable[[], object] | None = None,
        scrub_bytes_per_s: float | None = None,
        background: bool = True,
    ) -> None:
        self.run_dir, self.policy, self.emit = run_dir, policy, emit
        self.after_pass, self.scrub_bytes_per_s, self.background = after_pass, scrub_bytes_per_s, background
        self.known = KnownGood()
        #: Steps the passes deleted, ascending (tests and reports read it).
        self.deleted: list[int] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # submit() may come from an AsyncCheckpointer's writer thread while the training thread
        # waits (restore, close): one at a time. Event hooks run on the pass's thread and must
        # not call back into the manager (they would wait for themselves).
        self._gate = threading.Lock()
        _LIVE.add(self)

    def submit(self, step: int, *, checked: bool) -> None:
        """Start the pass that follows the publish of ``step``; waits for the previous pass first.

        Args:
            step: The save just published.
            checked: It passed its write-time check; ``False`` makes the pass hash it first.
        """
        fresh, unchecked = ((step,), ()) if checked else ((), (step,))
        with self._gate:
            self._join()
            if not self.background:
                self._run(fresh, unchecked, scrub=False)
                return
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, args=(fresh, unchecked, True), name="ckpt-retention", daemon=True
            )
            self._thread.start()

    def run_now(self) -> list[int]:
        """Wait for the pass in flight, then run one more on this thread; returns what it deleted."""
        with self._gate:
            self._join()
            return self._pass((), ())

    def wait(self) -> None:
        """Block until the pass in flight (if any) is done; a scrub in progress stops early."""
        with self._gate:
            self._join()

    def _join(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        if thread is not threading.current_thread():
            thread.join()
        self._thread = None

    # ------------------------------------------------------------------ the background side

    def _pass(self, fresh: tuple[int, ...], unchecked: tuple[int, ...]) -> list[int]:
        deleted = retention_pass(
            self.run_dir,
            self.policy,
            self.known,
            emit=self.emit,
            fresh=fresh,
            unchecked=unchecked,
            on_renamed=lambda step, aside: self.emit("retention_renamed", step=step, path=str(aside)),
        )
        self.deleted.extend(deleted)
        return deleted

    def _run(self, fresh: tuple[int, ...], unchecked: tuple[int, ...], scrub: bool) -> None:
        try:
            self._pass(fresh, unchecked)
        except Exception:  # the save is durable; a failed purge must not turn it into a failure
            name = step_dir_name((fresh or unchecked or (0,))[0])
            log.exception("retention after %s failed; the save itself is published", name)
        if self.after_pass is not None:
            try:
                self.after_pass()
            except Exception:
                log.exception("cleanup after a retention pass failed; the next one retries")
        if scrub and self.scrub_bytes_per_s:
            self._scrub(float(self.scrub_bytes_per_s))

    def _scrub(self, rate: float) -> None:
        """Hash the kept saves least recently hashed first, pausing to stay under ``rate`` bytes/s."""
        known = self.known
        order = sorted(known.verified, key=lambda s: (known.hashed_at.get(s, -1), s))
        for step in order:
            if self._stop.is_set():
                return
            folder = self.run_dir / step_dir_name(step)
            try:
                result, manifest = inspect_save(folder)
                problem = None if result.ok else result.reason
            except Exception as exc:  # an unknown schema, a vanished folder
                manifest, problem = None, str(exc)
            size = sum(p["bytes"] for p in manifest["parts"]) if manifest else 0
            self.emit("scrubbed", step=step, ok=not problem)
            if problem:
                log.warning(
                    "scrub: %s no longer verifies (%s); not counting it as good", folder.name, problem
                )
                known.forget([step])
            else:
                known.hashed_at[step] = known.passes
            if self._stop.wait(size / rate):
                return
