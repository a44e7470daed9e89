"""Two verbs for a training loop: ``resume`` (restore, say where to start) and ``save_if_due``.

Adding checkpoints to a loop took six to eight lines with ``restore_latest`` and ``save``
alone: the state dict, the restore, ``restored.step if restored is not None else 0``, the
cadence check and the save. Those are the same in every loop, so the managers share these two
methods (issue 35: a common loop resumable in five changed lines)::

    mgr = cl.CheckpointManager(every_steps=10)  # $CKPT_LESSON_CKPT_DIR, else checkpoints/
    start, state = mgr.resume(model=model, optimizer=optimizer, scaler=scaler)
    for step in range(start + 1, steps + 1):
        ...
        mgr.save_if_due(step, state)

A manager given no folder saves into ``$CKPT_LESSON_CKPT_DIR`` when it is set (``resume-test``
sets it), else into ``checkpoints`` (:func:`default_run_dir`), so the loop needs no ``os`` import
and no flag to be tested.

They are thin on purpose: ``resume`` is ``restore_latest(state)`` and ``save_if_due`` is
``should_save(step)`` then ``save(step, state)``; the rules of those two hold unchanged. Each adds
one thing a loop would otherwise spell out in a line of its own (a tensor value restored in place;
a close after the last step), told in its docstring.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.storage import is_store_url
from ckpt_lesson.runs.steplog import CKPT_DIR_ENV

__all__ = ["DEFAULT_RUN_DIR", "LoopMethods", "default_run_dir"]

#: The folder a manager saves into when given none and ``$CKPT_LESSON_CKPT_DIR`` is unset.
DEFAULT_RUN_DIR = "checkpoints"


def default_run_dir(run_dir: str | os.PathLike[str] | None) -> str | os.PathLike[str]:
    """``run_dir`` if given, else ``$CKPT_LESSON_CKPT_DIR`` if set (resume-test sets it), else checkpoints.

    A folder given explicitly always wins: the variable never moves a save the script named.

    Raises:
        CheckpointError: ``run_dir`` is None and the variable holds a URL (a store manager
            takes its URL explicitly, with its storage options).

    Example:
        >>> default_run_dir("runs/a")
        'runs/a'
    """
    if run_dir is not None:
        return run_dir
    value = os.environ.get(CKPT_DIR_ENV) or DEFAULT_RUN_DIR
    if is_store_url(value):
        raise CheckpointError(
            f"${CKPT_DIR_ENV}={value} is a URL; pass it to the manager explicitly, "
            f"e.g. CheckpointManager(os.environ[{CKPT_DIR_ENV!r}])."
        )
    return value


class LoopMethods:
    """``resume`` and ``save_if_due`` for a manager with ``restore_latest``, ``should_save``, ``save``."""

    #: What the last :meth:`resume` restored (a ``Restored``), or ``None`` on a first run.
    restored: Any = None

    def resume(self, state: Mapping[str, Any] | None = None, /, **parts: Any) -> tuple[int, dict[str, Any]]:
        """Build the training state, restore the newest verified save into it, and say where to start.

        Objects (anything with ``state_dict``/``load_state_dict``) are restored in place, the
        generators too, exactly as :meth:`restore_latest` does. Plain values come back in the
        returned state: a first run keeps the values given, a resumed run gets the saved ones.
        A tensor value, or a tuple or list of tensors (an LSTM's ``(h, c)``), is also restored
        in place (``copy_``, as DCP's ``load`` does): the objects given come back in the state,
        holding the saved values.

        Args:
            state: The parts by name, as a mapping; or give them as keywords (or both: the
                keywords are added to the mapping).
            **parts: More parts by name, e.g. ``model=model, optimizer=opt, best=float("inf")``.

        Returns:
            ``(step, state)``: the step of the save restored (``0`` on a first run, when the
            folder holds no save), and the state dict to hand to :meth:`save_if_due`. The
            ``Restored`` itself (path, skipped saves) is kept in ``self.restored``.

        Raises:
            CheckpointError: No parts given, a name given twice, a tensor value whose shape,
                dtype or nesting differs from the saved one (checked before anything is restored), or
                anything :meth:`restore_latest` refuses (a part missing on either side, saves
                that exist but none usable), named there.

        Example:
            >>> start, state = mgr.resume(model=model, optimizer=opt)  # doctest: +SKIP
            >>> for step in range(start + 1, 1001): ...  # doctest: +SKIP
        """
        given = dict(state or {})
        twice = sorted(set(given) & set(parts))
        if twice:
            raise CheckpointError(f"resume: {twice} given in the mapping and as keywords; give each once.")
        given.update(parts)
        if not given:
            raise CheckpointError("resume: no parts to restore; pass them by name, e.g. resume(model=model).")
        in_place: dict[str, list[tuple[torch.Tensor, Any]]] = {}

        def check_values(values: dict[str, Any], step: int) -> None:
            # Called before the restore applies anything, so a tensor value that does not fit
            # refuses the save with the model, optimizer and RNG untouched: all of them, or none.
            found = {
                name: _tensor_pairs(name, given[name], values[name], step) for name in values if name in given
            }
            in_place.clear()  # a damaged newer save may have been checked before this one
            in_place.update((name, pairs) for name, pairs in found.items() if pairs is not None)

        self.restored = self.restore_latest(given, check_values=check_values)  # type: ignore[attr-defined]
        if self.restored is None:
            return 0, given
        with torch.no_grad():
            for target, saved in (pair for pairs in in_place.values() for pair in pairs):
                target.copy_(saved)
        return self.restored.step, {
            **given,
            **self.restored.values,
            **{name: given[name] for name in in_place},
        }

    def save_if_due(
        self, step: int, state: Mapping[str, Any], *, rng: Any = None, last_step: int | None = None
    ) -> Path | None:
        """Save ``state`` after ``step`` when the cadence (``every_steps``/``every_seconds``) says so.

        Args:
            step: The steps done so far (the step just finished).
            state: The parts by name, as for :meth:`save`.
            rng: As for :meth:`save`: ``None`` (or ``True``) captures the generators now; a dict from
                ``capture_rng_state()`` taken before a prefetch is saved as given.
            last_step: The run's last step. At it (or past it) the save is due whatever the
                cadence, and the manager is closed after it (:meth:`close`: background work
                waited for; a distributed manager frees its process groups, so
                ``dist.destroy_process_group()`` may follow). A run restarted after its last
                save runs no step, so nothing here closes it: the process ending does.

        Returns:
            The published save (as :meth:`save` returns it), or ``None`` when no save was due.

        Raises:
            CheckpointError: Whatever :meth:`save` raises (a manager closed at ``last_step``
                refuses later saves).

        Example:
            >>> mgr.save_if_due(step, state, last_step=1000)  # doctest: +SKIP
        """
        due = self.should_save(step)  # type: ignore[attr-defined]  # first: may be a collective
        last = last_step is not None and step >= last_step
        if not (due or last):
            return None
        path = self.save(step, state, rng=rng)  # type: ignore[attr-defined]
        if last:
            self.close()  # type: ignore[attr-defined]
        return path


def _is_tensors(value: Any) -> bool:
    """A tensor, or a non-empty tuple/list (nested) holding only tensors: restored in place."""
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(_is_tensors(v) for v in value)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {value.dtype} tensor"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _tensor_pairs(name: str, given: Any, saved: Any, step: int) -> list[tuple[torch.Tensor, Any]] | None:
    """``(target, saved)`` for each tensor of a tensor value given to ``resume``; None: not tensors.

    The saved value must have the same nesting and each tensor the same shape and dtype (nothing
    is cast); two given tensors may not share memory (the second copy would overwrite the first).
    """
    if not _is_tensors(given):
        return None
    pairs: list[tuple[torch.Tensor, Any]] = []
    todo = [(given, saved, name)]
    while todo:
        mine, theirs, where = todo.pop()
        alike = isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)
        if alike and (mine.shape, mine.dtype) == (theirs.shape, theirs.dtype):
            pairs.append((mine, theirs))
        elif (
            not isinstance(mine, torch.Tensor)
            and isinstance(theirs, (tuple, list))
            and len(theirs) == len(mine)
        ):
            todo.extend((m, t, f"{where}[{i}]") for i, (m, t) in enumerate(zip(mine, theirs, strict=True)))
        else:
            raise CheckpointError(
                f"resume: {where} is {_describe(mine)}, the save of step {step} holds {_describe(theirs)}; "
                f"a tensor value is restored in place: pass {name!r} as saved, or leave it out of resume()."
            )
    starts = [target.untyped_storage().data_ptr() for target, _ in pairs if target.numel()]
    if len(set(starts)) != len(starts):
        raise CheckpointError(
            f"resume: two tensors of {name!r} share memory, so one copy would overwrite the other; "
            "give each its own tensor (e.g. torch.zeros twice, not one tensor twice)."
        )
    return pairs
