"""A Lightning ``CheckpointIO`` plugin that saves atomically, durably, streamed and verified.

Lightning (2.6) routes every checkpoint through one ``CheckpointIO`` object:
``ModelCheckpoint``, ``trainer.save_checkpoint`` and ``fit(ckpt_path=...)``
all end in its ``save_checkpoint``, ``load_checkpoint`` and
``remove_checkpoint``. Its stock ``TorchCheckpointIO`` (read in
``lightning/fabric/utilities/cloud_io.py``) serializes the whole checkpoint
into an in-memory buffer first (one extra full copy), writes it to a temp file
in the *system* temp directory, moves it over the target (a copy, not an
atomic rename, when that directory is on another file system) and never
fsyncs; ``load_checkpoint`` checks nothing, so a flipped byte inside a tensor
loads as a different weight.

:class:`VerifiedCheckpointIO` swaps in this package's file layer:

* **save**: :func:`~ckpt_lesson.files.atomic.atomic_save`: ``torch.save``
  streams into a temp file beside the target, hashed as it passes (no second
  copy in memory), with the integrity footer; fsync, atomic rename, fsync of
  the directory. A kill at any moment leaves the old file or the new one.
* **load**: :func:`~ckpt_lesson.files.loading.load_verified_file`: every byte
  checked against the footer, then ``torch.load(weights_only=True)``. A
  Lightning checkpoint can hold Python objects in its hyper-parameters (a
  ``pathlib.Path``, a config dataclass); the weights-only loader refuses them
  by name, and ``safe_globals=[...]`` is the explicit, reviewed allowlist.
* **remove**: unlink, then fsync the directory.

:class:`OrderedAsyncCheckpointIO` is Lightning's own ``AsyncCheckpointIO``
(tensors cloned on the training thread, one writer thread, errors re-raised
on the next save) with one fix: ``ModelCheckpoint`` saves the new file and
then removes the old one, and the stock wrapper removes *immediately*, while
the new save is still queued. Here a removal waits in the same queue, behind
the save, and is skipped if that save failed.

To resume, :func:`latest_verified_checkpoint` names the newest ``.ckpt`` whose
footer verifies (``ckpt_path="last"`` trusts ``last.ckpt`` unread).

Where: wherever the trainer saves (its default is
``lightning_logs/version_N/checkpoints``, or ``checkpoints/`` without a logger),
or, when ``$CKPT_LESSON_CKPT_DIR`` is set (``resume-test`` sets it), that folder:
the plugin then writes each file there under the name Lightning gave it, and
removes it from there. ``latest_verified_checkpoint()`` with no argument looks
in the same places, every ``version_N`` included, so adoption is two changes:
``plugins=[VerifiedCheckpointIO()]`` and ``ckpt_path=latest_verified_checkpoint()``.

Example:
    >>> from ckpt_lesson.integrations.lightning import VerifiedCheckpointIO  # doctest: +SKIP
    >>> trainer = lightning.Trainer(plugins=[VerifiedCheckpointIO()])  # doctest: +SKIP
    >>> trainer.fit(model, ckpt_path=latest_verified_checkpoint(dirpath))  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, UnsafeCheckpointError
from ckpt_lesson.files.atomic import atomic_save, fsync_dir
from ckpt_lesson.files.loading import load_verified_file
from ckpt_lesson.files.rng import capture_rng_state, restore_rng_state
from ckpt_lesson.runs.lightning_files import LIGHTNING_SUFFIX, inspect_lightning_file, newness
from ckpt_lesson.runs.steplog import CKPT_DIR_ENV

__all__ = ["RNG_KEY", "OrderedAsyncCheckpointIO", "VerifiedCheckpointIO", "latest_verified_checkpoint"]

#: Key of the generator state the plugin adds to each Lightning checkpoint (Lightning saves none).
RNG_KEY = "ckpt_lesson_rng"

log = logging.getLogger(__name__)

try:  # Lightning is optional: the module imports without it, the plugin says what to install.
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _CheckpointIOBase
    from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO as _AsyncBase

    _MISSING: str | None = None
except ImportError as exc:  # pragma: no cover - exercised only where lightning is absent
    _CheckpointIOBase = object  # type: ignore[assignment,misc]
    _AsyncBase = object  # type: ignore[assignment,misc]
    _MISSING = f"{exc}"


def _require_lightning() -> None:
    if _MISSING is not None:
        raise CheckpointError(
            f"ckpt_lesson.integrations.lightning needs the 'lightning' package ({_MISSING}); "
            "install it with 'pip install lightning>=2.4'."
        )


def _local_path(path: Any) -> Path:
    text = os.fspath(path)
    if "://" in text:
        # atomic rename and fsync are file-system promises; object stores make neither.
        raise CheckpointError(
            f"{text}: VerifiedCheckpointIO writes to local (POSIX) paths only; "
            "save locally and upload the finished file, or use Lightning's stock CheckpointIO for URLs."
        )
    return Path(text)


class VerifiedCheckpointIO(_CheckpointIOBase):  # type: ignore[misc,valid-type]
    """Atomic, durable, streamed saves and verified weights-only loads for ``lightning.Trainer``.

    Args:
        safe_globals: Classes (or functions) that the weights-only loader may
            rebuild, for the hyper-parameters Lightning stores with
            ``save_hyperparameters()``: e.g. ``[pathlib.PosixPath]`` or your
            config dataclass. Passed to ``torch.serialization.safe_globals``
            during each load. Only list types you own or trust: an allowlisted
            type's constructor runs during the load.
        require_integrity: ``True`` (default) refuses files without our
            integrity footer (written by the stock writer): they cannot be
            verified. ``False`` loads them weights-only anyway, for moving a
            run that began with the stock writer.
        rng: ``True`` (default) carries what Lightning does not save: every
            generator (Python, NumPy, torch CPU and CUDA), captured on the
            training thread when the save is requested and restored when
            ``fit(ckpt_path=...)`` loads the file, before the first resumed step.

    With ``$CKPT_LESSON_CKPT_DIR`` set, saves and removals go to that folder, each file under
    the name Lightning gave it (two checkpoint callbacks that use the same file names in
    different folders would then share one; give them distinct ``filename`` patterns).

    Raises:
        CheckpointError: Lightning is not installed.

    Example:
        >>> trainer = Trainer(plugins=[VerifiedCheckpointIO(safe_globals=[MyConfig])])  # doctest: +SKIP
        >>> trainer.fit(model, ckpt_path="checkpoints/last.ckpt")  # doctest: +SKIP
    """

    def __init__(
        self, *, safe_globals: Iterable[Any] = (), require_integrity: bool = True, rng: bool = True
    ) -> None:
        _require_lightning()
        super().__init__()
        self.safe_globals = list(safe_globals)
        self.require_integrity = require_integrity
        self.rng = rng

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path``: streamed, footer-stamped, fsynced, renamed into place.

        Raises:
            CheckpointError: ``storage_options`` was given (nothing here uses
                them), ``path`` is a URL, or a parent on the way is a file.
        """
        if storage_options is not None:
            raise CheckpointError(
                f"{os.fspath(path)}: VerifiedCheckpointIO takes no storage_options; "
                "call trainer.save_checkpoint(path) without them."
            )
        if self.rng and RNG_KEY not in checkpoint:  # the async wrapper captured it already, on time
            checkpoint = {**checkpoint, RNG_KEY: capture_rng_state()}
        digest = atomic_save(checkpoint, _redirected(_local_path(path)))
        log.debug("saved %s (%d bytes, %s %s)", path, digest.size, digest.algo, digest.digest[:12])

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Verify every byte of ``path`` against its footer, then load it weights-only.

        Args:
            path: A checkpoint file written by this plugin.
            map_location: As for ``torch.load``; ``None`` means CPU.
            weights_only: ``None`` or ``True``. ``False`` (Lightning's switch
                for the full unpickler) is refused: list the extra types in
                ``safe_globals`` instead.

        Returns:
            The checkpoint dict Lightning saved.

        Raises:
            CheckpointError: Missing file, no footer (with ``require_integrity``),
                or weights_only turned off. CorruptCheckpointError: the bytes
                changed since the save. UnsafeCheckpointError: the file holds a
                type outside tensors, plain values and ``safe_globals`` (named).
        """
        if weights_only is False:
            raise CheckpointError(
                f"{os.fspath(path)}: VerifiedCheckpointIO loads weights-only and will not run the full "
                "unpickler; pass the classes your checkpoint needs as "
                "VerifiedCheckpointIO(safe_globals=[...])."
            )
        path = _local_path(path)
        with torch.serialization.safe_globals(self.safe_globals):
            try:
                payload, digest = load_verified_file(path, map_location=map_location or "cpu")
            except UnsafeCheckpointError as exc:
                raise UnsafeCheckpointError(
                    f"{exc} If that type is yours (Lightning stores save_hyperparameters() values), allow it "
                    "explicitly: VerifiedCheckpointIO(safe_globals=[TheType])."
                ) from exc.__cause__
        if not digest.has_footer and self.require_integrity:
            raise CheckpointError(
                f"{path}: has no integrity footer (written by another writer, e.g. Lightning's stock "
                "one), so it cannot be verified. Pass VerifiedCheckpointIO(require_integrity=False) to load "
                "it weights-only anyway, once, and let the next save write a verified file."
            )
        if not isinstance(payload, dict):
            raise CheckpointError(
                f"{path}: holds a {type(payload).__name__}, not a Lightning checkpoint dict."
            )
        saved_rng = payload.pop(RNG_KEY, None)
        if self.rng and saved_rng is not None:
            # Lightning calls this while restoring, before the fit loop draws anything.
            restore_rng_state(_on_cpu(saved_rng))
        return payload

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete ``path`` (missing is fine) and fsync its directory, so the deletion is durable too."""
        path = _redirected(_local_path(path))
        if path.is_dir() and not path.is_symlink():
            raise CheckpointError(
                f"{path}: is a directory; VerifiedCheckpointIO removes checkpoint files only."
            )
        try:
            path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(path.parent)
        log.debug("removed %s", path)


class OrderedAsyncCheckpointIO(_AsyncBase):  # type: ignore[misc,valid-type]
    """Lightning's ``AsyncCheckpointIO`` around :class:`VerifiedCheckpointIO`, removals queued behind saves.

    The training thread pays for a clone of every tensor (Lightning's
    snapshot); the writer thread streams it to disk. Use
    ``Trainer(plugins=[OrderedAsyncCheckpointIO()])``.

    Args:
        checkpoint_io: The plugin that does the writing; a fresh
            :class:`VerifiedCheckpointIO` when omitted.

    Raises:
        CheckpointError: Lightning is not installed.

    Example:
        >>> trainer = Trainer(plugins=[OrderedAsyncCheckpointIO()])  # doctest: +SKIP
    """

    def __init__(self, checkpoint_io: Any | None = None) -> None:
        _require_lightning()
        import lightning.pytorch.plugins.io.async_plugin as stock

        if not hasattr(stock, "_clone_tensor") or not hasattr(_AsyncBase, "_ensure_setup"):
            # Older wrappers hand the *live* tensors to the writer thread, which then races training.
            raise CheckpointError(
                "OrderedAsyncCheckpointIO needs a Lightning whose AsyncCheckpointIO clones tensors before "
                "writing (2.6 does); upgrade with 'pip install -U lightning', or use VerifiedCheckpointIO."
            )
        super().__init__(checkpoint_io if checkpoint_io is not None else VerifiedCheckpointIO())

    def save_checkpoint(self, checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        """Capture the generators now, on the training thread, then queue the write as Lightning does."""
        if getattr(self.checkpoint_io, "rng", False) and RNG_KEY not in checkpoint:
            checkpoint = {**checkpoint, RNG_KEY: capture_rng_state()}
        super().save_checkpoint(checkpoint, *args, **kwargs)

    def remove_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """Queue the removal behind every save submitted before it; skip it if a save failed."""
        self._ensure_setup()
        remove: Callable[..., None] = self.checkpoint_io.remove_checkpoint

        def _remove() -> None:
            # One worker thread runs jobs in order: every earlier save has finished here.
            if self._error is not None:
                log.warning("a checkpoint save failed; keeping %s instead of removing it", args or kwargs)
                return
            try:
                remove(*args, **kwargs)
            except BaseException as exc:  # surfaced on the training thread, like a failed save
                self._error = exc

        self._executor.submit(_remove)
        if self._error:
            raise self._error

    def wait(self) -> None:
        """Block until every queued save and removal has finished; re-raise the first error."""
        if self._executor is not None:
            self._executor.submit(lambda: None).result()
        if self._error:
            raise self._error


def latest_verified_checkpoint(dirpath: str | os.PathLike[str] | None = None) -> str | None:
    """The newest ``.ckpt`` whose integrity footer verifies, for ``fit(ckpt_path=...)``.

    ``dirpath`` is ``ModelCheckpoint``'s folder, or a Lightning log root: Lightning's default
    folder, ``lightning_logs/version_N/checkpoints``, moves to a new ``version_N`` on every start,
    so every ``version_*/checkpoints`` under it (and under its ``lightning_logs/``) is searched
    too, and a restart finds the previous run's saves; so is its ``checkpoints/`` (the default
    folder of a trainer without a logger). Newest means the highest ``global_step``
    (then epoch, then the most recent file: ``last.ckpt`` and ``epoch=3-step=12.ckpt`` hold the
    same step). Damaged files, files without our footer and temp files of killed saves are
    skipped with a warning naming the reason. Nothing is unpickled: epoch and step come from
    the pickle's opcodes (see :mod:`ckpt_lesson.runs.lightning_files`).

    Args:
        dirpath: The folder. Default: ``$CKPT_LESSON_CKPT_DIR`` when set (``resume-test`` sets
            it, and the plugin then saves there), else the working folder (the trainer's
            ``default_root_dir``), searched as above.

    Returns:
        The file's path as a string, or ``None`` when the folder is missing,
        empty, or holds no file that verifies (``fit`` then starts fresh).

    Raises:
        CheckpointError: ``dirpath`` exists and is not a directory (a missing
            or empty folder gives ``None``: a first run needs no special case).

    Example:
        >>> trainer.fit(model, ckpt_path=latest_verified_checkpoint())  # doctest: +SKIP
    """
    if dirpath is None:
        dirpath = os.environ.get(CKPT_DIR_ENV) or "."
    dirpath = Path(dirpath)
    if not dirpath.exists():
        return None  # a first run: nothing saved yet, so fit starts fresh
    if not dirpath.is_dir():
        raise CheckpointError(
            f"{dirpath}: is a file, not a checkpoint folder; pass ModelCheckpoint's dirpath."
        )
    versions = [*dirpath.glob("checkpoints"), *dirpath.glob("version_*/checkpoints"),
                *dirpath.glob("lightning_logs/version_*/checkpoints")]  # fmt: skip
    folders = [dirpath, *sorted(f for f in versions if f.is_dir() and not f.is_symlink())]
    found = [inspect_lightning_file(p) for folder in folders for p in folder.iterdir() if _is_candidate(p)]
    for skipped in found:
        if skipped.status != "ok":
            log.warning("skipping %s: %s", skipped.path.name, skipped.reason)
    good = [f for f in found if f.status == "ok"]
    return str(max(good, key=newness).path) if good else None


def _redirected(path: Path) -> Path:
    # resume-test's folder, when it set one, in place of the folder Lightning chose.
    folder = os.environ.get(CKPT_DIR_ENV)
    return Path(folder) / path.name if folder else path


def _on_cpu(tree: Any) -> Any:
    # Generator states are CPU byte tensors; a map_location that moved them must not break the restore.
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: _on_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_on_cpu(v) for v in tree]
    return tree


def _is_candidate(path: Path) -> bool:
    return path.suffix == LIGHTNING_SUFFIX and path.is_file() and not path.is_symlink()
