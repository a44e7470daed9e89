"""Rank programs for the record-damage tests: save a DDP run, restore, report; EIO on one rank."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from ckpt_lesson import CheckpointError, TrainState
from ckpt_lesson.distributed import DistributedCheckpointManager
from ckpt_lesson.faults.rank_programs import make_run, train_step, write_json


def w_save_steps(rank: int, world: int, run: str, steps: list[int]) -> None:
    """Train a DDP run to max(steps), saving at each of ``steps``."""
    model, opt, sched, sampler = make_run("ddp", world, rank)
    mgr = DistributedCheckpointManager(run, keep_last=5, every_steps=2)
    state = TrainState()
    for step in range(1, max(steps) + 1):
        state.losses.append(train_step(model, opt, sched, sampler))
        state.step = step
        if step in steps:
            mgr.save(model, opt, sched, state)
    mgr.close()


def w_restore_report(rank: int, world: int, out: str, names: list[str]) -> None:
    """Restore each run under ``out``; write what this rank got (step and skipped, or the error)."""
    for name in names:
        run = Path(out) / name
        model, opt, sched, _ = make_run("ddp", world, rank)
        mgr = DistributedCheckpointManager(run, keep_last=5, every_steps=2)
        report: dict[str, Any]
        try:
            restored = mgr.restore_latest(model, opt, sched)
            report = {"step": restored.step, "skipped": restored.skipped}
        except CheckpointError as exc:
            report = {"error": f"{type(exc).__name__}: {exc}"}
        mgr.close()
        write_json(Path(out) / f"{name}-rank{rank}.json", report)


def w_restore_report_with_eio(rank: int, world: int, out: str, cases: list[tuple[str, int, str]]) -> None:
    """As :func:`w_restore_report`, but reading ``step-00000004/<file>`` fails with EIO on one rank.

    Each case is ``(run name, victim rank, file)``. On the victim rank only, ``os.read`` of that
    one file raises a real ``OSError(EIO)`` (a bad sector seen by one node: no disk fails on cue);
    everything above it, the bounded reader, verification and the ranks' agreement, is the real
    code. The other rank reads the file normally.
    """
    real_read = os.read
    for name, victim_rank, victim in cases:
        target = os.path.realpath(Path(out) / name / "step-00000004" / victim)

        def failing_read(fd: int, n: int, target: str = target) -> bytes:
            if os.readlink(f"/proc/self/fd/{fd}") == target:
                raise OSError(errno.EIO, "Input/output error")
            return real_read(fd, n)

        if rank == victim_rank:
            os.read = failing_read
        try:
            w_restore_report(rank, world, out, [name])
        finally:
            os.read = real_read
