"""Notebook 00's scenario: what interruptions cost a long run, with and without checkpoints.

An 18-hour run on 4-hour allocations, with one reboot in hour 11, simulated minute by minute:
each save costs a minute of the allocation, each restart (re-queue, load, warm-up) ten, and an
interruption loses everything since the last save. The notebook prints the table; the model
lives here so the lesson's cell stays a few lines long.
"""

from __future__ import annotations

__all__ = ["simulate"]


def simulate(
    every_min: int | None,
    *,
    total_h: int = 18,
    alloc_h: int = 4,
    reboot_at_h: int = 11,
    save_min: int = 1,
    restart_min: int = 10,
    give_up_h: int = 48,
    save_at_deadline: bool = False,
) -> tuple[float | None, float, int]:
    """Simulate the run minute by minute and say when it finishes and what it lost.

    Args:
        every_min: Save every this many minutes of progress; ``None`` never saves periodically.
        total_h: Hours of compute the run needs.
        alloc_h: Hours in one allocation; the job ends when it runs out.
        reboot_at_h: The wall-clock hour of the one random reboot.
        save_min: Minutes one save takes out of the allocation.
        restart_min: Minutes each restart takes (re-queue, load, warm-up).
        give_up_h: Wall-clock hours after which the run is declared never finished.
        save_at_deadline: Also save in the last minutes of every allocation (its end is known).

    Returns:
        ``(wall-clock hours, or None if it never finished; hours of compute lost; interruptions)``.

    Example:
        >>> wall, lost, interruptions = simulate(30)
        >>> print(f"{wall:.1f} h, {lost:.1f} h lost, {interruptions} interruptions")
        21.0 h, 1.6 h lost, 5 interruptions
    """
    t = done = saved = lost = interruptions = 0
    alloc_left = alloc_h * 60
    rebooted = False
    while done < total_h * 60:
        if t >= give_up_h * 60:
            return None, lost / 60, interruptions
        t, done, alloc_left = t + 1, done + 1, alloc_left - 1
        if every_min and done % every_min == 0 and done < total_h * 60:
            t, alloc_left, saved = t + save_min, alloc_left - save_min, done  # a save costs time too
        if save_at_deadline and alloc_left <= save_min and saved != done:  # the known end is near: save now
            t, alloc_left, saved = t + save_min, alloc_left - save_min, done
        if done >= total_h * 60:
            break
        reboot = not rebooted and t >= reboot_at_h * 60
        if alloc_left <= 0 or reboot:  # the allocation ended, or the machine rebooted
            rebooted = rebooted or reboot
            interruptions += 1
            lost += done - saved  # everything since the last save is gone
            done = saved
            t, alloc_left = t + restart_min, alloc_h * 60
    return t / 60, lost / 60, interruptions
