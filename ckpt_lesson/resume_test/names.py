"""Which files in a plain checkpoint folder are the checkpoint, and which are logs beside it.

A mid-save kill is worth something only if it lands while the *checkpoint* is
being written. A plain folder usually holds more: Lightning keeps
``metrics.csv`` next to its ``.ckpt``, many scripts append to a log there, and
those files change every step. Counted as "a save at work", they pull every
kill onto a log write and make every step look like a save.

``--ckpt-glob PATTERN`` (repeatable) names the checkpoint files exactly; a
pattern matches a file's path relative to the folder or its bare name
(``*.ckpt``, ``checkpoint-*/model.safetensors``). Without it the watcher
*prefers* names that look like checkpoints (:data:`CHECKPOINT_SUFFIXES`,
also with a temporary suffix after them, ``model.pt.tmp``): once such a file
has appeared, only such files count; a folder that never holds one counts
every file, as before.
"""

from __future__ import annotations

import fnmatch
import posixpath

__all__ = ["CHECKPOINT_SUFFIXES", "NameFilter", "looks_like_checkpoint"]

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors", ".bin")


def looks_like_checkpoint(name: str) -> bool:
    """Whether a file's name looks like a checkpoint (``epoch=3.ckpt``, ``model.pt.tmp``).

    Example:
        >>> looks_like_checkpoint("lightning_logs/epoch=3.ckpt"), looks_like_checkpoint("metrics.csv")
        (True, False)
    """
    base = posixpath.basename(name.rstrip("/")).lower()
    return any(base.endswith(s) or (s + ".") in base for s in CHECKPOINT_SUFFIXES)


class NameFilter:
    """Decide which changed files count as a save.

    Args:
        globs: ``--ckpt-glob`` patterns; empty to prefer checkpoint-looking names.

    Example:
        >>> f = NameFilter(())
        >>> sorted(f.select({"metrics.csv", "last.ckpt"}))
        ['last.ckpt']
        >>> sorted(NameFilter(("*.json",)).select({"state.json", "last.ckpt"}))
        ['state.json']
    """

    def __init__(self, globs: tuple[str, ...] = ()) -> None:
        self.globs = tuple(globs)
        #: Whether names are being filtered (always with globs; once a checkpoint-like file was seen without).
        self.active = bool(self.globs)

    def is_checkpoint(self, name: str) -> bool:
        """Whether the file ``name`` (relative to the folder; folders end in ``/``) is a checkpoint file."""
        if name.endswith("/"):
            return False
        if self.globs:
            base = posixpath.basename(name)
            return any(fnmatch.fnmatchcase(name, g) or fnmatch.fnmatchcase(base, g) for g in self.globs)
        return looks_like_checkpoint(name)

    def see(self, names: set[str] | list[str]) -> None:
        """Note the files present: the first checkpoint-looking one switches preference on."""
        if not self.active and any(self.is_checkpoint(n) for n in names):
            self.active = True

    def select(self, changed: set[str]) -> set[str]:
        """The changed names that count as a save (all of them while the filter is not active)."""
        self.see(changed)
        if not self.active:
            return set(changed)
        return {n for n in changed if self.is_checkpoint(n)}
