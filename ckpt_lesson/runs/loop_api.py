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
``should_save(step)`` then ``save(step, state)``; the rules of those two hold unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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

        Args:
            state: The parts by name, as a mapping; or give them as keywords (or both: the
                keywords are added to the mapping).
            **parts: More parts by name, e.g. ``model=model, optimizer=opt, best=float("inf")``.

        Returns:
            ``(step, state)``: the step of the save restored (``0`` on a first run, when the
            folder holds no save), and the state dict to hand to :meth:`save_if_due`. The
            ``Restored`` itself (path, skipped saves) is kept in ``self.restored``.

        Raises:
            CheckpointError: No parts given, a name given twice, or anything
                :meth:`restore_latest` refuses (a part missing on either side, saves that
                exist but none usable), named there.

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
        self.restored = self.restore_latest(given)  # type: ignore[attr-defined]
        if self.restored is None:
            return 0, given
        return self.restored.step, {**given, **self.restored.values}

    def save_if_due(self, step: int, state: Mapping[str, Any], *, rng: Any = None) -> Path | None:
        """Save ``state`` after ``step`` when the cadence (``every_steps``/``every_seconds``) says so.

        Args:
            step: The steps done so far (the step just finished).
            state: The parts by name, as for :meth:`save`.
            rng: As for :meth:`save`: ``None`` (or ``True``) captures the generators now; a dict from
                ``capture_rng_state()`` taken before a prefetch is saved as given.

        Returns:
            The published save (as :meth:`save` returns it), or ``None`` when no save was due.

        Raises:
            CheckpointError: Whatever :meth:`save` raises.

        Example:
            >>> mgr.save_if_due(step, state)  # doctest: +SKIP
        """
        if not self.should_save(step):  # type: ignore[attr-defined]
            return None
        return self.save(step, state, rng=rng)  # type: ignore[attr-defined]
