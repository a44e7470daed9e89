"""Asynchronous saves: the training thread pays for a memory copy, a thread writes the bytes.

A save has two halves. *Reading* the training state is a memory copy
(milliseconds); *writing* it (serialize, hash, fsync, verify, publish) is disk
time (seconds for a real model). Only the first has to stop training, so an
:class:`AsyncCheckpointer` does:

1. **Snapshot, synchronously.** :meth:`TrainingSnapshot.capture` copies every
   tensor of the three ``state_dict()``\\ s to CPU memory of its own (the
   previous snapshot's buffers, refilled), copies the
   :class:`~ckpt_lesson.files.checkpoint.TrainState`, and captures the generators
   *now*. When it returns, the snapshot shares no memory with the live objects,
   except the large optimizer-state tensors: by default the writer copies those
   first, while the next forward and backward run, and every optimizer's next
   ``step()`` waits until it has (``overlap_copy``; see
   :mod:`~ckpt_lesson.runs.snapshot`).
2. **Write, in the background.** One thread runs the manager's full commit
   protocol (:meth:`CheckpointManager.save <ckpt_lesson.runs.manager.CheckpointManager.save>`)
   on the snapshot, passing ``rng=snapshot.rng``, while training continues.

Why the generators are captured at the snapshot: the next training steps draw
dropout masks and input jitter. A state captured when the thread gets round to
writing would describe some later step, and a resume would continue with the
wrong random numbers, plausibly but not identically.

Why at most one save is in flight: each snapshot is a full copy of the
training state, so a queue of them is unbounded memory; one in flight means at
most one extra copy. It also publishes saves in step order and never runs the
manager's ``save`` twice at once. So :meth:`~AsyncCheckpointer.save_async`
first waits for the previous save, *then* takes its snapshot.

Why errors surface on the training thread: an exception in a background thread
only prints a traceback; the run would carry on believing it is protected. The
error is kept and re-raised by the next :meth:`~AsyncCheckpointer.save_async`
or :meth:`~AsyncCheckpointer.wait` (and by leaving the ``with`` block); one
never raised there is printed on stderr at interpreter exit
(:mod:`ckpt_lesson.runs.async_report`). A failed save publishes nothing; the
older saves stay intact.

What is and is not safe: mutating the model or optimizer right after
``save_async`` returns is safe, because the snapshot was finished before it
returned. Calling ``manager.save`` (or ``restore_latest``) directly while an
async save is in flight is *not* supported: call :meth:`~AsyncCheckpointer.wait`
first. The manager's cadence timer restarts only when a background save
publishes, so while one is in flight :meth:`~AsyncCheckpointer.should_save`
applies the step rule alone; otherwise the time rule would fire on every step
and queue a second save right behind the first.

Interruptions: Ctrl-C reaches the training thread, not the writer, and
Python waits for the (non-daemon) writer at exit, so the save in flight still
finishes. A process killed mid-write (``SIGKILL``, a second Ctrl-C at exit,
a power cut) leaves only a ``.staging-step-*`` folder: the commit protocol
publishes nothing until the final rename, and the next manager removes the
folder once its lock is free.

Example:
    >>> with AsyncCheckpointer(mgr) as ckpt:  # doctest: +SKIP
    ...     def after_step(state, record):
    ...         if ckpt.should_save(state.step):
    ...             ckpt.save_async(model, opt, sched, state)  # returns after the copy
    ...     train(model, opt, sched, state, data, until_step=500, seed=11, after_step=after_step)
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.payload import build_state_payload
from ckpt_lesson.runs.async_report import forget_failure, lower_writer_priority, note_failure
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.manager_config import is_state_call, positional_save_args
from ckpt_lesson.runs.snapshot import DeferredCopies, StepGate, TrainingSnapshot, snapshot_payload

__all__ = ["AsyncCheckpointer", "TrainingSnapshot"]

log = logging.getLogger(__name__)


class AsyncCheckpointer:
    """Save through a :class:`~ckpt_lesson.runs.manager.CheckpointManager` without stopping training.

    One training thread calls it; at most one save is in flight (see the
    module docstring). Closing the checkpointer waits for that save; it does
    not close the manager.

    Args:
        manager: Where saves go; its full commit protocol runs on the writer thread.
        writer_nice: How much nicer (lower in priority) the writer thread runs
            than the thread that started it, 0 to 19 (Linux, where a thread
            has its own nice value; elsewhere ignored). The writer pickles, hashes and
            fsyncs on the same cores as training; at 10, training steps taken
            during a save ran at their usual speed here (1.0x, against 1.4-1.9x
            at 0), but the save itself gets only a small share of a busy CPU and
            finishes later, so the previous save may still be writing when the
            next one is due (``save_async`` then waits). 0 (the default) keeps
            the writer's priority; raise it when saves are rare and the CPU is
            the bottleneck, as in CPU training.
        overlap_copy: Which large tensors the writer thread copies while the next
            forward and backward run, instead of the training thread now; every
            optimizer's next ``step()`` waits until they are copied (see
            :mod:`~ckpt_lesson.runs.snapshot`). ``"optimizer"`` (the
            default): optimizer state (AdamW's moments are two thirds of the
            state). ``True``: parameters too, for loops where nothing but
            ``step()`` writes parameters between saves. ``False``: copy
            everything now. A deferred tensor written in place before its copy
            is done (not by a ``step()``) fails that save with an error naming
            ``overlap_copy=False``.

    Raises:
        CheckpointError: ``writer_nice`` is not an int from 0 to 19, or
            ``overlap_copy`` is not ``True``, ``False`` or ``"optimizer"``.

    Example:
        >>> ckpt = AsyncCheckpointer(mgr)  # doctest: +SKIP
        >>> ckpt.save_async(model, opt, sched, state)  # doctest: +SKIP
        >>> ckpt.wait().name  # doctest: +SKIP
        'step-00000240'
    """

    def __init__(
        self,
        manager: CheckpointManager,
        *,
        writer_nice: int = 0,
        overlap_copy: bool | Literal["optimizer"] = "optimizer",
    ) -> None:
        if isinstance(writer_nice, bool) or not isinstance(writer_nice, int) or not 0 <= writer_nice <= 19:
            raise CheckpointError(f"writer_nice must be an int from 0 to 19, got {writer_nice!r}.")
        if not (isinstance(overlap_copy, bool) or overlap_copy == "optimizer"):
            raise CheckpointError(f"overlap_copy must be True, False or 'optimizer', got {overlap_copy!r}.")
        self.manager = manager
        self.writer_nice = writer_nice
        self.overlap_copy = overlap_copy
        self._gate: StepGate | None = None  # registered at the first overlapped save, removed by close()
        self._waited_before = 0.0  # step_wait_s of gates already removed
        self._lock = threading.Lock()  # serializes callers; the writer never takes it
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None
        # The last snapshot, kept for its buffers; only touched after its save has finished.
        self._buffers: TrainingSnapshot | None = None
        self._payload_buffers: dict[str, Any] | None = None

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.close()
        except Exception:
            if exc_type is None:
                raise
            # The body's own error is the one to propagate; this one is logged, not lost.
            log.exception("asynchronous save failed while leaving the block after another error")

    def __repr__(self) -> str:
        return f"AsyncCheckpointer({self.manager!r}, in_flight={self.in_flight})"

    @property
    def copying(self) -> bool:
        """True while an overlapped snapshot's copies are pending (optimizer steps wait meanwhile)."""
        return self._gate is not None and self._gate.pending

    @property
    def step_wait_s(self) -> float:
        """Seconds optimizer steps have waited for overlapped copies (0.0 with ``overlap_copy=False``).

        This, plus the time ``save_async`` itself
        takes, is what saving costs the training thread: a number near 0
        means the forward and backward passes hid the copies.
        """
        return self._waited_before + (0.0 if self._gate is None else self._gate.waited_s)

    @property
    def in_flight(self) -> bool:
        """True while a background save is still writing."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def should_save(self, step: int) -> bool:
        """The manager's cadence decision; only its step rule while a save is in flight."""
        if self.in_flight:
            every = self.manager.config.every_steps
            return every is not None and step > 0 and step != self._step and step % every == 0
        return self.manager.should_save(step)

    def save_async(self, *args: Any, rng: Any = None, extras: dict[str, Any] | None = None) -> None:
        """Wait for the previous save, snapshot the state now, and write it in the background.

        Takes the manager's two forms: ``save_async(step, state, *, rng=True)``
        (the state API: every part, plain value and the RNG is copied) and
        ``save_async(model, optimizer, scheduler, train_state, *, rng=None, extras=None)``.
        ``rng`` may be a state captured earlier with ``capture_rng_state()``.
        Returns once the snapshot is taken; the live objects may then change freely.

        Raises:
            CheckpointError: The previous background save failed (re-raised
                here; this call then saves nothing, so call again to retry),
                a bad part or ``state``, the manager is closed, a value
                could not be loaded back (meta tensors, NumPy arrays), or the call comes from the
                writer thread itself (e.g. an ``on_event`` hook), which would
                deadlock waiting for itself.

        Example:
            >>> ckpt.save_async(step, {"model": model, "optimizer": opt, "hidden": h})  # doctest: +SKIP
        """
        self._refuse_writer_thread("save_async")
        self.manager.check_open()  # a closed manager must refuse now, not in the background
        with self._lock:
            self._wait_locked()
            # _wait_locked joined the previous writer, so its snapshot's buffers are free to refill.
            later = self._deferred(args)
            if is_state_call(args):
                if extras is not None:
                    raise CheckpointError("extras= belongs to the positional form; put values in the state.")
                payload = build_state_payload(
                    *args, rng=True if rng is None else rng, data=self.manager.config.data
                )
                snapshot: Any = snapshot_payload(payload, reuse=self._payload_buffers, later=later)
                self._payload_buffers, step = snapshot, snapshot["step"]
            else:
                model, optimizer, scheduler, state = positional_save_args(args)
                snapshot = TrainingSnapshot.capture(
                    model, optimizer, scheduler, state, reuse=self._buffers, rng=rng, later=later
                )
                self._buffers, step = snapshot, snapshot.state.step
            if later is not None and later.pairs and self._gate is not None:
                self._gate.shut()  # from here until the writer has copied them, steps wait
            thread = threading.Thread(
                target=self._write,
                args=(snapshot, step, copy.deepcopy(extras), later),
                name=f"ckpt-save-step-{step}",
                daemon=False,
            )
            self._thread, self._step, self._result, self._error = thread, step, None, None
            try:
                thread.start()
            except BaseException:
                self._thread = None
                if self._gate is not None:
                    self._gate.open()  # no writer will copy: steps must not wait for one
                raise

    def wait(self) -> Path | None:
        """Block until the save in flight is published (or failed).

        Returns:
            The published ``step-XXXXXXXX`` folder, or ``None`` when no save
            was pending.

        Raises:
            CheckpointError: The background save failed. Checkpoint errors are
                re-raised as they are; anything else (an ``OSError`` such as a
                full disk) is wrapped in a ``CheckpointError`` naming the step,
                with the original as ``__cause__``. Either way nothing was
                published for that step.
        """
        self._refuse_writer_thread("wait")
        with self._lock:
            return self._wait_locked()

    def close(self) -> None:
        """Wait for the save in flight, unregister the step hook, and free the snapshot buffers.

        The buffers are a full copy of the training state, kept only to be refilled by
        the next save; after ``close`` a save allocates them again.

        Raises its error like :meth:`wait`.
        """
        try:
            self.wait()
        finally:
            self._buffers, self._payload_buffers = None, None  # the writer is joined: nothing reads them
            if self._gate is not None:
                self._gate.remove()
                self._waited_before += self._gate.waited_s
                self._gate = None

    # ------------------------------------------------------------------ internals

    def _refuse_writer_thread(self, what: str) -> None:
        if self._thread is not None and threading.current_thread() is self._thread:
            raise CheckpointError(
                f"{what}() called from the checkpoint writer thread (step {self._step}), e.g. from an "
                "on_event hook; that would wait for itself. Call it from the training thread."
            )

    def _deferred(self, args: tuple[Any, ...]) -> DeferredCopies | None:
        """With ``overlap_copy``, the collector of this save's deferred copies (and the hook, once)."""
        if not self.overlap_copy:
            return None
        if self._gate is None:
            self._gate = StepGate()
        live = args[1].values() if is_state_call(args) and isinstance(args[1], Mapping) else args[:2]
        return DeferredCopies(live, parameters=self.overlap_copy is True)

    def _write(
        self, snapshot: Any, step: int, extras: dict[str, Any] | None, later: DeferredCopies | None
    ) -> None:
        try:
            try:  # first the copies the training thread left: its next optimizer step waits for them
                if later is not None:
                    later.run(step)
            finally:
                if self._gate is not None:
                    self._gate.open()
            # Inside the try: an error here must reach the training thread like any other (a failed
            # priority change itself is only a warning; see async_report.py).
            lower_writer_priority(self.writer_nice)
            if isinstance(snapshot, dict):  # a state-API payload, already copied
                self._result = self.manager.save_payload(snapshot)
            else:
                s = snapshot
                self._result = self.manager.save(
                    s.model, s.optimizer, s.scheduler, s.state, rng=s.rng, extras=extras
                )
        except BaseException as exc:  # kept for the training thread, which alone can act on it
            self._error = exc
            note_failure(step, exc)  # reported at exit if nobody asks before then

    def _wait_locked(self) -> Path | None:
        thread = self._thread
        if thread is None:
            return None
        thread.join()
        step, result, error = self._step, self._result, self._error
        self._thread, self._step, self._result, self._error = None, None, None, None
        forget_failure(thread)  # raised just below: the exit report has nothing left to say
        if error is None:
            return result
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(
            f"asynchronous save of step {step} failed in the background: {type(error).__name__}: {error}. "
            "Nothing was published for that step; older saves are intact. Fix the cause and save again."
        ) from error
