"""Distributed checkpoints: DCP saves with the package's commit protocol and verified restores.

Save and restore a multi-rank run (FSDP2, DDP or plain data parallel) through
``torch.distributed.checkpoint``: every file hashed while it is written, one
manifest, a commit on rank 0 (a rename in a folder, a conditional marker
under a lease in an object store), each rank's RNG and data position under
its own key, and a restore that verifies every file (the ranks share the
hashing) and unpickles nothing unverified or unsafe.

Start with :class:`DistributedCheckpointManager`.
"""

from __future__ import annotations

from ckpt_lesson.files.hashing import hash_file  # notebook 13 re-hashes a part with it

from .comm import Comm, new_checkpoint_group
from .manager import DistributedCheckpointManager
from .reader import VerifyingReader
from .restore import DistributedRestore
from .safe_metadata import RestrictedUnpickler, load_metadata_bytes
from .saving import FolderTarget
from .verify import verify_save
from .writer import CommitWriter, HashingFileSystem

__all__ = [
    "Comm",
    "CommitWriter",
    "DistributedCheckpointManager",
    "DistributedRestore",
    "FolderTarget",
    "HashingFileSystem",
    "RestrictedUnpickler",
    "VerifyingReader",
    "hash_file",
    "load_metadata_bytes",
    "new_checkpoint_group",
    "verify_save",
]
