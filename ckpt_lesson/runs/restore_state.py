"""Loading one managed save through the state API: the same checks, any mapping of parts.

The order is :mod:`ckpt_lesson.runs.restore`'s: manifest and step, the resume
contract, every part present with its size, every byte hashed, and only then a
weights-only load and the checks of each part against the live state. A
positional save (``ckpt.v2``, single file) restores through this API too, its
buckets seen as the parts ``model``, ``optimizer``, ``scheduler`` and the
values ``train_state`` and ``extras``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CorruptCheckpointError, StateMismatchError
from ckpt_lesson.files.apply import Restored, apply_state_payload, parts_view
from ckpt_lesson.files.checkpoint import read_checkpoint, read_state_payload
from ckpt_lesson.files.integrity import part_digest
from ckpt_lesson.files.payload import PARTS_SCHEMA
from ckpt_lesson.runs.restore import ContractCheck, load_save
from ckpt_lesson.runs.save_source import (
    SaveSource,
    check_parts_present,
    source_folder,
    source_manifest,
    source_part,
    verify_other_parts,
)
from ckpt_lesson.runs.state_args import check_state_mapping, positional_restore_args

__all__ = ["load_state_save", "loader_for"]


def load_state_save(
    target: SaveSource,
    step: int,
    state: Mapping[str, Any],
    *,
    strict: bool,
    map_location: Any,
    check_contract: ContractCheck,
    mmap: bool = False,
) -> tuple[dict[str, Any], Restored]:
    """Verify one published save and restore it into the live ``state`` mapping.

    Args:
        target: The ``step-XXXXXXXX`` folder, or a save verified into memory
            (:class:`~ckpt_lesson.runs.save_source.VerifiedSave`).
        step: The step its name promises; manifest and payload must agree.
        state: The live ``{name: part}`` mapping; objects are restored in place.
        strict: Refuse parts present on one side only.
        map_location: As for ``torch.load``.
        check_contract: Called with ``(target, manifest)`` before any part is read.
        mmap: Map the verified single file and copy every tensor out of the mapping
            (a state-API payload keeps no tensor mapped); ``False`` reads it into memory.

    Returns:
        ``(manifest, restored)``.

    Raises:
        IncompleteCheckpointError: A part is missing.
        CorruptCheckpointError: Wrong step, size or digest, or an unreadable part.
        StateMismatchError: The save does not fit ``state`` (named by part).

    Example:
        >>> manifest, restored = load_state_save(  # doctest: +SKIP
        ...     run / "step-00000240", 240, {"model": model}, strict=True, map_location="cpu",
        ...     check_contract=lambda target, manifest: None)
    """
    manifest = source_manifest(target)
    if manifest["step"] != step:
        raise CorruptCheckpointError(f"{target.name}: manifest records step {manifest['step']}")
    check_contract(target, manifest)
    check_parts_present(target, manifest)
    parts_save = manifest.get("payload_schema") == PARTS_SCHEMA
    if manifest["layout"] == "single":
        verify_other_parts(target, manifest, skip={"checkpoint.pt"})
        algo, want = part_digest({p["file"]: p for p in manifest["parts"]}["checkpoint.pt"])
        path = source_part(target, "checkpoint.pt")
        # One pass: the loader checks footer and the manifest's digest while hashing.
        if parts_save:
            payload = read_state_payload(
                path, map_location=map_location, expected_digest=want, algo=algo, mmap=mmap
            )
        else:
            payload = read_checkpoint(
                path, map_location=map_location, expected_digest=want, algo=algo, mmap_model=mmap
            )
    elif parts_save:
        verify_other_parts(target, manifest, skip=set())  # pins index.json; the loader checks the rest
        payload = read_state_payload(source_folder(target), map_location=map_location)
    else:
        raise StateMismatchError(
            f"{target.name}: a sharded positional save; restore it with "
            "restore_latest(model, optimizer, scheduler), or save through the state API from now on."
        )
    saved_step = parts_view(payload, source=str(target))["step"]
    if saved_step != step:  # before anything is applied: an older save is tried next
        raise CorruptCheckpointError(f"{target.name}: payload holds step {saved_step}")
    restored = apply_state_payload(payload, state, source=str(target), strict=strict)
    # A save in memory has no local path; its URL says where it came from (as last_restore["path"]).
    restored.path = target if isinstance(target, Path) else str(target)
    restored.save_id = manifest.get("save_id")
    return manifest, restored


def loader_for(
    args: tuple[Any, ...], *, strict: bool, map_location: Any, mmap: bool, check_contract: ContractCheck
) -> Callable[[SaveSource, int], tuple[dict[str, Any], Any]]:
    """``load(folder, step)`` for ``restore_latest(*args)``: the state API for one mapping, else positional.

    Raises:
        CheckpointError: Arguments of neither form (named by :mod:`~ckpt_lesson.runs.state_args`).
    """
    if len(args) == 1 and isinstance(args[0], Mapping):
        state = args[0]
        return lambda target, step: load_state_save(
            target,
            step,
            state,
            strict=strict,
            map_location=map_location,
            check_contract=check_contract,
            mmap=mmap,
        )
    if len(args) == 1:
        check_state_mapping(args[0])
    model, optimizer, scheduler = positional_restore_args(args)
    return lambda target, step: load_save(
        target,
        step,
        model,
        optimizer,
        scheduler,
        map_location=map_location,
        check_contract=check_contract,
        mmap=mmap,
    )
