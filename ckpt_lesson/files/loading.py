"""Reading a ``.pt`` file safely: verify every byte first, then a weights-only load.

Every checkpoint this package reads, single-file, sharded, migrated or
warm-started, enters through :func:`load_verified_file`, and that is on
purpose: one door is one place to get right. It does two things in order.

1. **Verify** in a single read: the size on disk against the recorded size,
   the integrity footer (see :mod:`ckpt_lesson.files.integrity`) when the file has
   one, and the whole file's digest against the one an index or manifest
   recorded (in the record's algorithm: sha256 for old records).
   ``torch.load`` checks none of this; a flipped bit inside tensor data
   would load as different weights without a word.
2. **Load** with ``torch.load(weights_only=True)``: a checkpoint is data, and
   the full unpickler would run any code a crafted file asks it to. Whatever
   the loader raises is translated into a :class:`~ckpt_lesson.errors.CheckpointError`
   that says what is wrong with the file and what to do about it.

What the payload *means* (schema, buckets, applying it to live objects) is
:mod:`ckpt_lesson.files.checkpoint`'s business; this module only hands back bytes
that are exactly what was saved, as Python objects.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from ckpt_lesson.files.integrity import FileDigest, verify_footer

__all__ = ["load_verified_file"]


def load_verified_file(
    path: str | os.PathLike[str],
    *,
    map_location: str | torch.device = "cpu",
    expected_sha256: str | None = None,
    expected_size: int | None = None,
    expected_digest: str | None = None,
    algo: str | None = None,
) -> tuple[Any, FileDigest]:
    """Hash a ``.pt`` file once, check it, then ``torch.load(weights_only=True)`` it.

    The building block of every load in this package: the footer (when the
    file has one), the expected size and the expected whole-file digest are
    all checked in a single read before the unpickler sees a byte.

    Args:
        path: The file.
        map_location: Passed to ``torch.load``.
        expected_sha256: A recorded whole-file sha256 (older records).
        expected_size: A recorded byte count.
        expected_digest: A recorded whole-file digest in ``algo``.
        algo: Algorithm of ``expected_digest`` (default: the footer's).

    Returns:
        The loaded object and the file's digest (``has_footer`` is ``False``
        for a file without footer; callers decide whether that is allowed).

    Raises:
        CheckpointError: Missing file. CorruptCheckpointError: size or hash
            mismatch, unreadable archive. UnsafeCheckpointError: refused by the
            weights-only loader.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"{path}: no such checkpoint file; check the path, or list saves with "
            "'python -m ckpt_lesson scan DIR'."
        )
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open ({exc.strerror}); check its permissions.") from exc
    with f:
        size = os.fstat(f.fileno()).st_size
        if expected_size is not None and size != expected_size:
            raise CorruptCheckpointError(
                f"{path}: {size} bytes on disk but {expected_size} recorded; the file was truncated "
                "or replaced after it was saved. Restore an older checkpoint."
            )
        if expected_sha256 is not None:
            expected_digest, algo = expected_sha256, "sha256"
        digest = verify_footer(f, name=path, algo=algo)
        # Compare case-insensitively: hex digests copied from other tools are sometimes upper case.
        if expected_digest is not None and digest.digest != expected_digest.lower():
            raise CorruptCheckpointError(
                f"{path}: {digest.algo} {digest.digest[:12]}... does not match the recorded "
                f"{expected_digest[:12]}...; the file changed after it was saved. "
                "Restore an older checkpoint."
            )
        return _weights_only_load(f, path, map_location), digest


def _weights_only_load(f: Any, path: Path, map_location: Any) -> Any:
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if re.search(r"Unsupported operand", str(exc)):
            # Not a pickle at all (a text file, random bytes): damaged, not hostile.
            raise CorruptCheckpointError(
                f"{path}: not a torch.save archive (its bytes are not a pickle stream); "
                "it is damaged or some other kind of file. Restore an older checkpoint."
            ) from exc
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        first = found.group(0) if found else "a construct outside tensors and plain values"
        raise UnsafeCheckpointError(
            f"{path}: refused by the weights-only loader ({first[:200]}). It holds Python objects "
            "beyond tensors and plain values, which no ckpt_lesson checkpoint does. Treat it as "
            "untrusted and never retry it with the full unpickler (weights_only off)."
        ) from exc
    except Exception as exc:
        # Deliberately broad: fed damaged bytes, torch.load raises almost anything
        # (RuntimeError from the zip reader, EOFError, KeyError, and TypeError or
        # AttributeError when a flipped opcode hands a rebuild function the wrong
        # object). Every one of them means "not a readable checkpoint".
        raise CorruptCheckpointError(
            f"{path}: not a readable checkpoint archive ({type(exc).__name__}: {str(exc)[:200]}); "
            "it is truncated, damaged or not a torch.save file. Restore an older checkpoint."
        ) from exc
