"""A part held in memory whose bytes were hashed against their record as they arrived.

A restore from an object store streams every part down and hashes it on the
way (:mod:`ckpt_lesson.runs.store_restore`). Writing those bytes to a local
file only for :func:`~ckpt_lesson.files.loading.load_verified_file` to read and
hash them a second time would cost a disk write and a second pass for nothing.
So the loaders also accept a :class:`VerifiedBytes`: the bytes, and the record
they were checked against. The safety checks that do not hash (size, footer
present and intact, a stored zip archive, the weights-only load) still run on
them, exactly as on a file; only the second hash is saved.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from ckpt_lesson.errors import CorruptCheckpointError
from ckpt_lesson.files.hashing import check_algo, digest_bytes
from ckpt_lesson.files.integrity import FileDigest, _inspect_footer  # one judge of what a damaged footer is

__all__ = ["VerifiedBytes"]


@dataclass(frozen=True, eq=False)
class VerifiedBytes:
    """One part's bytes and the digest they were verified against while they streamed in.

    Build one only *after* the bytes matched their record (size and digest):
    the loaders trust ``digest`` and do not hash ``data`` again.

    Attributes:
        data: The part's bytes (``bytes``, so ``io.BytesIO`` shares them instead of copying).
        name: Where they came from, for messages (a URL such as ``s3://b/run/step-00000240/...``).
        algo: The algorithm of ``digest``.
        digest: The whole part's hex digest, as its manifest records it.

    Example:
        >>> part = VerifiedBytes(b"abc", "mem://abc", "sha256", digest_bytes(b"abc", "sha256"))
        >>> part.size
        3
    """

    data: bytes
    name: str
    algo: str
    digest: str

    def __str__(self) -> str:
        return self.name

    @property
    def size(self) -> int:
        """Bytes in the part."""
        return len(self.data)

    def open(self) -> io.BytesIO:
        """A fresh read-only-by-convention file object over the bytes (no copy of ``bytes``)."""
        return io.BytesIO(self.data)

    def check(self, *, size: int | None, digest: str | None, algo: str | None) -> FileDigest:
        """Compare with what a caller expects, and read the footer from the tail; no full hash.

        The digest was computed over every byte, footer included, while the part
        streamed in, and it equals the manifest's, which the commit marker pins.
        The footer was checked against the content when the save was written, so
        identical bytes carry an intact, matching footer; only its presence and
        shape are read here (a few dozen bytes at the end).

        Args:
            size: A recorded byte count, or ``None``.
            digest: A recorded whole-part digest in ``algo``, or ``None``.
            algo: Its algorithm (default: the one the bytes were verified with).

        Returns:
            What :func:`~ckpt_lesson.files.integrity.verify_footer` returns for a file.

        Raises:
            CorruptCheckpointError: The size or digest differ, or the footer is damaged.

        Example:
            >>> VerifiedBytes(b"abc", "mem://abc", "sha256", digest_bytes(b"abc", "sha256")).check(
            ...     size=3, digest=None, algo=None).has_footer
            False
        """
        if size is not None and size != self.size:
            raise CorruptCheckpointError(
                f"{self.name}: {self.size} bytes but {size} recorded; restore an older checkpoint."
            )
        algo = check_algo(algo or self.algo)
        # Another algorithm than the one the stream was hashed with (an old sha256 record):
        # one hash in that algorithm is the only honest comparison.
        mine = self.digest if algo == self.algo else digest_bytes(self.data, algo)
        if digest is not None and mine != digest.lower():
            raise CorruptCheckpointError(
                f"{self.name}: {algo} {mine[:12]}... does not match the recorded {digest[:12]}...; "
                "restore an older checkpoint."
            )
        f = self.open()
        status, found = _inspect_footer(f, self.size)  # the tail only: no hashing
        if status == "damaged":
            raise CorruptCheckpointError(
                f"{self.name}: its integrity footer is damaged or cut off; restore an older checkpoint."
            )
        return FileDigest(self.size, mine, found[1] if found else None, algo)
