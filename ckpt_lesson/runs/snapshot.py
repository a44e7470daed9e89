"""The snapshot an asynchronous save writes: every bucket copied at one instant.

:class:`~ckpt_lesson.runs.async_save.AsyncCheckpointer` takes one of these on the
training thread and hands it to its writer thread. The copy is what the training
thread pays for (the "stall"), so once the previous save has finished, the next
snapshot refills its buffers wherever shapes, dtypes and strides still fit
(pinned CPU memory for CUDA tensors, so the copy is a fast DMA): a copy into
memory already touched, instead of a fresh allocation that the kernel must zero
page by page (the stall measured 0.19 s for a 400 MB state; refilling kept
buffers, 0.044 s). Every tensor is overwritten with the new values or freshly
allocated; nothing of one save can survive into the next.

Copied at memory speed, the snapshot still costs about a tenth of a synchronous
save here, and it grows with the model. Most of those bytes are optimizer
moments and parameters (AdamW keeps two moments per parameter: two thirds of the
state). In an ordinary loop only one thing changes them: the optimizer's
``step()``. The forward and backward passes of the next step only *read* them.
So the snapshot copies everything else on the training thread (buffers such as
batch-norm statistics, which a forward pass does change; the RNG; plain values;
small tensors) and leaves the large tensors (:class:`DeferredCopies`) to the
writer thread, which copies them first, while training runs the next forward and
backward. A global optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``, :class:`StepGate`)
holds every optimizer's ``step()`` until those copies are done, so no step can
change a tensor before it is copied.

How much is deferred is ``AsyncCheckpointer(overlap_copy=...)``:

* ``"optimizer"`` (the default): optimizer state only. Nothing but ``step()``
  writes the moments in real loops (and ``load_state_dict`` replaces them
  rather than writing into them), so the contract below is one they keep.
* ``True``: parameters too. Loops do write parameters outside the optimizer
  (weight clamping, a manual decay before ``step()``, loading weights), so this
  is for loops known not to.
* ``False``: everything is copied on the training thread.

The contract that makes deferral safe: between ``save_async`` returning and
the next optimizer step, nothing changes a deferred tensor in place. A breach
through an ordinary in-place op bumps the tensor's version counter, and the
writer refuses the save when a version moved while it copied (the error names
the fix). Writes through ``.data`` bypass version counters and cannot be seen;
that is why parameters are not deferred by default.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.files.payload import optimizer_state_with_bindings, validate_payload
from ckpt_lesson.files.rng import capture_rng_state, validate_rng_state
from ckpt_lesson.files.train_state import model_state
from ckpt_lesson.short_repr import short_repr

__all__ = ["DeferredCopies", "StepGate", "TrainingSnapshot", "snapshot_payload"]

#: Tensors smaller than this are copied on the training thread: deferring them saves nothing.
MIN_DEFERRED_BYTES = 1 << 20


class DeferredCopies:
    """The (buffer, source) pairs one snapshot leaves for the writer thread.

    Only tensors on the storages that nothing but an optimizer step changes are
    deferred: optimizer state tensors, and (``parameters=True``) module parameters.

    Args:
        objects: The live objects of one save (modules, optimizers, anything else is ignored).
        parameters: Defer module parameters too; ``False`` keeps optimizer state only.

    Example:
        >>> later = DeferredCopies([torch.nn.Linear(1024, 1024), "not a module"])
        >>> len(later.stepped)  # the weight's and the bias's storages
        2
        >>> later.wants(torch.zeros(1024, 1024))  # not a parameter: copied now
        False
    """

    def __init__(self, objects: Iterable[Any], *, parameters: bool = True) -> None:
        self.stepped: set[int] = set()  # the data_ptr() of each such tensor's storage
        for obj in objects:
            if isinstance(obj, torch.nn.Module) and parameters:
                self.stepped.update(p.untyped_storage().data_ptr() for p in obj.parameters())
            elif isinstance(obj, torch.optim.Optimizer):
                for per_param in obj.state.values():
                    for value in per_param.values():
                        if isinstance(value, torch.Tensor):
                            self.stepped.add(value.untyped_storage().data_ptr())
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._versions: list[int] = []  # each source's version counter when it was handed over

    def wants(self, src: torch.Tensor) -> bool:
        """True for a large CPU tensor that only an optimizer step changes."""
        return (
            src.device.type == "cpu"
            and src.nbytes >= MIN_DEFERRED_BYTES
            and src.untyped_storage().data_ptr() in self.stepped
        )

    def add(self, buffer: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Remember to copy ``src`` into ``buffer``; returns ``buffer`` (filled later)."""
        self.pairs.append((buffer, src))
        self._versions.append(src._version)
        return buffer

    def run(self, step: int | None = None) -> None:
        """Copy every deferred tensor (the writer thread calls this before it writes).

        Args:
            step: The save's step, named in the error.

        Raises:
            CheckpointError: A source's version counter moved since :meth:`add`: something
                wrote it in place before its copy was finished, so the copy may hold values
                of two moments. Nothing may be saved from it.
        """
        pairs, versions = self.pairs, self._versions
        self.pairs, self._versions = [], []
        for buffer, src in pairs:
            buffer.copy_(src)
        for (_, src), before in zip(pairs, versions, strict=True):
            if src._version != before:
                raise CheckpointError(
                    f"step {step}: a tensor of shape {tuple(src.shape)} (a parameter or optimizer "
                    "state) was written in place after save_async returned and before the writer "
                    "had copied it, and not by an optimizer step (those wait); the snapshot would "
                    "mix two moments, so nothing was saved. Pass overlap_copy=False to "
                    "AsyncCheckpointer for a loop that changes these tensors outside step()."
                )


class StepGate:
    """A global optimizer-step pre-hook that holds every ``step()`` while copies are pending.

    Open by default; :meth:`shut` before handing copies to the writer, which
    :meth:`open` s it when they are done (also when they fail). :meth:`remove`
    unregisters the hook.

    Example:
        >>> gate = StepGate()
        >>> gate.pending
        False
        >>> gate.remove()
    """

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.waited_s = 0.0  # seconds optimizer steps have spent held here, in total
        self._handle = register_optimizer_step_pre_hook(self._hook)

    @property
    def pending(self) -> bool:
        """True while an optimizer step would wait for the writer's copies."""
        return not self._open.is_set()

    def shut(self) -> None:
        """Hold optimizer steps from now until :meth:`open`."""
        self._open.clear()

    def open(self) -> None:
        """Let optimizer steps run again."""
        self._open.set()

    def remove(self) -> None:
        """Open the gate for good and unregister the hook."""
        self._open.set()
        self._handle.remove()

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._open.is_set():
            return
        start = time.perf_counter()
        self._open.wait()
        self.waited_s += time.perf_counter() - start


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


def _copy_tree(value: Any, old: Any = None, later: DeferredCopies | None = None) -> Any:
    """Copy a state_dict-like tree into CPU memory of its own.

    A tensor of ``old`` (the previous snapshot's tree) at the same place is refilled when it
    :func:`_fits`; ``later`` takes the large tensors it wants for the writer thread.
    """
    if isinstance(value, torch.Tensor):
        src = value.detach()
        buffer = old if _fits(old, src) else _new_buffer(src)
        if later is not None and later.wants(src):
            return later.add(buffer, src)
        return buffer.copy_(src, non_blocking=src.device.type == "cuda")
    if isinstance(value, dict):
        prev = old if isinstance(old, dict) else {}
        out = OrderedDict() if isinstance(value, OrderedDict) else {}
        for key, item in value.items():
            out[key] = _copy_tree(item, prev.get(key), later)
        if hasattr(value, "_metadata"):  # module versions, used by load_state_dict
            out._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(value, (list, tuple)):
        prev = old if isinstance(old, (list, tuple)) and len(old) == len(value) else [None] * len(value)
        items = [_copy_tree(item, before, later) for item, before in zip(value, prev, strict=True)]
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

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

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
        rng: dict[str, Any] | None = None,
        later: DeferredCopies | None = None,
    ) -> TrainingSnapshot:
        """Copy the training state now, on the calling thread.

        Args:
            model: The live model.
            optimizer: The live optimizer.
            scheduler: The live scheduler, or ``None``.
            state: The live counters and losses.
            rng: Generator state captured earlier (before a prefetch); ``None`` captures it now.
            reuse: A previous snapshot that nothing reads any more (its save
                has finished): its tensor buffers are overwritten and reused.
                Passing one still in use would change that save's values.
            later: Takes the large parameter and moment tensors, to be copied
                on the writer thread before anything reads the snapshot.

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
        if rng is not None:
            validate_rng_state(rng)  # refused here, on the training thread, not in the background
        model_sd = model_state(model)  # canonical keys, as a synchronous save writes them
        optimizer_sd = optimizer_state_with_bindings(model, optimizer)
        # Checked before copying: a meta tensor cannot even be copied, and a value a weights-only
        # load refuses must fail here, on the training thread, not later in the background.
        validate_payload(model_sd, where="model")
        validate_payload(optimizer_sd, where="optimizer")

        def old(part: _FrozenState | None) -> Any:
            return part.state_dict() if part is not None else None

        snapshot = cls(
            model=_FrozenState(_copy_tree(model_sd, old(reuse and reuse.model), later)),
            optimizer=_FrozenState(_copy_tree(optimizer_sd, old(reuse and reuse.optimizer), later)),
            scheduler=None
            if scheduler is None
            else _FrozenState(_copy_tree(scheduler.state_dict(), old(reuse and reuse.scheduler))),
            state=dataclasses.replace(state, losses=list(state.losses)),
            # capture_rng_state already copies; a state the caller captured earlier is copied here.
            rng=capture_rng_state() if rng is None else _copy_tree(rng),
        )
        _sync_if_cuda()
        return snapshot


def snapshot_payload(
    payload: dict[str, Any], *, reuse: dict[str, Any] | None = None, later: DeferredCopies | None = None
) -> dict[str, Any]:
    """A state-API payload copied into memory of its own (tensors, values and RNG), now.

    ``build_state_payload`` returns the parts' live tensors; an asynchronous save
    must write the values of *this* moment, so every part, plain value and the
    RNG block is copied before the training thread moves on. ``reuse`` is a
    previous copy that nothing reads any more: its buffers are refilled.
    ``later`` takes the large parameter and moment tensors for the writer thread.

    Example:
        >>> from ckpt_lesson.files.payload import build_state_payload
        >>> live = torch.zeros(2)
        >>> copy = snapshot_payload(build_state_payload(1, {"x": live}, rng=False))
        >>> _ = live.add_(1); copy["values"]["x"].tolist()
        [0.0, 0.0]
    """
    old = reuse or {}
    out = dict(payload)
    for key in ("objects", "values", "rng"):
        out[key] = _copy_tree(payload[key], old.get(key), later)
    _sync_if_cuda()
    return out
