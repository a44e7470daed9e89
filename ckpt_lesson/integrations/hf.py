"""A Hugging Face ``Trainer`` callback: a ``checkpoint-N`` folder counts only once its manifest exists.

The stock ``Trainer`` writes a checkpoint's files straight into
``output_dir/checkpoint-N`` (weights, ``optimizer.pt``, ``scheduler.pt``,
``rng_state.pth``, ``trainer_state.json``), one after another, without fsync.
``transformers.trainer_utils.get_last_checkpoint`` (read in transformers 5.24)
returns the highest-numbered such folder without opening a file in it. A kill
half-way through a save leaves exactly that folder, and the next
``resume_from_checkpoint=get_last_checkpoint(...)`` picks it.

:class:`VerifiedCheckpointCallback` runs after every save (``on_save``, which
the Trainer calls once the folder is written) and records
``ckpt_lesson_manifest.json`` in it with every file's size and digest, having
fsynced the files and the folder (see :mod:`ckpt_lesson.runs.folder_manifest`).
:func:`latest_verified_checkpoint` returns the newest folder whose manifest
verifies, logging why newer ones were skipped.

Where: the Trainer's ``output_dir`` (its default is ``trainer_output``), or
``$CKPT_LESSON_CKPT_DIR`` when that is set (``resume-test`` sets it): the
callback points the Trainer there when the Trainer is built (``on_init_end``),
and ``latest_verified_checkpoint()`` looks in the same place, so a script is
tested without a flag or a path of its own.

One caveat, from the Trainer's order of work: with ``save_total_limit`` the
Trainer deletes old folders *before* ``on_save`` runs, so the newest verified
folder can be deleted while the newest folder is still unrecorded. Keep
``save_total_limit`` at 2 or more (or unset) so a verified folder always remains.

Example:
    >>> callbacks = [VerifiedCheckpointCallback()]
    >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=callbacks)  # doctest: +SKIP
    >>> trainer.train(resume_from_checkpoint=latest_verified_checkpoint())  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.runs.folder_manifest import latest_verified_folder, write_folder_manifest
from ckpt_lesson.runs.steplog import CKPT_DIR_ENV

__all__ = ["VerifiedCheckpointCallback", "latest_verified_checkpoint"]

log = logging.getLogger(__name__)

try:  # transformers is optional: the module imports without it; the callback says what to install.
    from transformers import TrainerCallback as _CallbackBase

    _MISSING: str | None = None
except ImportError as exc:  # pragma: no cover - exercised only where transformers is absent
    _CallbackBase = object  # type: ignore[assignment,misc]
    _MISSING = f"{exc}"

# The Trainer names its folders f"{PREFIX_CHECKPOINT_DIR}-{global_step}"; the prefix is "checkpoint".
_PREFIX = "checkpoint"
#: ``TrainingArguments(output_dir=None)`` becomes this folder (transformers 5).
DEFAULT_OUTPUT_DIR = "trainer_output"


class VerifiedCheckpointCallback(_CallbackBase):  # type: ignore[misc,valid-type]
    """After each Trainer save, fsync the ``checkpoint-N`` folder and record its manifest, last.

    Only the process that saves (``args.should_save``, the main process)
    writes the manifest, after every process has written its files (a
    barrier when a process group is running). Pass it as
    ``Trainer(..., callbacks=[VerifiedCheckpointCallback()])``.

    When ``$CKPT_LESSON_CKPT_DIR`` is set, the callback sets the Trainer's
    ``args.output_dir`` to it as the Trainer is built, so every save lands in the
    folder ``resume-test`` watches; unset, ``output_dir`` stays as given.

    Raises:
        CheckpointError: transformers is not installed.

    Example:
        >>> trainer.add_callback(VerifiedCheckpointCallback())  # doctest: +SKIP
    """

    def __init__(self) -> None:
        if _MISSING is not None:
            raise CheckpointError(
                f"VerifiedCheckpointCallback needs 'transformers' ({_MISSING}); "
                "install it with 'pip install transformers>=4.46 accelerate'."
            )
        super().__init__()

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Point ``args.output_dir`` at ``$CKPT_LESSON_CKPT_DIR`` when it is set (logged), else leave it."""
        folder = os.environ.get(CKPT_DIR_ENV)
        if folder and os.fspath(args.output_dir) != folder:
            log.info("saving into $%s=%s instead of output_dir=%s", CKPT_DIR_ENV, folder, args.output_dir)
            args.output_dir = folder
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Record ``output_dir/checkpoint-{global_step}``; a missing folder is logged, not fatal.

        With several processes, every one waits here until all have saved: the
        Trainer has each rank write its own ``rng_state_{rank}.pth`` and calls
        ``on_save`` with no barrier in between (transformers 5.24,
        ``Trainer._save_checkpoint``), so without one the main process could
        record the folder before a slower rank's file exists, and the folder
        would then fail verification for a file "not in the manifest".
        """
        _wait_for_every_rank()
        if not args.should_save:
            return control
        folder = Path(args.output_dir) / f"{_PREFIX}-{state.global_step}"
        if not folder.is_dir():
            # A hyper-parameter search saves under run-N/; nothing of ours to vouch for here.
            log.warning("no %s after the save; nothing recorded", folder)
            return control
        manifest = write_folder_manifest(folder, step=state.global_step)
        log.info("recorded %s (%d files)", folder.name, len(manifest["files"]))
        return control


def _wait_for_every_rank() -> None:
    # Every rank runs on_save for the same save, so a barrier here is matched on every rank.
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - a torch build without distributed support
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def latest_verified_checkpoint(output_dir: str | os.PathLike[str] | None = None) -> str | None:
    """The newest ``checkpoint-N`` folder in ``output_dir`` whose manifest verifies, as a string.

    Newer folders that fail (no manifest: the save was interrupted, or a file
    changed since) are skipped with a warning naming the reason. Returns
    ``None`` when none verifies, which ``trainer.train(resume_from_checkpoint=None)``
    reads as "start fresh".

    Args:
        output_dir: The Trainer's ``output_dir``. Default: ``$CKPT_LESSON_CKPT_DIR`` when set
            (``resume-test`` sets it), else the Trainer's own default, ``trainer_output``; a
            default folder that does not exist yet is a first run (``None``).

    Raises:
        CheckpointError: ``output_dir`` is given and is not a directory.

    Example:
        >>> trainer.train(resume_from_checkpoint=latest_verified_checkpoint("out"))  # doctest: +SKIP
    """
    if output_dir is None:
        output_dir = os.environ.get(CKPT_DIR_ENV) or DEFAULT_OUTPUT_DIR
        if not Path(output_dir).exists():
            return None  # a first run: nothing saved yet
    found = latest_verified_folder(output_dir)
    return str(found) if found is not None else None
