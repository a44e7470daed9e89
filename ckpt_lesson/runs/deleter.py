"""Retention off the training thread: one background pass per save, and an optional scrub.

Deleting an old save is slow (an ``rmtree`` of gigabytes: 0.15 s for 192 MB
here) and re-checking the kept ones reads them, yet neither changes the save
just published. So :class:`BackgroundRetention` runs each retention pass
(:func:`~ckpt_lesson.runs.reverify.retention_pass`) on a thread of its own,
the way Orbax deletes old checkpoints in the background, and ``save()``
returns as soon as its save is published.

The rules that keep this safe:

* **At most one pass in flight.** The next :meth:`submit` (the next save) waits
  for the previous pass first: a deleter that falls behind slows training
  down rather than letting old saves pile up on a full disk.
* **The pass owns the manager's memory** (:class:`~ckpt_lesson.runs.reverify.KnownGood`).
  Every caller that reads or changes it first waits for the pass (:meth:`wait`).
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
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

from ckpt_lesson.runs.layout import inspect_save, step_dir_name
from ckpt_lesson.runs.retention import RetentionPolicy
from ckpt_lesson.runs.reverify import Emit, KnownGood, retention_pass

__all__ = ["BackgroundRetention"]

log = logging.getLogger("ckpt_lesson.runs.manager")

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
