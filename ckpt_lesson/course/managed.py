"""``python -m ckpt_lesson train``: the teaching run, saved and resumed by a manager.

This is the whole recipe of the course in one function:

1. seed everything, then build data, model, optimizer and scheduler, always
   in the same order (a resume must build the same objects as the first run);
2. open a :class:`~ckpt_lesson.runs.manager.CheckpointManager` on the run folder;
3. restore the newest good save, if there is one (``resume="auto"``);
4. train, asking the manager after every step whether a save is due;
5. save the final state, so a finished run can be evaluated or extended.

Because the batch order depends only on ``(seed, epoch)`` and every RNG is in
the checkpoint, a run interrupted at any point and resumed this way produces
bit-for-bit the same losses as a run that was never interrupted (on CPU).

The function is importable and deterministic on purpose: fault-injection
tests run it in child processes and kill them at chosen moments.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt_lesson.course.training import (
    StepRecord,
    SyntheticRegression,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
    train,
)
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.files.storage import is_store_url, open_storage
from ckpt_lesson.runs.async_save import AsyncCheckpointer
from ckpt_lesson.runs.contract import config_fingerprint as _contract_config_fingerprint
from ckpt_lesson.runs.contract import model_fingerprint
from ckpt_lesson.runs.layout import step_of
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.manager_config import EventHook
from ckpt_lesson.runs.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler
from ckpt_lesson.runs.report import RecoveryRecorder
from ckpt_lesson.runs.store_commit import committed_steps

__all__ = ["DEFAULT_EVERY_STEPS", "RESUME_MODES", "run_managed_training"]

RESUME_MODES = ("auto", "never", "must")
DEFAULT_EVERY_STEPS = 10


def _has_saves(run_dir: Path | str) -> bool:
    if isinstance(run_dir, str):  # an object store: a committed save has a COMMIT marker
        return bool(committed_steps(open_storage(run_dir)))
    return run_dir.is_dir() and any(step_of(p.name) is not None for p in run_dir.iterdir())


def _run_location(run_dir: str | os.PathLike[str]) -> tuple[Path | str, Path]:
    """``(run_dir, folder for the recovery log)``: a store URL stays a string, its log goes to a temp folder.

    The recovery log and heartbeat are local files; for a run in a bucket they live on this
    machine only (and go with it), the checkpoints do not.
    """
    if is_store_url(run_dir):
        return str(run_dir), Path(tempfile.mkdtemp(prefix="ckpt-lesson-recovery-"))
    return Path(run_dir), Path(run_dir)


def config_fingerprint(config: dict[str, Any]) -> str:
    """sha256 of the run's settings as sorted JSON: equal settings, equal fingerprint.

    The same function as :func:`ckpt_lesson.runs.contract.config_fingerprint`, so a
    fingerprint recorded here can be recomputed with the public one.
    """
    return _contract_config_fingerprint(config)


def run_managed_training(
    run_dir: str | os.PathLike[str],
    *,
    total_steps: int,
    seed: int = 11,
    every_steps: int | None = None,
    every_seconds: float | None = None,
    keep_last: int = 3,
    num_shards: int | None = None,
    resume: str = "auto",
    batch_size: int = 16,
    progress: bool = False,
    stop_after_step: int | None = None,
    on_event: EventHook | None = None,
    env_policy: str = "refuse",
    show_contract: bool = False,
    after_step: Callable[[TrainState, StepRecord], None] | None = None,
    on_restore: Callable[[Any, dict[str, Any] | None], None] | None = None,
    preemption: PreemptionHandler | None = None,
    async_saves: bool = False,
) -> dict[str, Any]:
    """Train the teaching model to ``total_steps``, saving and resuming via a manager.

    Args:
        run_dir: The run folder (created if missing).
        total_steps: Steps of the whole run (also the cosine schedule's length).
        seed: Seeds data, model, RNGs and the batch order.
        every_steps, every_seconds: Save cadence (at least one).
        keep_last: Verified saves to keep.
        num_shards: ``None`` for single-file saves, else shards per save.
        resume: ``"auto"`` restore the newest good save if any; ``"never"``
            refuse a folder that already has saves (two runs must not mix);
            ``"must"`` refuse to start without a save.
        batch_size: Samples per step.
        progress: Show a tqdm bar on stderr (hidden when stderr is not a terminal).
        stop_after_step: Stop (without a final save) once this step is done:
            a stand-in for an interruption, for lessons and tests.
        on_event: Passed to the manager (see :class:`CheckpointManager`).
        env_policy: What a resume does about a changed environment (see
            :func:`ckpt_lesson.runs.contract.check_contract`); data, model and
            config changes are always refused, before any tensor is loaded.
        show_contract: Print the resume contract table (save id, step, data
            fingerprint, environment) before training continues.
        after_step: Called after every step (after the progress heartbeat,
            before a due save), e.g. to stream step records.
        on_restore: Called as ``on_restore(model, last_restore)`` after a
            restore and before the first step.
        preemption: An entered :class:`~ckpt_lesson.runs.preemption.PreemptionHandler`:
            once it has caught a signal, the step in flight finishes, the state
            is saved (timed against the grace period) and the run stops with
            ``"preempted": True`` and ``"exit_code": 75`` in the result.
        async_saves: Write periodic saves in the background through an
            :class:`~ckpt_lesson.runs.async_save.AsyncCheckpointer` (training
            goes on while a save is written; at most one in flight). The final
            and preemption saves first wait for it. ``on_event`` hooks then run
            on the writer thread.

    Every restore appends a line to ``run_dir/recovery.jsonl`` after the first
    resumed step (see :mod:`ckpt_lesson.runs.report`), and ``progress.json`` is
    rewritten after every step.

    Returns:
        ``{"losses": every loss from step 1 (restored history included),
        "sample_ids": {step: ids} for the steps run in this call,
        "resumed_from": restored step or None, "final_step": int,
        "saved_steps": steps saved in this call, "stopped_early": bool,
        "last_restore": the manager's last_restore}``.

    Raises:
        CheckpointError: Bad arguments, ``resume`` rules violated, or saves
            exist but none is usable.

    Example:
        >>> out = run_managed_training("runs/a", total_steps=40, every_steps=10)  # doctest: +SKIP
        >>> out["final_step"], out["saved_steps"]  # doctest: +SKIP
        (40, [10, 20, 30, 40])
    """
    if resume not in RESUME_MODES:
        raise CheckpointError(f"resume must be one of {RESUME_MODES}, got {resume!r}.")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise CheckpointError(f"total_steps must be an int >= 1, got {total_steps!r}.")
    run_dir, recorder_dir = _run_location(run_dir)
    if resume == "never" and _has_saves(run_dir):
        raise CheckpointError(
            f"{run_dir}: already holds saves and resume='never'; use resume='auto' to continue that run, "
            "or a new folder for a new run (mixing two runs in one folder loses track of both)."
        )
    seed_everything(seed)
    data = SyntheticRegression(seed=seed)
    model = make_model()
    optimizer, scheduler = make_optimizer_and_scheduler(model, total_steps=total_steps)
    settings = {"seed": seed, "total_steps": total_steps, "batch_size": batch_size, "model": "make_model()"}
    saved_steps: list[int] = []
    data_block = {"fingerprint": data.fingerprint(), "order_seed": seed}
    fingerprints = {
        "config_fingerprint": config_fingerprint(settings),
        "model_fingerprint": model_fingerprint(model),
    }
    recorder = (
        RecoveryRecorder(recorder_dir, store=run_dir)
        if isinstance(run_dir, str)
        else RecoveryRecorder(run_dir)
    )  # reads the crashed process's last heartbeat first

    def record_saves(name: str, info: dict[str, Any]) -> None:
        if name == "published":
            saved_steps.append(info["step"])
        if name == "resume_contract" and show_contract:
            print(info["report"].format(), flush=True)
        if on_event is not None:
            on_event(name, info)

    with CheckpointManager(
        run_dir,
        keep_last=keep_last,
        every_steps=every_steps,
        every_seconds=every_seconds,
        num_shards=num_shards,
        data=data_block,
        metadata={**settings, **fingerprints},
        on_event=record_saves,
        expect={"data": data_block, "config": settings, **fingerprints},
        env_policy=env_policy,
    ) as mgr:
        restored = mgr.restore_latest(model, optimizer, scheduler) if resume != "never" else None
        if resume == "must" and restored is None:
            raise CheckpointError(f"{run_dir}: no save to resume from and resume='must'; check the folder.")
        recorder.restored(mgr.last_restore)
        if on_restore is not None:
            on_restore(model, mgr.last_restore)
        state = restored or TrainState()
        resumed_from = restored.step if restored is not None else None
        # Leaving this block waits for a background save still in flight, so it is published (or
        # its error raised) before the final save below; a body error wins over a save error.
        with AsyncCheckpointer(mgr) if async_saves else contextlib.nullcontext() as writer:
            records = _train_with_saves(
                mgr,
                model,
                optimizer,
                scheduler,
                state,
                data,
                total_steps,
                seed,
                batch_size,
                progress,
                stop_after_step,
                recorder,
                after_step,
                preemption,
                writer,
            )
        stopped_early = state.step < total_steps
        preempted = preemption is not None and preemption.requested and stopped_early
        if not stopped_early and mgr.last_saved_step != state.step:
            mgr.save(model, optimizer, scheduler, state)  # the finished run, ready to evaluate or extend
        last_restore = mgr.last_restore
    return {
        "losses": list(state.losses),
        "sample_ids": {r.step: list(r.sample_ids) for r in records},
        "resumed_from": resumed_from,
        "final_step": state.step,
        "saved_steps": saved_steps,
        "stopped_early": stopped_early,
        "last_restore": last_restore,
        "preempted": preempted,
        "exit_code": PREEMPTED_EXIT_CODE if preempted else 0,
    }


def _train_with_saves(
    mgr: CheckpointManager,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    state: TrainState,
    data: SyntheticRegression,
    total_steps: int,
    seed: int,
    batch_size: int,
    progress: bool,
    stop_after_step: int | None,
    recorder: RecoveryRecorder | None = None,
    user_after_step: Callable[[TrainState, StepRecord], None] | None = None,
    preemption: PreemptionHandler | None = None,
    writer: AsyncCheckpointer | None = None,
) -> list[StepRecord]:
    from tqdm import tqdm  # plain bar on stderr: tqdm.auto would store a widget in notebooks

    # disable=None hides the bar when stderr is not a terminal (CI logs, notebooks' captured output).
    disable = None if progress else True
    bar = tqdm(total=total_steps, initial=state.step, unit="step", file=sys.stderr, disable=disable)

    def after_step(st: TrainState, record: StepRecord) -> bool:
        bar.update(1)
        bar.set_postfix(loss=f"{record.loss:.4f}", refresh=False)
        if recorder is not None:
            recorder.step_done(st.step)
        if user_after_step is not None:
            user_after_step(st, record)
        if writer is not None:
            if writer.should_save(st.step):
                writer.save_async(model, optimizer, scheduler, st)  # returns once the snapshot is taken
        elif mgr.should_save(st.step):
            mgr.save(model, optimizer, scheduler, st)
        if preemption is not None and preemption.requested and st.step < total_steps:
            # The signal only set a flag; now, at a step boundary, is the safe moment to save.
            if writer is not None:
                writer.wait()  # one save at a time: the one in flight first
            if mgr.last_saved_step != st.step:
                preemption.timed_save(lambda: mgr.save(model, optimizer, scheduler, st))
            return True
        return stop_after_step is not None and st.step >= stop_after_step

    try:
        return train(
            model,
            optimizer,
            scheduler,
            state,
            data,
            until_step=total_steps,
            seed=seed,
            batch_size=batch_size,
            after_step=after_step,
        )
    finally:
        bar.close()
