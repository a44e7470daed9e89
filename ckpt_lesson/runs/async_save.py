"""Asynchronous saves: the training thread pays for a memory copy, a thread writes the bytes.

A save has two halves. *Reading* the training state is a memory copy
(milliseconds); *writing* it (serialize, hash, fsync, verify, publish) is disk
time (seconds for a real model). Only the first has to stop training, so an
:class:`AsyncCheckpointer` does:

1. **Snapshot, synchronously.** :meth:`TrainingSnapshot.capture` copies every
   tensor of the three ``state_dict()``\\ s to CPU memory of its own, copies the
   :class:`~ckpt_lesson.files.checkpoint.TrainState`, and captures the generators
   *now*. When it returns, the snapshot shares no memory with the live objects.
2. **Write, in the background.** One thread runs the manager's full commit
   protocol (:meth:`CheckpointManager.save <ckpt_lesson.runs.manager.CheckpointManager.save>`)
   on the snapshot, passing ``rng=snapshot.rng``, while training continues.

Why the generators are captured at the snapshot: the next training steps draw
dropout masks and input jitter. A state captured when the thread gets round to
writing would describe some later step, and a resume would continue with the
wrong random numbers, plausibly but not identically.

Why the snapshot buffers are kept between saves: allocating a fresh copy of
the whole state on every save costs page faults on every byte (the stall
measured 0.19 s for a 400 MB state; refilling kept buffers, 0.044 s). Once
the previous save has finished, its buffers are free, so the next snapshot
copies into them (pinned memory when the tensors live on a GPU, so the copy
is a fast DMA). A tensor whose shape, dtype or strides changed gets a new
buffer. Every tensor is overwritten with the new values or freshly allocated;
nothing of one save can survive into the next.

Why at most one save is in flight: each snapshot is a full copy of the
training state, so a queue of them is unbounded memory; one in flight means at
most one extra copy. It also publishes saves in step order and never runs the
manager's ``save`` twice at once. So :meth:`~AsyncCheckpointer.save_async`
first waits for the previous save, *then* takes its snapshot.

Why errors surface on the training thread: an exception in a background thread
only prints a traceback; the run would carry on believing it is protected. The
error is kept and re-raised by the next :meth:`~AsyncCheckpointer.save_async`
or :meth:`~AsyncCheckpointer.wait` (and by leaving the ``with`` block). A
failed save publishes nothing; the older saves stay intact.

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
import dataclasses
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.files.payload import optimizer_state_with_bindings, validate_payload
from ckpt_lesson.files.rng import capture_rng_state
from ckpt_lesson.runs.manager import CheckpointManager

__all__ = ["AsyncCheckpointer", "TrainingSnapshot"]

log = logging.getLogger(__name__)


def _fits(buffer: Any, src: torch.Tensor) -> bool:
    """True when ``buffer`` (from the previous snapshot) can take ``src``'s values in place."""
    return (
        isinstance(buffer, torch.Tensor)
        and buffer.device.type == "cpu"
        and buffer.layout == src.layout == torch.strided
        and buffer.dtype == src.dtype
        and buffer.shape == src.shape
        and buffer.stride() == src.stride()
        and buffer.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    )


def _new_buffer(src: torch.Tensor) -> torch.Tensor:
    if src.is_contiguous() and src.layout == torch.strided:
        # Pinned (page-locked) host memory when the source is on a GPU: the copy runs as DMA.
        pin = src.device.type == "cuda"
        return torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
    return torch.empty_like(src, device="cpu")


def _copy_tree(value: Any, old: Any = None) -> Any:
    """Copy a state_dict-like tree into CPU memory of its own.

    ``old`` is the previous snapshot's tree: a tensor at the same place with
    the same shape, dtype and strides is overwritten in place instead of
    allocating a new one. Everything else is copied fresh.
    """
    if isinstance(value, torch.Tensor):
        src = value.detach()
        buffer = old if _fits(old, src) else _new_buffer(src)
        return buffer.copy_(src, non_blocking=src.device.type == "cuda")
    if isinstance(value, dict):
        prev = old if isinstance(old, dict) else {}
        out = OrderedDict() if isinstance(value, OrderedDict) else {}
        for key, item in value.items():
            out[key] = _copy_tree(item, prev.get(key))
        if hasattr(value, "_metadata"):  # module versions, used by load_state_dict
            out._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(value, (list, tuple)):
        prev = old if isinstance(old, (list, tuple)) and len(old) == len(value) else [None] * len(value)
        items = [_copy_tree(item, before) for item, before in zip(value, prev, strict=True)]
        return items if isinstance(value, list) else tuple(items)
    return copy.deepcopy(value)


def _sync_if_cuda() -> None:
    # non_blocking copies from a GPU are only finished once the device is synchronized.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _FrozenState:
    """Read-only stand-in for a model/optimizer/scheduler: ``state_dict()`` is all a save calls.

    It returns the snapshot's copy itself: only the writer reads it, nobody mutates it.
    """

    __slots__ = ("_state",)

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


@dataclass(frozen=True)
class TrainingSnapshot:
    """Everything one save needs, copied at one moment and sharing no memory with training.

    Attributes:
        model, optimizer: Stand-ins whose ``state_dict()`` returns the copy.
        scheduler: Likewise, or ``None`` when the run has no scheduler.
        state: A copy of the :class:`~ckpt_lesson.files.checkpoint.TrainState`.
        rng: The generators, from :func:`~ckpt_lesson.files.rng.capture_rng_state`.
    """

    model: _FrozenState
    optimizer: _FrozenState
    scheduler: _FrozenState | None
    state: TrainState
    rng: dict[str, Any]

    @classmethod
    def capture(
        cls,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        state: TrainState,
        *,
        reuse: TrainingSnapshot | None = None,
    ) -> TrainingSnapshot:
        """Copy the training state now, on the calling thread.

        Args:
            model, optimizer, scheduler: The live training objects
                (``scheduler`` may be ``None``).
            state: The live counters and losses.
            reuse: A previous snapshot that nothing reads any more (its save
                has finished): its tensor buffers are overwritten and reused.
                Passing one still in use would change that save's values.

        Returns:
            A snapshot; the live objects may change as soon as this returns.

        Raises:
            CheckpointError: ``state`` is not a ``TrainState``.

        Example:
            >>> s = TrainingSnapshot.capture(model, opt, sched, state)  # doctest: +SKIP
            >>> mgr.save(s.model, s.optimizer, s.scheduler, s.state, rng=s.rng)  # doctest: +SKIP
        """
        if not isinstance(state, TrainState):
            raise CheckpointError(f"state must be a TrainState, got {type(state).__name__}.")
        model_sd = model.state_dict()
        optimizer_sd = optimizer_state_with_bindings(model, optimizer)
        # Checked before copying: a meta tensor cannot even be copied, and a value a weights-only
        # load refuses must fail here, on the training thread, not later in the background.
        validate_payload(model_sd, where="model")
        validate_payload(optimizer_sd, where="optimizer")

        def old(part: _FrozenState | None) -> Any:
            return part.state_dict() if part is not None else None

        snapshot = cls(
            model=_FrozenState(_copy_tree(model_sd, old(reuse and reuse.model))),
            optimizer=_FrozenState(_copy_tree(optimizer_sd, old(reuse and reuse.optimizer))),
            scheduler=None
            if scheduler is None
            else _FrozenState(_copy_tree(scheduler.state_dict(), old(reuse and reuse.scheduler))),
            state=dataclasses.replace(state, losses=list(state.losses)),
            rng=capture_rng_state(),  # already copies: tensors cloned, the rest plain values
        )
        _sync_if_cuda()
        return snapshot


class AsyncCheckpointer:
    """Save through a :class:`~ckpt_lesson.runs.manager.CheckpointManager` without stopping training.

    One training thread calls it; at most one save is in flight (see the
    module docstring). Closing the checkpointer waits for that save; it does
    not close the manager.

    Args:
        manager: Where saves go; its full commit protocol runs on the writer thread.

    Example:
        >>> ckpt = AsyncCheckpointer(mgr)  # doctest: +SKIP
        >>> ckpt.save_async(model, opt, sched, state)  # doctest: +SKIP
        >>> ckpt.wait().name  # doctest: +SKIP
        'step-00000240'
    """

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager
        self._lock = threading.Lock()  # serializes callers; the writer never takes it
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None
        # The last snapshot, kept for its buffers; only touched after its save has finished.
        self._buffers: TrainingSnapshot | None = None

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

    def save_async(self, model: Any, optimizer: Any, scheduler: Any, state: TrainState) -> None:
        """Wait for the previous save, snapshot the state now, and write it in the background.

        Returns once the snapshot is taken; the live objects may then change freely.

        Raises:
            CheckpointError: The previous background save failed (re-raised
                here; this call then saves nothing, so call again to retry),
                ``state`` is not a ``TrainState``, the manager is closed, a value
                could not be loaded back (meta tensors, NumPy arrays), or the call comes from the
                writer thread itself (e.g. an ``on_event`` hook), which would
                deadlock waiting for itself.
        """
        self._refuse_writer_thread("save_async")
        self.manager.check_open()  # a closed manager must refuse now, not in the background
        with self._lock:
            self._wait_locked()
            # _wait_locked joined the previous writer, so its snapshot's buffers are free to refill.
            snapshot = TrainingSnapshot.capture(model, optimizer, scheduler, state, reuse=self._buffers)
            self._buffers = snapshot
            step = snapshot.state.step
            thread = threading.Thread(
                target=self._write, args=(snapshot,), name=f"ckpt-save-step-{step}", daemon=False
            )
            self._thread, self._step, self._result, self._error = thread, step, None, None
            thread.start()

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
        """Wait for the save in flight; raises its error like :meth:`wait`."""
        self.wait()

    # ------------------------------------------------------------------ internals

    def _refuse_writer_thread(self, what: str) -> None:
        if self._thread is not None and threading.current_thread() is self._thread:
            raise CheckpointError(
                f"{what}() called from the checkpoint writer thread (step {self._step}), e.g. from an "
                "on_event hook; that would wait for itself. Call it from the training thread."
            )

    def _write(self, snapshot: TrainingSnapshot) -> None:
        try:
            self._result = self.manager.save(
                snapshot.model, snapshot.optimizer, snapshot.scheduler, snapshot.state, rng=snapshot.rng
            )
        except BaseException as exc:  # kept for the training thread, which alone can act on it
            self._error = exc

    def _wait_locked(self) -> Path | None:
        thread = self._thread
        if thread is None:
            return None
        thread.join()
        step, result, error = self._step, self._result, self._error
        self._thread, self._step, self._result, self._error = None, None, None, None
        if error is None:
            return result
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(
            f"asynchronous save of step {step} failed in the background: {type(error).__name__}: {error}. "
            "Nothing was published for that step; older saves are intact. Fix the cause and save again."
        ) from error
