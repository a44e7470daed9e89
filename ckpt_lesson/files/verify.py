"""Check one file of a save against its record: size first (free), then one read for the digest.

A record is what a manifest or an index says about a part: its byte count and
its digest (``{"algo", "digest"}``, or ``{"sha256"}`` from earlier versions).
Nothing here unpickles anything: a scan of a whole run costs one read of
every byte, no more.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError
from ckpt_lesson.files.integrity import file_digest, part_digest

__all__ = ["verify_part", "verify_record"]


def verify_record(path: Path, part: dict[str, Any]) -> str | None:
    """:func:`verify_part` against a manifest or index record, old or new form.

    Example:
        >>> verify_record(Path("run/step-00000240/checkpoint.pt"), part)  # doctest: +SKIP
    """
    algo, digest = part_digest(part)
    return verify_part(path, size=part["bytes"], digest=digest, algo=algo)


def verify_part(
    path: Path,
    *,
    size: int,
    sha256: str | None = None,
    digest: str | None = None,
    algo: str | None = None,
) -> str | None:
    """Check one file against its recorded size and digest.

    The size is checked first (a ``stat``, free); only then is the file read,
    once, to compute its digest and check its in-file footer when it has one.

    Args:
        path: The file.
        size: Recorded byte count.
        sha256: Recorded hex sha256 of the whole file (the older form).
        digest: Recorded hex digest of the whole file in ``algo`` (the newer
            form; ``algo`` defaults to sha256 when only ``digest`` is given).
        algo: The recorded digest's algorithm.

    Returns:
        ``None`` if the file matches, else a short reason naming the file,
        e.g. ``"checkpoint.pt: size 100 != recorded 200"``.

    Example:
        >>> verify_part(Path("run/step-00000240/checkpoint.pt"), size=1, sha256="0" * 64)  # doctest: +SKIP
        'checkpoint.pt: size 35210 != recorded 1'
    """
    path = Path(path)
    name = path.name
    if path.is_symlink():
        return f"{name}: is a symlink; parts must be regular files inside the save folder"
    if not path.exists():
        return f"{name}: missing"
    if not path.is_file():
        return f"{name}: not a regular file"
    actual = path.stat().st_size
    if actual != size:
        return f"{name}: size {actual} != recorded {size}"
    if sha256 is not None:
        digest, algo = sha256, "sha256"
    if digest is None:
        raise CheckpointError(f"{name}: verify_part needs the recorded sha256=, or digest= and algo=.")
    algo = algo or "sha256"
    try:
        found = file_digest(path, algo=algo)
    except CorruptCheckpointError:
        return f"{name}: contents do not match the file's own integrity footer"
    except OSError as exc:
        return f"{name}: unreadable ({type(exc).__name__}: {exc.strerror or exc})"
    if found.digest != digest:
        return f"{name}: {algo} {found.digest[:12]}... != recorded {digest[:12]}..."
    return None
