"""Cadence: when to save, by step count, by wall-clock time, or both.

Saving every N steps is simple and reproducible, but the time between saves
then depends on how fast steps are, and a slow phase can leave an hour of work
unprotected. Saving every T seconds bounds the work lost to a crash (at most
about T seconds plus one save) whatever the step speed. Many runs want both.

How to pick T: Young (1974) gives ``T = sqrt(2 * save_seconds * MTBF)`` for a
save that takes ``save_seconds`` and a mean time between failures ``MTBF``.
Saves of 2 s on a machine that fails about once a day (86,400 s) give
``sqrt(2 * 2 * 86400)`` = about 590 s, one save every ten minutes.

The decision is a pure function of (step, now, last save) so it can be tested
with a fake clock and no sleeping. :class:`SaveCadence` wraps it with the
bookkeeping, and takes the clock as an argument (``time.monotonic`` by
default: wall-clock time can jump when NTP corrects it; a monotonic clock
cannot go backwards).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ckpt_lesson.errors import CheckpointError

__all__ = ["SaveCadence", "should_save", "validate_cadence"]


def validate_cadence(every_steps: int | None, every_seconds: float | None) -> None:
    """Raise :class:`CheckpointError` unless the cadence settings make sense.

    Rules: ``every_steps`` is ``None`` or an int >= 1; ``every_seconds`` is
    ``None`` or a number > 0; at least one of them is set (a manager that
    never saves protects nothing).
    """
    if every_steps is not None and (
        isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1
    ):
        raise CheckpointError(f"every_steps must be an int >= 1 or None, got {every_steps!r}.")
    if every_seconds is not None and (
        isinstance(every_seconds, bool)
        or not isinstance(every_seconds, (int, float))
        or not every_seconds > 0
        or every_seconds == float("inf")
    ):
        raise CheckpointError(f"every_seconds must be a finite number > 0 or None, got {every_seconds!r}.")
    if every_steps is None and every_seconds is None:
        raise CheckpointError(
            "set every_steps, every_seconds or both; with neither, nothing would ever be saved."
        )


def should_save(
    step: int,
    now: float,
    *,
    last_step: int | None,
    last_time: float | None,
    every_steps: int | None,
    every_seconds: float | None,
) -> bool:
    """Decide whether the state after ``step`` completed steps is due for a save.

    Args:
        step: Optimizer steps completed so far.
        now: Current time on the same clock as ``last_time``.
        last_step: Step of the last save, or ``None`` if there was none.
        last_time: Time of the last save, or when saving started (``None``:
            no time reference, so the time rule cannot fire yet).
        every_steps: Save when ``step`` is a multiple of this (``None``: off).
        every_seconds: Save when this many seconds have passed since
            ``last_time`` (``None``: off).

    Returns:
        ``True`` if either rule fires; never for step 0 (nothing to protect
        yet) and never twice for the same step.

    Example:
        >>> should_save(20, 0.0, last_step=10, last_time=0.0, every_steps=10, every_seconds=None)
        True
        >>> should_save(7, 65.0, last_step=5, last_time=0.0, every_steps=None, every_seconds=60)
        True
        >>> should_save(7, 65.0, last_step=7, last_time=0.0, every_steps=None, every_seconds=60)
        False
    """
    if step <= 0 or step == last_step:
        return False
    if every_steps is not None and step % every_steps == 0:
        return True
    return every_seconds is not None and last_time is not None and now - last_time >= every_seconds


class SaveCadence:
    """Stateful wrapper around :func:`should_save` with an injectable clock.

    The time rule counts from construction until the first save, then from
    each :meth:`mark_saved`.

    Args:
        every_steps: Save every this many steps (or ``None``).
        every_seconds: Save when this many seconds passed since the last save.
        clock: A function returning seconds; tests pass a fake one.

    Raises:
        CheckpointError: Invalid settings (see :func:`validate_cadence`).

    Example:
        >>> t = [0.0]
        >>> cadence = SaveCadence(every_seconds=60, clock=lambda: t[0])
        >>> cadence.should_save(3)
        False
        >>> t[0] = 61.0
        >>> cadence.should_save(4)
        True
    """

    def __init__(
        self,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        validate_cadence(every_steps, every_seconds)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.clock = clock
        self.last_step: int | None = None
        self.last_time: float = clock()

    def should_save(self, step: int) -> bool:
        """True if the state after ``step`` steps is due for a save now."""
        now = self.clock()
        if now < self.last_time:
            # A clock that went backwards (a wall clock passed in and corrected by NTP) would
            # hold the time rule off until it caught up again, an hour for a one-hour step.
            # Restart the interval from now instead: at most one interval late, never an hour.
            self.last_time = now
        return should_save(
            step,
            now,
            last_step=self.last_step,
            last_time=self.last_time,
            every_steps=self.every_steps,
            every_seconds=self.every_seconds,
        )

    def mark_saved(self, step: int) -> None:
        """Record that ``step`` was just saved (or restored): restarts the timer."""
        self.last_step = step
        self.last_time = self.clock()
