"""What checkpointing costs, what preemptible machines save, and how often to save.

Two questions decide whether a run on spot (preemptible) machines is a good
bet, and both are arithmetic; a third, whether a save is due now, follows:

1. **What does useful progress cost?** Every interruption throws away the
   steps since the last good save, and those steps are paid for twice. So the
   honest unit price divides everything billed (compute, saves, transfers) by
   the *unique accepted* steps, not by every step executed.
   :func:`cost_per_accepted_step` does that, and :func:`compare_spot` shows
   why "spot is half price" rarely means "half the bill".

2. **How often should we save?** Saving too often wastes time writing;
   saving too rarely wastes time redoing. For a save that takes ``delta``
   seconds and interruptions that arrive with mean time ``M`` between them,
   Young (1974) gives ``T = sqrt(2 * delta * M)`` to first order
   (:func:`young_interval`) and Daly (2006) a higher-order ``T`` (:func:`daly_interval`).
   Both assume interruptions arrive as a Poisson process (exponentially
   distributed gaps with mean ``M``, independent of each other and of the
   save schedule) and that every save costs the same ``delta``. ``T`` is the
   *compute* time between the end of one save and the start of the next.
   Daly's model also has a restart time ``R`` (relaunch + load), but it only
   multiplies the expected total time by ``exp(R/M)``: it changes how much an
   interruption costs, not where the optimum interval is. That is why ``R``
   appears in :func:`expected_wall_time` and not in :func:`daly_interval`.

   References: J. W. Young, "A first order approximation to the optimum
   checkpoint interval", CACM 17(9), 1974. J. T. Daly, "A higher order
   estimate of the optimum checkpoint interval for restart dumps", Future
   Generation Computer Systems 22(3), 2006.

3. **Is a save due now?** Saving every N steps is simple and reproducible, but
   the time between saves then depends on how fast steps are, and a slow phase
   can leave an hour of work unprotected. Saving every T seconds bounds the
   work lost to a crash (at most about T seconds plus one save) whatever the
   step speed. Many runs want both. Saves of 2 s on a machine that fails about
   once a day (86,400 s) give Young's ``sqrt(2 * 2 * 86400)`` = about 590 s,
   one save every ten minutes. The decision (:func:`should_save`) is a pure
   function of (step, now, last save) so that it can be tested with a fake
   clock and no sleeping. :class:`SaveCadence` wraps it with the bookkeeping,
   and takes the clock as an argument (``time.monotonic`` by default:
   wall-clock time can jump when NTP corrects it; a monotonic clock cannot go
   backwards).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.short_repr import short_repr

__all__ = [
    "SaveCadence",
    "SpotComparison",
    "compare_spot",
    "cost_per_accepted_step",
    "daly_interval",
    "expected_wall_time",
    "should_save",
    "validate_cadence",
    "young_interval",
]


def _positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    value = float(value)
    ok = value >= 0 if allow_zero else value > 0
    if not ok or math.isnan(value) or math.isinf(value):
        bound = ">= 0" if allow_zero else "> 0"
        raise CheckpointError(f"{name} must be a finite number {bound}, got {value!r}.")
    return value


def cost_per_accepted_step(
    *,
    compute_cost: float,
    unique_steps: int,
    save_cost: float = 0.0,
    transfer_cost: float = 0.0,
) -> float:
    """Everything billed, divided by the steps that count.

    Args:
        compute_cost: Billed compute, *including* steps that were redone after
            interruptions (they were paid for).
        unique_steps: Distinct optimizer steps in the final model: steps
            redone after a restore count once.
        save_cost: Cost of writing checkpoints (time on the machine, storage).
        transfer_cost: Cost of moving checkpoints (egress, cross-region copies).

    Returns:
        Cost per accepted step, in the same currency as the inputs.

    Raises:
        CheckpointError: A negative cost or ``unique_steps < 1``.

    Example:
        >>> cost_per_accepted_step(compute_cost=90.0, save_cost=6.0, transfer_cost=4.0, unique_steps=1000)
        0.1
    """
    if isinstance(unique_steps, bool) or not isinstance(unique_steps, int) or unique_steps < 1:
        raise CheckpointError(f"unique_steps must be an int >= 1, got {unique_steps!r}.")
    costs = {"compute_cost": compute_cost, "save_cost": save_cost, "transfer_cost": transfer_cost}
    return sum(_positive(name, value, allow_zero=True) for name, value in costs.items()) / unique_steps


@dataclass(frozen=True)
class SpotComparison:
    """On-demand versus spot cost of the same job.

    Attributes:
        on_demand_cost: ``job_hours * on_demand_price``.
        spot_cost: ``billed_hours * spot_price`` (billed hours include redone
            work, restarts and waiting for capacity if it is billed).
        savings_fraction: ``1 - spot_cost / on_demand_cost``; negative when
            spot ended up dearer.
    """

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    on_demand_cost: float
    spot_cost: float
    savings_fraction: float


def compare_spot(
    *,
    job_hours: float,
    billed_spot_hours: float,
    spot_price_fraction: float,
    on_demand_price: float = 1.0,
) -> SpotComparison:
    """Compare a job's on-demand cost with what it really cost on spot.

    Args:
        job_hours: Hours the job needs uninterrupted (on demand).
        billed_spot_hours: Hours billed on spot, redone work included.
        spot_price_fraction: Spot price as a fraction of on-demand (0.5 = half).
        on_demand_price: Price per hour on demand.

    Returns:
        A :class:`SpotComparison`.

    Example:
        A 10-hour job on spot at half price that bills 14 hours costs
        ``0.5 * 14 = 7`` instead of 10: 30% cheaper, not 50%.

        >>> c = compare_spot(job_hours=10, billed_spot_hours=14, spot_price_fraction=0.5)
        >>> (c.on_demand_cost, c.spot_cost, round(c.savings_fraction, 6))
        (10.0, 7.0, 0.3)
    """
    job_hours = _positive("job_hours", job_hours)
    billed = _positive("billed_spot_hours", billed_spot_hours, allow_zero=True)
    fraction = _positive("spot_price_fraction", spot_price_fraction)
    price = _positive("on_demand_price", on_demand_price)
    on_demand = job_hours * price
    spot = billed * fraction * price
    return SpotComparison(on_demand, spot, 1.0 - spot / on_demand)


def young_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's (1974) first-order optimum compute time between saves.

    ``T = sqrt(2 * delta * M)``. Good when ``delta << M``; it ignores the time
    lost to the save itself within an interval, which Daly corrects.

    Args:
        save_seconds: Time one save takes (``delta``), measured.
        mtbf_seconds: Mean time between interruptions (``M``), assumed.

    Raises:
        CheckpointError: A non-positive or non-finite input.

    Example:
        >>> young_interval(2.0, 3600.0)
        120.0
    """
    delta = _positive("save_seconds", save_seconds)
    mtbf = _positive("mtbf_seconds", mtbf_seconds)
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly's (2006) higher-order optimum compute time between saves.

    For ``delta < 2M``:
    ``T = sqrt(2*delta*M) * (1 + (1/3)*sqrt(delta/(2M)) + (1/9)*(delta/(2M))) - delta``;
    otherwise ``T = M`` (saving costs so much that one interval per expected
    failure is the best one can do). Assumes exponentially distributed
    interruptions and a fixed save cost; the restart time does not move the
    optimum (see the module docstring).

    Args:
        save_seconds: Time one save takes (``delta``), measured.
        mtbf_seconds: Mean time between interruptions (``M``), assumed.

    Raises:
        CheckpointError: A non-positive or non-finite input.

    Example:
        >>> round(daly_interval(2.0, 3600.0), 3)
        118.67
    """
    delta = _positive("save_seconds", save_seconds)
    mtbf = _positive("mtbf_seconds", mtbf_seconds)
    if delta >= 2.0 * mtbf:
        return mtbf
    x = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def expected_wall_time(
    *,
    solve_seconds: float,
    interval_seconds: float,
    save_seconds: float,
    mtbf_seconds: float,
    restart_seconds: float = 0.0,
) -> float:
    """Expected wall time to finish ``solve_seconds`` of compute (Daly's model).

    ``T_w = M * exp(R/M) * (exp((tau + delta)/M) - 1) * T_s / tau``, with
    ``tau`` the compute interval, ``delta`` the save time, ``R`` the restart
    time and ``T_s`` the compute the job needs. Plotting it against ``tau``
    shows the flat-bottomed curve whose minimum :func:`daly_interval`
    approximates: being off by a factor of two costs little, saving every
    step or never costs a lot.

    Raises:
        CheckpointError: A non-positive or non-finite input (``restart_seconds`` may be 0).

    Example:
        >>> kw = dict(save_seconds=2, mtbf_seconds=3600)
        >>> t = expected_wall_time(solve_seconds=36000, interval_seconds=120, **kw)
        >>> 36000 < t < 1.1 * 36000
        True
    """
    solve = _positive("solve_seconds", solve_seconds)
    tau = _positive("interval_seconds", interval_seconds)
    delta = _positive("save_seconds", save_seconds, allow_zero=True)
    mtbf = _positive("mtbf_seconds", mtbf_seconds)
    restart = _positive("restart_seconds", restart_seconds, allow_zero=True)
    return mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf) * solve / tau


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
        or not 0 < every_seconds < math.inf  # NaN fails both comparisons
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
