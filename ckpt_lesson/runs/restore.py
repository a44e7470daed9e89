"""Loading one managed save: check everything that is cheap before anything that is not.

:meth:`~ckpt_lesson.runs.manager.CheckpointManager.restore_latest` walks the saves
newest first and hands each candidate to :func:`load_save`, whichever call form
it was given: the state API's mapping of parts, or the positional
``(model, optimizer, scheduler)``, which is the same load with the buckets seen as
the parts ``model``, ``optimizer``, ``scheduler``. The order of the checks inside is the lesson:

1. the manifest parses and names the right step (a few hundred bytes);
2. the resume contract passes, from the manifest alone: same data, model,
   config and environment, every bucket covered (nothing loaded yet);
3. every part exists with its recorded size (a ``stat`` each, no reading);
4. every part hashes to its recorded digest, and only then is the payload
   unpickled (safely, ``weights_only``), its step checked, and applied.

A save is a local folder, or (a restore from an object store) a save whose
parts were verified into memory as they downloaded; for those, steps 3 and 4's
hashing is already done and only the weights-only load remains
(:mod:`ckpt_lesson.runs.save_source`).

Damage (``CorruptCheckpointError``, ``IncompleteCheckpointError``) makes the
manager try the next save. Anything else (a contract that does not match,
a model that does not fit, an unknown schema) is raised as it is: an older save
of the same run would be refused the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CorruptCheckpointError, StateMismatchError
from ckpt_lesson.files.apply import apply_state_payload, parts_view
from ckpt_lesson.files.checkpoint import (
    BUCKETS,
    TrainState,
    apply_payload,
    read_checkpoint,
    read_state_payload,
)
from ckpt_lesson.files.hashing import part_digest
from ckpt_lesson.files.payload import PARTS_SCHEMA
from ckpt_lesson.files.schema import current_env
from ckpt_lesson.files.sharded import load_sharded_checkpoint
from ckpt_lesson.runs.contract import ResumeReport, check_contract, resume_report
from ckpt_lesson.runs.save_source import (
    SaveSource,
    check_parts_present,
    source_folder,
    source_manifest,
    source_part,
    verify_other_parts,
)
from ckpt_lesson.runs.state_args import check_state_mapping, positional_restore_args

__all__ = [
    "check_parts_present",  # from save_source, where they learned to pass a save in memory
    "check_resume_contract",
    "load_save",
    "loader_for",
    "verify_other_parts",
]

# The manager's messages, under the manager's logger name (see ckpt_lesson.runs.commit for why).
log = logging.getLogger("ckpt_lesson.runs.manager")

#: ``check(target, manifest)``: raises when the save must not be resumed; see :func:`check_resume_contract`.
ContractCheck = Callable[[SaveSource, dict[str, Any]], None]
#: Where a save is restored to: the state API's ``{name: part}`` mapping, or ``(model, optimizer, scheduler)``
Into = Mapping[str, Any] | tuple[Any, Any, Any]


def load_save(
    target: SaveSource,
    step: int,
    into: Into,
    *,
    strict: bool = True,
    map_location: Any = "cpu",
    check_contract: ContractCheck,
    mmap: bool = True,
) -> tuple[dict[str, Any], Any]:
    """Verify one published save and restore it into the live objects.

    Args:
        target: The ``step-XXXXXXXX`` folder, or a save verified into memory
            (:class:`~ckpt_lesson.runs.save_source.VerifiedSave`, its parts already hashed).
        step: The step its name promises; manifest and payload must agree.
        into: The live ``{name: part}`` mapping (state API), or ``(model, optimizer, scheduler)``;
            objects are restored in place.
        strict: State API: refuse parts present on one side only.
        map_location: As for ``torch.load``.
        check_contract: Called with ``(target, manifest)`` before any part is
            read; it raises to refuse the save.
        mmap: Copy the weights from a mapping of the verified file (see
            :func:`~ckpt_lesson.files.checkpoint.read_checkpoint`); ``False`` reads
            the file into memory, which no truncation by another process can disturb.

    Returns:
        ``(manifest, result)``: a :class:`~ckpt_lesson.files.apply.Restored` for the
        state API, the :class:`TrainState` for the positional form.

    Raises:
        IncompleteCheckpointError: A part is missing.
        CorruptCheckpointError: Wrong step, size or digest, or an unreadable part.
        StateMismatchError: The save does not fit ``into`` (named by part), or was written
            in a form this call cannot read (a state-API save restored positionally).
        CheckpointError: Whatever ``check_contract`` or the loaders raise.

    Example:
        >>> no_contract = lambda target, manifest: None
        >>> manifest, restored = load_save(  # doctest: +SKIP
        ...     run / "step-00000240", 240, {"model": model}, check_contract=no_contract)
    """
    positional = isinstance(into, tuple)
    manifest = source_manifest(target)
    if manifest["step"] != step:
        raise CorruptCheckpointError(f"{target.name}: manifest records step {manifest['step']}")
    parts_save = manifest.get("payload_schema") == PARTS_SCHEMA
    if positional and parts_save:
        raise StateMismatchError(
            f"{target.name}: saved through the state API (mgr.save(step, state)); restore it the same way, "
            "with mgr.restore_latest({'model': model, 'optimizer': opt, ...})."
        )
    check_contract(target, manifest)
    check_parts_present(target, manifest)
    source: Any = target
    if manifest["layout"] == "single":
        verify_other_parts(target, manifest, skip={"checkpoint.pt"})
        algo, want = part_digest({p["file"]: p for p in manifest["parts"]}["checkpoint.pt"])
        source = source_part(target, "checkpoint.pt")
        # One pass: the loader checks footer and the manifest's digest while hashing.
        if parts_save:
            payload = read_state_payload(
                source, map_location=map_location, expected_digest=want, algo=algo, mmap=mmap
            )
        else:
            payload = read_checkpoint(
                source, map_location=map_location, expected_digest=want, algo=algo, mmap_model=mmap
            )
    elif not (parts_save or positional):
        raise StateMismatchError(
            f"{target.name}: a sharded positional save; restore it with "
            "restore_latest(model, optimizer, scheduler), or save through the state API from now on."
        )
    else:
        verify_other_parts(target, manifest, skip=set())  # pins index.json; the loader checks the rest
        if positional:  # the sharded positional loader applies as it reads
            state = load_sharded_checkpoint(source_folder(target), *into, map_location=map_location)
            # Everything was applied already; the next (older) candidate replaces all five buckets.
            _check_step(target, state.step, step)
            return manifest, state
        payload = read_state_payload(source_folder(target), map_location=map_location)
    if positional:
        _check_step(target, TrainState.from_dict(payload["state"], source=str(source)).step, step)
        return manifest, apply_payload(payload, *into, source=str(source))
    _check_step(target, parts_view(payload, source=str(target))["step"], step)  # before anything is applied
    restored = apply_state_payload(payload, into, source=str(target), strict=strict)
    # A save in memory has no local path; its URL says where it came from (as last_restore["path"]).
    restored.path = target if isinstance(target, Path) else str(target)
    restored.save_id = manifest.get("save_id")
    return manifest, restored


def _check_step(target: SaveSource, saved: int, step: int) -> None:
    if saved != step:
        raise CorruptCheckpointError(f"{target.name}: payload holds step {saved}")


def loader_for(
    args: tuple[Any, ...], *, strict: bool, map_location: Any, mmap: bool, check_contract: ContractCheck
) -> Callable[[SaveSource, int], tuple[dict[str, Any], Any]]:
    """``load(source, step)`` for ``restore_latest(*args)``: the state API for one mapping, else positional.

    Raises:
        CheckpointError: Arguments of neither form (named by :mod:`~ckpt_lesson.runs.state_args`).
    """
    if len(args) == 1 and not isinstance(args[0], Mapping):
        check_state_mapping(args[0])
    into = args[0] if len(args) == 1 else positional_restore_args(args)
    return lambda target, step: load_save(
        target, step, into, strict=strict, map_location=map_location, check_contract=check_contract, mmap=mmap
    )


def check_resume_contract(
    target: SaveSource,
    manifest: dict[str, Any],
    *,
    expect: dict[str, Any],
    env_policy: str,
    emit: Callable[..., None],
) -> tuple[ResumeReport, list[str]]:
    """The resume contract, from the manifest alone: nothing is loaded before it passes.

    Not damage, so never skipped in favour of an older save: a save that
    covers fewer buckets, or belongs to other data, another model, config
    or environment, is refused, and older saves of the same run would be refused alike.

    Args:
        target: The save folder (for messages).
        manifest: Its parsed manifest.
        expect: What the resume must match (``data``, ``config_fingerprint``, ...).
        env_policy: ``"refuse"``, ``"warn"`` or ``"allow"`` an environment change.
        emit: ``emit(name, **info)``; called once with ``"resume_contract"``.

    Returns:
        The report (also logged) and the warnings :func:`~ckpt_lesson.runs.contract.check_contract` returned.

    Raises:
        StateMismatchError: The save does not cover every bucket.
        ContractMismatchError: Data, model, config or (per ``env_policy``) environment differ.

    Example:
        >>> report, warnings = check_resume_contract(  # doctest: +SKIP
        ...     target, manifest, expect={}, env_policy="refuse", emit=lambda name, **info: None)
    """
    covers = manifest.get("covers") if isinstance(manifest.get("covers"), list) else []
    # A state-API save covers the parts it was given; the restore compares them by name.
    required = () if manifest.get("payload_schema") == PARTS_SCHEMA else BUCKETS
    missing = [b for b in required if b not in covers]
    if missing:
        raise StateMismatchError(
            f"{target.name}: this save does not cover {missing}; a resume needs every bucket. "
            "Use warm_start_from() to start a new experiment from its weights."
        )
    report = resume_report(manifest, current={**expect, "env": current_env()})
    log.info("%s", report.format())
    emit("resume_contract", step=manifest["step"], save_id=manifest.get("save_id"), report=report)
    return report, check_contract(report, env_policy=env_policy)
