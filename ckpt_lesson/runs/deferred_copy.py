"""The copies an overlapped asynchronous snapshot leaves to the writer thread, and their gate.

An asynchronous save must write the values of one instant, so its snapshot is a
copy. Copying is what the training thread pays for: at memory speed it is about
a tenth of a synchronous save here, and it grows with the model.

Most of those bytes are optimizer moments and parameters (AdamW keeps two
moments per parameter: two thirds of the state). In an ordinary loop only one
thing changes them: the optimizer's ``step()``. The forward and backward passes
of the next step only *read* them. So the snapshot copies everything else on the
training thread (buffers such as batch-norm statistics, which a forward pass
does change; the RNG; plain values; small tensors) and leaves the large tensors
to the writer thread, which copies them first, while training runs the next
forward and backward. A global optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) holds every
optimizer's ``step()`` until those copies are done, so no step can change a
tensor before it is copied.

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

import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ckpt_lesson.errors import CheckpointError

__all__ = ["MIN_DEFERRED_BYTES", "DeferredCopies", "StepGate", "stepped_storages"]

#: Tensors smaller than this are copied on the training thread: deferring them saves nothing.
MIN_DEFERRED_BYTES = 1 << 20


def stepped_storages(objects: Iterable[Any], *, parameters: bool = True) -> set[int]:
    """The storages only an optimizer step changes: optimizer state tensors, and module parameters.

    Args:
        objects: The live objects of one save (modules, optimizers, anything else is ignored).
        parameters: Include module parameters; ``False`` keeps optimizer state only.

    Returns:
        The ``data_ptr()`` of each such tensor's storage.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> len(stepped_storages([model, "not a module"]))
        2
    """
    found: set[int] = set()
    for obj in objects:
        if isinstance(obj, torch.nn.Module) and parameters:
            found.update(p.untyped_storage().data_ptr() for p in obj.parameters())
        elif isinstance(obj, torch.optim.Optimizer):
            for per_param in obj.state.values():
                for value in per_param.values():
                    if isinstance(value, torch.Tensor):
                        found.add(value.untyped_storage().data_ptr())
    return found


class DeferredCopies:
    """The (buffer, source) pairs one snapshot leaves for the writer thread.

    Args:
        stepped: Storages from :func:`stepped_storages`; only tensors on them are deferred.

    Example:
        >>> later = DeferredCopies(stepped_storages([torch.nn.Linear(1024, 1024)]))
        >>> later.wants(torch.zeros(1024, 1024))  # not a parameter: copied now
        False
    """

    def __init__(self, stepped: set[int]) -> None:
        self.stepped = stepped
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
