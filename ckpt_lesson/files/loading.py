"""Reading a ``.pt`` file safely: verify every byte first, then a weights-only load.

Every checkpoint this package reads, single-file, sharded, migrated or
warm-started, enters through :func:`load_verified_file`, and that is on
purpose: one door is one place to get right. It does two things in order.

1. **Verify** in a single read, which also fills the private copy the load
   reads (:mod:`ckpt_lesson.files.private_copy`), so it loads exactly the
   verified bytes however the file changes meanwhile: the size on disk against the recorded size,
   the integrity footer (see :mod:`ckpt_lesson.files.integrity`) when the file has
   one, and the whole file's digest against the one an index or manifest
   recorded (in the record's algorithm: sha256 for old records).
   ``torch.load`` checks none of this; a flipped bit inside tensor data
   would load as different weights without a word.
2. **Load** the verified copy (never the file again) with
   ``torch.load(weights_only=True)``: a checkpoint is data, and the full unpickler
   would run any code a crafted file asks it to. Whatever
   the loader raises is translated into a :class:`~ckpt_lesson.errors.CheckpointError`
   that says what is wrong with the file and what to do about it.

What the payload *means* (schema, buckets, applying it to live objects) is
:mod:`ckpt_lesson.files.checkpoint`'s business; this module only hands back bytes
that are exactly what was saved, as Python objects.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import re
import stat
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    LoadEnvironmentError,
    UnsafeCheckpointError,
)
from ckpt_lesson.files.hashing import check_algo, digest_bytes
from ckpt_lesson.files.integrity import FileDigest, read_footer, verify_footer
from ckpt_lesson.files.mapped_restore import FreshMemory
from ckpt_lesson.files.private_copy import PrivateCopy
from ckpt_lesson.files.schema import SCHEMA_V1
from ckpt_lesson.files.verify import VerifiedBytes

__all__ = ["check_archive", "load_verified_file", "require_footer"]


def load_verified_file(
    path: str | os.PathLike[str] | VerifiedBytes,
    *,
    map_location: str | torch.device = "cpu",
    expected_sha256: str | None = None,
    expected_size: int | None = None,
    expected_digest: str | None = None,
    algo: str | None = None,
    mmap: bool = False,
    private: Callable[[Any, FreshMemory], Any] | None = None,
) -> tuple[Any, FileDigest]:
    """Hash a ``.pt`` file once, check it, then ``torch.load(weights_only=True)`` it.

    The building block of every load in this package: the footer (when the
    file has one), the expected size and the expected whole-file digest are
    all checked in a single read before the unpickler sees a byte.

    Args:
        path: The file, or a part already verified in memory
            (:class:`~ckpt_lesson.files.verify.VerifiedBytes`): its size,
            digest and footer are compared without hashing it again (in another
            algorithm only), and every check from the archive check on runs as for a file.
        map_location: Passed to ``torch.load``.
        expected_sha256: A recorded whole-file sha256 (older records).
        expected_size: A recorded byte count.
        expected_digest: A recorded whole-file digest in ``algo``.
        algo: Algorithm of ``expected_digest`` (default: the footer's).
        mmap: Map the verified private copy (module docstring, step 1; a memfd on Linux)
            instead of reading it into new memory. The returned tensors then share
            the copy's pages (a private, copy-on-write mapping): copy what you keep
            (``private``), or it keeps the whole copy alive. Any failure of the mapped
            load (a damaged archive) falls back to the plain read of the copy, which
            loads it or reports it as any load would. Ignored for bytes in memory:
            their tensors are private copies already.
        private: After a mapped load, ``private(obj, fresh)`` returns ``obj`` with what
            must not stay mapped copied out, into the large records' buffers that
            ``fresh`` (:class:`~ckpt_lesson.files.mapped_restore.FreshMemory`) faulted
            in while the file was hashed (a CPU load only) and the hash pass filled.

    Returns:
        The loaded object and the file's digest (``has_footer`` is ``False``
        for a file without footer; callers decide whether that is allowed).

    Raises:
        CheckpointError: Missing file. CorruptCheckpointError: size or hash
            mismatch, unreadable archive. UnsafeCheckpointError: refused by the
            weights-only loader.
    """
    if expected_sha256 is not None:
        expected_digest, algo = expected_sha256, "sha256"
    if isinstance(path, VerifiedBytes):
        _check_size(path.name, path.size, expected_size, "in memory")
        algo = check_algo(algo or path.algo)
        # Another algorithm than the one the stream was hashed with (an old sha256 record):
        # one hash in that algorithm is the only honest comparison.
        whole = path.digest if algo == path.algo else digest_bytes(path.data, algo)
        _check_digest(path.name, algo, whole, expected_digest)
        with path.open() as f:
            found = read_footer(f, path.size, name=path.name)  # its shape only: see VerifiedBytes
            check_archive(f, path.size, name=path.name)
            digest = FileDigest(path.size, whole, found[1] if found else None, algo)
            return _weights_only_load(f, path.name, map_location), digest
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"{path}: no such checkpoint file; check the path, or list saves with "
            "'python -m ckpt_lesson scan DIR'."
        )
    try:
        # O_NONBLOCK: a FIFO swapped in after the check above must not block the open forever.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open ({exc.strerror}); check its permissions.") from exc
    with os.fdopen(fd, "rb") as f, FreshMemory() as fresh:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(
                f"{path}: is not a regular file (a device or pipe); refusing to read it."
            )
        size = st.st_size
        _check_size(path, size, expected_size)
        # Records go straight into CPU buffers only for a CPU load: tensors that map_location moves
        # elsewhere are read from the mapping while it is loaded, so every byte must be there.
        if mmap and (map_location is None or str(map_location) == "cpu"):
            fresh.start(f, size)  # sizes only, from the directory: nothing here is trusted
        with PrivateCopy(size, fresh=fresh) as copy:
            try:
                digest = verify_footer(copy.reader(f), name=path, algo=algo)
            except OSError as exc:  # EIO and friends: this copy cannot be read back, which is damage
                raise CorruptCheckpointError(
                    f"{path}: I/O error while reading ({exc.strerror or exc}); this copy is damaged. "
                    "Restore an older checkpoint."
                ) from exc
            if digest.size != size:  # it grew or shrank while we read: what we copied was not all hashed
                raise CorruptCheckpointError(
                    f"{path}: changed size while it was being verified ({size} -> {digest.size} bytes); "
                    "another process is writing it. Retry when it is done, or restore an older checkpoint."
                )
            _check_digest(path, digest.algo, digest.digest, expected_digest)
            copy.seal()
            with copy.open() as held:
                check_archive(held, size, name=path)
                if mmap and copy.map_path is not None:
                    try:  # the sealed copy: nobody can change or truncate what the tensors map
                        obj = torch.load(
                            copy.map_path, map_location=map_location, weights_only=True, mmap=True
                        )
                    except Exception:  # any failure is judged by the plain read below
                        # A hostile pickle, a damaged archive: the read below loads it the ordinary
                        # way, or classifies the failure exactly as for any load.
                        held.seek(0)
                    else:
                        copy.adopt(obj)  # large records: from the buffers the hash pass filled
                        return (obj if private is None else private(obj, fresh)), digest
                obj = _weights_only_load(held, path, map_location)
                if copy.scattered:  # the copy has holes where records went to buffers: not a load
                    raise CorruptCheckpointError(
                        f"{path}: its verified copy could not be mapped; restore with mmap=False."
                    )
                return obj, digest


def _check_size(name: Any, size: int, expected: int | None, where: str = "on disk") -> None:
    if expected is not None and size != expected:
        raise CorruptCheckpointError(
            f"{name}: {size} bytes {where} but {expected} recorded; the file was truncated "
            "or replaced after it was saved. Restore an older checkpoint."
        )


def _check_digest(name: Any, algo: str, found: str, expected: str | None) -> None:
    # Compare case-insensitively: hex digests copied from other tools are sometimes upper case.
    if expected is not None and found != expected.lower():
        raise CorruptCheckpointError(
            f"{name}: {algo} {found[:12]}... does not match the recorded {expected[:12]}...; "
            "the file changed after it was saved. Restore an older checkpoint."
        )


def check_archive(f: BinaryIO, size: int, *, name: str | os.PathLike[str] = "<file>") -> None:
    """Refuse an archive whose members could expand beyond the file: bounded reads of hostile files.

    ``torch.save`` always *stores* its records uncompressed, so a record's size
    on disk is its size in memory. A crafted archive with DEFLATE-compressed
    records (and a footer anyone can recompute) would make a 2 MB file load a
    2 GiB tensor. So every member must be stored, its sizes must agree, and it
    must lie inside the file.

    Raises:
        CorruptCheckpointError: Not a zip archive, a compressed member, or sizes
            that point past the end of the file.

    Example:
        >>> with open("ckpt/last.pt", "rb") as f:  # doctest: +SKIP
        ...     check_archive(f, os.fstat(f.fileno()).st_size, name="ckpt/last.pt")
    """
    try:
        with zipfile.ZipFile(f) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        f.seek(0)
        hostile = _named_global(f.read(1 << 20))
        if hostile:
            raise UnsafeCheckpointError(
                f"{name}: a bare pickle stream that names the global {hostile[:120]} (code to call); never "
                "unpickled. No ckpt_lesson checkpoint is a bare pickle; treat the file as untrusted."
            ) from exc
        raise CorruptCheckpointError(
            f"{name}: not a torch.save archive ({str(exc)[:120]}); it is truncated, damaged or some other "
            "kind of file. Restore an older checkpoint."
        ) from exc
    finally:
        f.seek(0)
    total = 0
    for info in members:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CorruptCheckpointError(
                f"{name}: member {info.filename[:80]!r} is compressed (method {info.compress_type}); "
                "torch.save never compresses, so this file was crafted or rewritten by another tool, and "
                "loading it could expand far beyond its size. Refused; restore an older checkpoint."
            )
        total += info.file_size
        if info.header_offset + info.file_size > size or total > size:
            raise CorruptCheckpointError(
                f"{name}: member {info.filename[:80]!r} declares more bytes than the file holds; "
                "it is damaged or crafted. Restore an older checkpoint."
            )


def _named_global(head: bytes) -> str | None:
    """The first global a pickle stream would import, read from its opcodes without executing any."""
    try:
        for op, arg, _ in pickletools.genops(head):
            if op.name == "GLOBAL":
                return str(arg).replace(" ", ".")
            if op.name == "STACK_GLOBAL":
                return "(given on the stack)"
    except Exception:  # not a pickle, or cut off at the 1 MiB window: nothing found
        return None
    return None


def _weights_only_load(f: Any, path: str | Path, map_location: Any) -> Any:
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except MemoryError as exc:
        raise _environment_error(path, exc) from exc
    except RuntimeError as exc:
        if _ENVIRONMENT_RE.search(str(exc)):
            raise _environment_error(path, exc) from exc
        raise _damaged(path, exc) from exc
    except pickle.UnpicklingError as exc:
        if re.search(r"Unsupported operand", str(exc)):
            # Not a pickle at all (a text file, random bytes): damaged, not hostile.
            raise CorruptCheckpointError(
                f"{path}: not a torch.save archive (its bytes are not a pickle stream); "
                "it is damaged or some other kind of file. Restore an older checkpoint."
            ) from exc
        # The wording changes between torch versions ("Unsupported global: GLOBAL x.y", "Trying to
        # load unsupported GLOBAL x.y whose module x is blocked"); the global's name follows GLOBAL.
        found = re.search(r"GLOBAL\s+([\w.]+)", str(exc))
        first = (
            f"blocked global {found.group(1)}" if found else "a construct outside tensors and plain values"
        )
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
        raise _damaged(path, exc) from exc


#: A load failure about this machine, not the bytes: no such device, or no memory for the tensors.
_ENVIRONMENT_RE = re.compile(r"cuda|mps|xpu|device|alloc|out of memory|not enough memory", re.IGNORECASE)


def _environment_error(path: str | Path, exc: BaseException) -> LoadEnvironmentError:
    return LoadEnvironmentError(
        f"{path}: its bytes check out but this machine cannot load it ({type(exc).__name__}: "
        f"{str(exc)[:200]}). This is not damage, and an older save would fail the same way: pass a "
        "map_location this machine has (e.g. 'cpu') or free memory, then retry."
    )


def _damaged(path: str | Path, exc: BaseException) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path}: not a readable checkpoint archive ({type(exc).__name__}: {str(exc)[:200]}); "
        "it is truncated, damaged or not a torch.save file. Restore an older checkpoint."
    )


def require_footer(obj: Any, digest: FileDigest, path: str | os.PathLike[str]) -> None:
    """Refuse a file that declares a schema newer than ``ckpt.v1`` but has no integrity footer.

    Every file this package writes in ``ckpt.v2`` carries a footer; one without it
    lost its end or was rewritten by other code. A file with no schema at all
    (plain weights from elsewhere) or a legacy v1 file is left to the caller.

    Raises:
        CorruptCheckpointError: The schema says a footer must be there and it is not.
    """
    schema = obj.get("schema") if isinstance(obj, dict) else None
    if digest.content_digest is None and schema is not None and schema != SCHEMA_V1:
        raise CorruptCheckpointError(
            f"{path}: a {schema} checkpoint without its integrity footer; the file's end was "
            "damaged or it was re-written by other code. Restore an older checkpoint."
        )
