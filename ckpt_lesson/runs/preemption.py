"""Preemption: turn "the machine is going away" into one last clean save.

Spot and preemptible machines are taken back with a warning: a ``SIGTERM``
(or a metadata notice that a supervisor turns into one), then a grace period
(about 30 s on GCP spot, a best-effort two minutes on AWS spot), then
``SIGKILL``. The safe reaction has three rules:

1. **The signal handler only sets a flag** (a *second* signal goes to the
   previous handler, so Ctrl-C twice still stops a hung save). A handler runs between two
   bytecodes of whatever the main thread was doing, possibly in the middle of
   ``optimizer.step()`` or of another save. Saving from inside it would write
   half-updated state. So :class:`PreemptionHandler` records the request and
   returns; the training loop looks at the flag after each *complete* step.
2. **Save, then exit with a distinct code.** :data:`PREEMPTED_EXIT_CODE` is
   75, ``EX_TEMPFAIL`` from BSD's ``sysexits.h`` ("temporary failure, the
   user is invited to retry"). A supervisor (a job scheduler, a shell loop,
   Kubernetes) can then tell "preempted, saved, resubmit me" from success (0),
   a crash (1) or a usage error (2), and resubmit only the first kind.
3. **Know whether the save fits the grace period.** A save that takes 45 s
   cannot finish inside a 30 s notice; the kill lands mid-write and the run
   falls back to an older save. :meth:`PreemptionHandler.timed_save` measures
   every save and warns (logging, and in its returned record) when it would
   not fit, ideally during ordinary periodic saves, long before the real
   notice arrives.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any, Generic, TypeVar

from ckpt_lesson.errors import CheckpointError

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "PreemptionHandler",
    "TimedSave",
]

log = logging.getLogger(__name__)

#: ``EX_TEMPFAIL`` (sysexits.h): "temporary failure; retry later". The process
#: saved its state because it was asked to stop; resubmitting it resumes.
PREEMPTED_EXIT_CODE = 75

T = TypeVar("T")


@dataclass(frozen=True)
class TimedSave(Generic[T]):
    """What one measured save did.

    Attributes:
        result: What the save function returned (e.g. the published path).
        save_seconds: Wall time of the save itself.
        since_signal_seconds: Time from the preemption signal to the end of the
            save, or ``None`` when no signal had arrived (a periodic save).
        fits_grace: Whether the save ended inside the grace period (after a
            signal), or would have (a periodic save no longer than the grace).
        warning: The warning that was logged, or ``None``.
    """

    result: T
    save_seconds: float
    since_signal_seconds: float | None
    fits_grace: bool
    warning: str | None = None


class PreemptionHandler:
    """Context manager that turns termination signals into a flag.

    Args:
        signals: Signals to catch. ``SIGTERM`` is what schedulers and cloud
            agents send; ``SIGINT`` makes Ctrl-C save too.
        grace_seconds: Time between the signal and the hard kill that the
            platform promises; saves are measured against it.
        clock: Monotonic clock (injectable for tests).

    Raises:
        CheckpointError: ``grace_seconds <= 0``, or entered outside the main
            thread (Python only delivers signals to the main thread).

    Example:
        >>> with PreemptionHandler(grace_seconds=30.0) as pre:  # doctest: +SKIP
        ...     for step in range(...):
        ...         train_one_step()
        ...         if pre.requested:
        ...             pre.timed_save(lambda: save(...))
        ...             sys.exit(PREEMPTED_EXIT_CODE)
    """

    def __init__(
        self,
        signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT),
        grace_seconds: float = 30.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not grace_seconds > 0:
            raise CheckpointError(f"grace_seconds must be > 0, got {grace_seconds!r}.")
        self.signals = tuple(signals)
        self.grace_seconds = float(grace_seconds)
        self._clock = clock
        self._old: dict[int, Any] = {}
        self.signal_received: int | None = None
        self.received_at: float | None = None

    @property
    def requested(self) -> bool:
        """True once a caught signal (or :meth:`request`) asked the run to stop."""
        return self.signal_received is not None

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop without a signal (e.g. from a cloud-notice poller)."""
        if self.signal_received is None:
            self.signal_received = int(signum)
            self.received_at = self._clock()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_received is not None:
            # A second signal: the operator insists (a save that hangs must stay killable).
            # Hand this signal back to its previous handler, and deliver it there.
            old = self._old.get(signum, signal.SIG_DFL)
            signal.signal(signum, old)
            if callable(old):
                old(signum, frame)
            elif old == signal.SIG_DFL:
                os.kill(os.getpid(), signum)
            return
        # Only record: the interrupted code may be mid-step or mid-save.
        self.request(signum)

    def __enter__(self) -> PreemptionHandler:
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError("PreemptionHandler must be entered in the main thread; signals go there.")
        for sig in self.signals:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def remaining_grace(self) -> float | None:
        """Seconds left before the expected hard kill, or ``None`` with no signal yet."""
        if self.received_at is None:
            return None
        return self.grace_seconds - (self._clock() - self.received_at)

    def timed_save(self, save: Callable[[], T]) -> TimedSave[T]:
        """Run ``save()``, measure it, and warn when it does not fit the grace period.

        Call it for periodic saves too: a warning then arrives while there is
        still time to make saves faster (fewer bytes, sharded, async) or to
        ask for a longer notice.

        Returns:
            A :class:`TimedSave` with the save's result and timings.
        """
        start = self._clock()
        result = save()
        end = self._clock()
        seconds = end - start
        since = None if self.received_at is None else end - self.received_at
        fits = (since if since is not None else seconds) <= self.grace_seconds
        warning = None
        if not fits:
            if since is not None:
                warning = (
                    f"the preemption save ended {since:.1f} s after the signal, past the "
                    f"{self.grace_seconds:.1f} s grace period; on a real preemption the kill "
                    "would land mid-save and the run would fall back to an older save."
                )
            else:
                warning = (
                    f"a save took {seconds:.1f} s, longer than the {self.grace_seconds:.1f} s grace "
                    "period; a preemption save would not finish. Make saves smaller or faster."
                )
            log.warning(warning)
        return TimedSave(result, seconds, since, fits, warning)
