"""What a mapped restore may keep mapped, and what it must copy out first.

``load_checkpoint(mmap=True)`` (the default) maps the verified private copy of
the file and lets ``model.load_state_dict`` copy the weights straight from it.
A tensor left on that mapping keeps the whole copy (the file's size) in memory,
and a tensor written in place (an optimizer's moment) would be copied page by
page beside it. (Until round four the mapping was of the file itself, and a
truncation by another process killed the restore with SIGBUS.)

So nothing mapped may outlive the restore:

* every bucket but ``model`` is copied out at once (the optimizer would
  otherwise keep its moments mapped: ``Optimizer.load_state_dict`` keeps a
  tensor that already has the parameter's dtype and device). A large record is
  already in a buffer of its own, which the hash pass filled (then nothing is
  copied); a copy otherwise lands in memory a helper thread faulted in while the
  file was being hashed (:mod:`~ckpt_lesson.files.fresh_memory`), so it costs a
  memcpy, not a page fault per 4 KiB;
* in ``model``, parameters and buffers are *copied* by ``load_state_dict``
  (``param.copy_(saved)``), but **extra state** (``*._extra_state``) is handed
  to the module's ``set_extra_state`` as it is, and a module may keep it. It is
  copied out here too.

The copy is sealed (:mod:`~ckpt_lesson.files.private_copy`): nobody can change
or truncate what the tensors map, so the SIGBUS window while ``load_state_dict``
copies the weights is closed, with ``mmap=True`` and ``mmap=False`` alike
(``tests/test_mapped_restore.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ckpt_lesson.files.fresh_memory import FreshMemory
from ckpt_lesson.files.integrity import FileDigest
from ckpt_lesson.files.loading import load_verified_file
from ckpt_lesson.files.verified_bytes import VerifiedBytes

__all__ = ["EXTRA_STATE_SUFFIX", "copy_out", "keep_no_mapped_extra_state", "load_with_private_copies"]

#: torch's suffix for a module's extra state in ``state_dict()`` (``_EXTRA_STATE_KEY_SUFFIX``).
EXTRA_STATE_SUFFIX = "_extra_state"


def copy_out(tree: Any, *, fresh: FreshMemory | None = None) -> Any:
    """``tree`` with every CPU tensor cloned into memory of its own (device tensors are copies already).

    Every mapped restore calls this on what it keeps: a tensor still backed by the
    copy's mapping would keep the whole copy alive (and, written in place, double). Tensors
    that ``map_location`` already moved to a device are copies; cloning them again
    would only double, for a moment, the device memory they take. A dict keeps its
    type when it is an ``OrderedDict`` (state dicts are). With ``fresh``, a tensor
    is copied into a buffer that was faulted in while the file was hashed, when
    one of its size is ready (see :mod:`~ckpt_lesson.files.fresh_memory`).

    Example:
        >>> copy_out({"t": [torch.zeros(2)]})["t"][0].sum().item()
        0.0
    """
    if isinstance(tree, torch.Tensor):
        if tree.device.type != "cpu":
            return tree
        return fresh.copy(tree) if fresh is not None else tree.clone()
    if isinstance(tree, dict):
        kind = OrderedDict if isinstance(tree, OrderedDict) else dict
        return kind((k, copy_out(v, fresh=fresh)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(copy_out(v, fresh=fresh) for v in tree)
    return tree


def keep_no_mapped_extra_state(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with every ``*._extra_state`` entry of its ``model`` bucket copied out of the mapping.

    Args:
        payload: A loaded checkpoint payload (``{"model": state_dict, ...}``).

    Returns:
        The same payload; only the ``model`` bucket is replaced (a shallow copy).

    Example:
        >>> keep_no_mapped_extra_state({"model": {"w": torch.ones(1)}})["model"]["w"].item()
        1.0
    """
    model = payload.get("model")
    if not isinstance(model, dict) or not any(
        isinstance(k, str) and k.endswith(EXTRA_STATE_SUFFIX) for k in model
    ):
        return payload
    fixed = {
        k: copy_out(v) if isinstance(k, str) and k.endswith(EXTRA_STATE_SUFFIX) else v
        for k, v in model.items()
    }
    return {**payload, "model": fixed}


def load_with_private_copies(
    path: Any, private: Callable[[Any, FreshMemory], Any], *, mmap: bool, **load_kwargs: Any
) -> tuple[Any, FileDigest]:
    """:func:`~ckpt_lesson.files.loading.load_verified_file`, keeping mapped only what ``private`` leaves.

    On a mapped load of a file, ``private(payload, fresh)`` returns the payload with
    what must not stay mapped copied out, into ``fresh``'s memory (faulted in while
    the file was hashed). A read load, or bytes already in memory, are private
    already and come back as loaded.

    Args:
        path: As for ``load_verified_file``.
        private: The copying rule of the payload's format.
        mmap: Map the verified file.
        load_kwargs: The other keywords of ``load_verified_file``.

    Returns:
        The payload and the file's digest.

    Raises:
        CheckpointError: As ``load_verified_file``.

    Example:
        >>> payload, digest = load_with_private_copies(  # doctest: +SKIP
        ...     "c.pt", lambda p, fresh: copy_out(p, fresh=fresh), mmap=True)
    """
    with FreshMemory() as fresh:
        payload, digest = load_verified_file(path, mmap=mmap, fresh=fresh, **load_kwargs)
        if mmap and not isinstance(path, VerifiedBytes):
            payload = private(payload, fresh)
    return payload, digest
