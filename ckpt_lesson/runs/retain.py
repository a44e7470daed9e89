"""Retention on disk: delete old saves only while the saves kept instead still verify.

:mod:`ckpt_lesson.runs.retention` decides *which* steps may go, from a set of
steps known to verify. That set is a memory of the past: a save verified an
hour ago can have a flipped bit now, with its size unchanged. If retention
trusted the memory, ``keep_last=2`` would delete the older good save and leave
one good save and one damaged one, and a later restore would have a single
candidate. So before anything is deleted, every save retention is about to
rely on is hashed again; one that no longer verifies stops counting, and the
decision is made again without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path

from ckpt_lesson.runs.commit import delete_save
from ckpt_lesson.runs.retention import RetentionPolicy
from ckpt_lesson.runs.scan import inspect_save, published_steps, step_dir_name

__all__ = ["apply_retention"]

# The manager's messages, under the manager's logger name (see ckpt_lesson.runs.commit for why).
log = logging.getLogger("ckpt_lesson.runs.manager")


def apply_retention(
    run_dir: Path,
    policy: RetentionPolicy,
    verified: set[int],
    *,
    emit: Callable[..., None],
    fresh: Collection[int] = (),
) -> list[int]:
    """Delete what ``policy`` allows once the saves it keeps are re-verified; returns deleted steps.

    Args:
        run_dir: The run directory.
        policy: Decides from ``(steps, verified)`` which steps go.
        verified: Steps known to verify; updated in place (failures removed,
            deleted steps removed).
        emit: ``emit(name, **info)``; called with ``"retention_delete"`` per step.
        fresh: Steps hashed moments ago (a save verified before publishing);
            not hashed again.

    Returns:
        Ascending list of deleted steps.

    Example:
        >>> no_events = lambda name, **info: None
        >>> apply_retention(run_dir, KeepLastK(2), {10, 20, 30}, emit=no_events)  # doctest: +SKIP
        [10]
    """
    steps = published_steps(run_dir)
    verified.intersection_update(steps)
    checked: set[int] = set(fresh)
    while True:
        doomed = policy.to_delete(steps, verified)
        if not doomed:
            return []
        relied_on = sorted(s for s in verified if s not in doomed and s not in checked)
        failed = []
        for step in relied_on:
            result, _ = inspect_save(run_dir / step_dir_name(step))
            checked.add(step)
            if not result.ok:
                failed.append(step)
                name, reason = result.path.name, result.reason
                log.warning("%s no longer verifies (%s); not counting it as good", name, reason)
        if not failed:
            break
        verified.difference_update(failed)  # decide again without them: maybe nothing may go now
    deleted = []
    for step in doomed:
        emit("retention_delete", step=step)
        if delete_save(run_dir / step_dir_name(step)):
            verified.discard(step)
            deleted.append(step)
    return deleted
