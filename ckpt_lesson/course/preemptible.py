"""The teaching loop, stopped cleanly by a preemption signal.

:class:`~ckpt_lesson.runs.preemption.PreemptionHandler` is the library piece
(catch SIGTERM, finish the step, a timed save); this module wires it into the
course's toy training loop so notebooks and tests can show a preempted run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ckpt_lesson.course.training import StepRecord, SyntheticRegression, train
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.runs.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler, TimedSave

__all__ = ["PreemptionOutcome", "train_until_preempted"]

log = logging.getLogger("ckpt_lesson.runs.preemption")


@dataclass
class PreemptionOutcome:
    """How :func:`train_until_preempted` ended.

    Attributes:
        exit_code: 0 when ``until_step`` was reached, :data:`PREEMPTED_EXIT_CODE`
            when a signal stopped the run after a save.
        records: Steps taken in this process.
        saves: Every measured save (periodic and final).
    """

    exit_code: int
    records: list[StepRecord] = field(default_factory=list)
    saves: list[TimedSave[Any]] = field(default_factory=list)

    @property
    def preempted(self) -> bool:
        return self.exit_code == PREEMPTED_EXIT_CODE


def train_until_preempted(
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    state: TrainState,
    data: SyntheticRegression,
    *,
    until_step: int,
    seed: int,
    save: Callable[[TrainState], Any],
    handler: PreemptionHandler,
    every_steps: int | None = None,
    batch_size: int = 16,
    after_step: Callable[[TrainState, StepRecord], bool | None] | None = None,
) -> PreemptionOutcome:
    """Train like :func:`ckpt_lesson.course.training.train`, but stop cleanly on preemption.

    After every complete step the loop checks ``handler.requested``; when set,
    it saves through ``handler.timed_save`` and returns with
    :data:`PREEMPTED_EXIT_CODE`. The step in flight when the signal arrived is
    finished first, so the save is always at a step boundary.

    Args:
        model, optimizer, scheduler, state, data, until_step, seed, batch_size:
            As for :func:`ckpt_lesson.course.training.train`.
        save: Called with the state to save, e.g.
            ``lambda st: mgr.save(model, opt, sched, st)`` or a
            :func:`~ckpt_lesson.files.checkpoint.save_checkpoint` call.
        handler: An entered :class:`PreemptionHandler`.
        every_steps: Also save every N steps (measured, so a save that would
            not fit the grace period is reported early).
        after_step: Optional extra callback; return ``True`` to stop (without a save).

    Returns:
        A :class:`PreemptionOutcome`; pass ``outcome.exit_code`` to ``sys.exit``.
    """
    outcome = PreemptionOutcome(exit_code=0)
    stop_for_caller = False

    def hook(st: TrainState, record: StepRecord) -> bool:
        nonlocal stop_for_caller
        if after_step is not None and after_step(st, record):
            stop_for_caller = True
        if handler.requested:
            return True
        if every_steps and st.step % every_steps == 0 and st.step < until_step:
            outcome.saves.append(handler.timed_save(lambda: save(st)))
        return stop_for_caller

    outcome.records = train(
        model, optimizer, scheduler, state, data, until_step=until_step, seed=seed,
        batch_size=batch_size, after_step=hook,
    )  # fmt: skip
    if handler.requested and state.step < until_step:
        # A signal during the very last step needs no preemption save: the run
        # is finished, and the caller's usual final save follows.
        outcome.saves.append(handler.timed_save(lambda: save(state)))
        log.info("preempted: saved at step %d, exiting with %d", state.step, PREEMPTED_EXIT_CODE)
        outcome.exit_code = PREEMPTED_EXIT_CODE
    return outcome
