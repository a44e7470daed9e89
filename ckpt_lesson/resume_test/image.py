"""``--lose-machine``'s machine image: the working folder as it was before the baseline.

A replacement machine boots from an image that holds the code and the input
data (a checkout, a ``data/`` folder, a ``configurator.py``), but nothing the
lost machine wrote. So before the baseline runs, the command's working folder
is copied once (:func:`take_image`); every restart on a "new machine" starts
in a fresh copy of that copy (:func:`install_image`). The original folder is
only read: the tool never deletes or moves a file it did not create.

The copy keeps symlinks as links (a virtualenv inside the folder stays a
virtualenv) and leaves out the tool's own ``--workdir`` when it lies inside.
A folder too big to copy for every restart is a usage error that says so.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ckpt_lesson.errors import CheckpointError

__all__ = ["IMAGE_MAX_BYTES", "IMAGE_MAX_FILES", "install_image", "take_image"]

#: Limits on the working folder that --lose-machine copies for every restart.
IMAGE_MAX_BYTES = 2 << 30
IMAGE_MAX_FILES = 50_000


def _measure(root: Path, skip: Path) -> tuple[int, int]:
    """Files and bytes under ``root`` (symlinks counted, not followed; ``skip`` left out)."""
    files = size = 0
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if here / d != skip and not (here / d).is_symlink()]
        for name in names:
            files += 1
            try:
                size += (here / name).lstat().st_size
            except OSError:
                continue
            if files > IMAGE_MAX_FILES or size > IMAGE_MAX_BYTES:
                return files, size
    return files, size


def take_image(cwd: Path, dest: Path, *, workdir: Path) -> Path:
    """Copy the working folder ``cwd`` to ``dest``, leaving out ``workdir`` if it lies inside.

    Args:
        cwd: The command's working folder (its code and input files).
        dest: Where the image goes (inside the tool's workdir; must not exist).
        workdir: The tool's ``--workdir`` (never copied into itself).

    Returns:
        ``dest``.

    Raises:
        CheckpointError: The folder holds more than :data:`IMAGE_MAX_FILES` files or
            :data:`IMAGE_MAX_BYTES` bytes, or cannot be read.

    Example:
        >>> take_image(Path.cwd(), Path("w/machine-image"), workdir=Path("w"))  # doctest: +SKIP
        PosixPath('w/machine-image')
    """
    cwd, workdir = cwd.resolve(), workdir.resolve()
    if cwd == workdir:
        raise CheckpointError(f"--workdir {workdir} is the working folder; pass another --workdir.")
    files, size = _measure(cwd, workdir)
    if files > IMAGE_MAX_FILES or size > IMAGE_MAX_BYTES:
        raise CheckpointError(
            f"--lose-machine copies the working folder {cwd} for every restart (a new machine has the "
            f"code and inputs), but it holds more than {IMAGE_MAX_FILES} files or "
            f"{IMAGE_MAX_BYTES >> 30} GiB; run from a folder with only the code and its inputs."
        )

    def ignore(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if Path(folder, n).resolve() == workdir]

    try:
        shutil.copytree(cwd, dest, symlinks=True, ignore=ignore)
    except (OSError, shutil.Error) as exc:
        raise CheckpointError(
            f"--lose-machine could not copy the working folder {cwd} ({exc}); run from a folder you can read."
        ) from None
    return dest


def install_image(image: Path, cwd: Path) -> Path:
    """A new machine's working folder: a fresh copy of ``image`` at ``cwd``.

    Args:
        image: The folder :func:`take_image` made.
        cwd: The new machine's working folder (under the tool's workdir; replaced if present).

    Returns:
        ``cwd``.

    Raises:
        OSError: The copy failed (the tool's own workdir is not writable any more).

    Example:
        >>> install_image(Path("w/machine-image"), Path("w/trial-01/attempt-2/machine/cwd"))  # doctest: +SKIP
        PosixPath('w/trial-01/attempt-2/machine/cwd')
    """
    if cwd.exists():
        shutil.rmtree(cwd)  # only ever a folder this tool made (under its workdir)
    shutil.copytree(image, cwd, symlinks=True)
    return cwd
