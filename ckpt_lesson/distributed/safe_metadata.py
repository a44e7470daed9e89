"""Read DCP's ``.metadata`` without giving its bytes a way to run code.

``.metadata`` is a pickle, and stock DCP reads it with plain ``pickle.load``:
a pickle names any importable callable and calls it, so a crafted file runs
whatever it likes the moment it is opened. Two defences, in this order:

1. the bytes are hashed and compared with the manifest *before* they are
   parsed, and parsed from that same buffer (no second read that could differ);
2. they are parsed by :class:`RestrictedUnpickler`, which resolves only the
   names DCP's own metadata needs: its dataclasses, ``torch.Size``, dtypes and
   layouts. Anything else (``os.system``, ``builtins.eval``, a class with a
   hostile ``__reduce__``) is refused by name before it is looked up.

The hash catches damage; the allowlist is what stops a file that was crafted
*and* given a matching manifest. After parsing, the result's shape is checked
too: every item must point into a file the manifest lists, inside its size.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.serialization import _get_layout

from ckpt_lesson.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = [
    "ALLOWED_GLOBALS",
    "RestrictedUnpickler",
    "load_metadata_bytes",
    "weights_only_refusal",
]

#: (module, name) -> object: everything a DCP ``.metadata`` written by torch 2.6-2.13 refers to.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
}
ALLOWED_GLOBALS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
ALLOWED_GLOBALS[("torch", "Size")] = torch.Size
# A layout pickles as a call to this lookup with its name; it only ever returns a torch.layout.
ALLOWED_GLOBALS[("torch.serialization", "_get_layout")] = _get_layout
_MAX_METADATA_BYTES = 256 << 20


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`ALLOWED_GLOBALS` and ``torch`` dtypes.

    Example:
        >>> import pickle
        >>> RestrictedUnpickler(io.BytesIO(pickle.dumps(torch.Size([2, 3])))).load()
        torch.Size([2, 3])
        >>> RestrictedUnpickler(io.BytesIO(pickle.dumps(print))).load()
        Traceback (most recent call last):
        ...
        ckpt_lesson.errors.UnsafeCheckpointError: .metadata refers to builtins.print, ...
    """

    def find_class(self, module: str, name: str) -> Any:
        allowed = ALLOWED_GLOBALS.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # a dtype pickles as a reference to torch.<name>
        raise UnsafeCheckpointError(
            f".metadata refers to {module}.{name}, which DCP's metadata never contains; the file "
            "was crafted or written by something else. Nothing was executed; move this save aside "
            "and restore an older one."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(".metadata uses persistent ids, which DCP's metadata never does.")


def load_metadata_bytes(data: bytes, *, data_files: dict[str, int], where: str) -> Metadata:
    """Parse verified ``.metadata`` bytes and check the result's shape.

    Args:
        data: The file's bytes, already compared with the manifest.
        data_files: Every data file the manifest lists -> its size.
        where: Names the save in messages.

    Returns:
        DCP's ``Metadata``.

    Raises:
        UnsafeCheckpointError: The pickle refers to anything outside the allowlist.
        CorruptCheckpointError: Not a pickle, not a ``Metadata``, or an item
            points outside the listed files.

    Example:
        >>> sizes = {"__0_0.distcp": 9120}
        >>> metadata = load_metadata_bytes(raw, data_files=sizes, where="step 4")  # doctest: +SKIP
    """
    if len(data) > _MAX_METADATA_BYTES:
        raise CorruptCheckpointError(
            f"{where}: .metadata is {len(data)} bytes, over the cap; refusing to parse."
        )
    try:
        metadata = RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # any parse failure of verified bytes: a writer bug or a hostile file
        raise CorruptCheckpointError(
            f"{where}: .metadata does not parse ({type(exc).__name__}: {exc})."
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(
            f"{where}: .metadata holds a {type(metadata).__name__}, not DCP Metadata."
        )
    if not isinstance(metadata.state_dict_metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, (TensorStorageMetadata, BytesStorageMetadata))
        for k, v in metadata.state_dict_metadata.items()
    ):
        raise CorruptCheckpointError(f"{where}: .metadata's key table is malformed.")
    if not isinstance(metadata.storage_data, dict):
        raise CorruptCheckpointError(f"{where}: .metadata has no storage table.")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CorruptCheckpointError(f"{where}: .metadata's storage table is malformed.")
        if info.relative_path not in data_files:
            raise CorruptCheckpointError(
                f"{where}: .metadata points {index.fqn!r} at {info.relative_path!r}, "
                "which the manifest does not list."
            )
        if info.transform_descriptors:
            raise CorruptCheckpointError(
                f"{where}: {index.fqn!r} uses stream transforms, which this reader refuses."
            )
        if (
            not isinstance(info.offset, int)
            or not isinstance(info.length, int)
            or info.offset < 0
            or info.length < 0
            or info.offset + info.length > data_files[info.relative_path]
        ):
            raise CorruptCheckpointError(f"{where}: {index.fqn!r} lies outside {info.relative_path}.")
    return metadata


def weights_only_refusal(exc: BaseException) -> str:
    """The one line of a weights-only refusal that names what was refused.

    ``torch.load(weights_only=True)`` explains at length, with terminal colour
    codes, how to turn the check off; a message of ours should say what the file
    asked for and nothing about switching the protection off.

    Example:
        >>> weights_only_refusal(pickle.UnpicklingError("Weights only load failed.\\n"
        ...     "\\tWeightsUnpickler error: Unsupported global: GLOBAL builtins.exec was not allowed"))
        'Unsupported global: GLOBAL builtins.exec was not allowed'
    """
    text = str(exc)
    marker = "WeightsUnpickler error:"
    line = next((ln for ln in text.splitlines() if marker in ln), text.splitlines()[0] if text else "")
    line = line.split(marker, 1)[-1].split(". Please use", 1)[0].strip()
    return "".join(ch for ch in line if ch.isprintable())  # no terminal escape codes
