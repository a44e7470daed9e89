"""Loading one managed save: check everything that is cheap before anything that is not.

:meth:`~ckpt_lesson.runs.manager.CheckpointManager.restore_latest` walks the saves
newest first (:func:`load_newest_good`) and hands each candidate to :func:`load_save`,
whichever call form it was given: the state API's mapping of parts, or the positional
``(model, optimizer, scheduler)``, which is the same load with the buckets seen as
the parts ``model``, ``optimizer``, ``scheduler``. The order of the checks inside is the lesson:

1. the manifest parses and names the right step (a few hundred bytes);
2. the resume contract passes, from the manifest alone: same data, model,
   config and environment, every bucket covered (nothing loaded yet);
3. every part exists with its recorded size (a ``stat`` each, no reading);
4. every part hashes to its recorded digest, and only then is the payload
   unpickled (safely, ``weights_only``), its step checked, and applied.

A save is read from its local ``step-XXXXXXXX`` folder, or from a :class:`VerifiedSave`
whose parts were hashed as they streamed down (:mod:`ckpt_lesson.runs.store_restore`,
which tells that path): one restore for both (:data:`SaveSource`), not a second copy of it.

Damage (``CorruptCheckpointError``, ``IncompleteCheckpointError``) makes the
manager try the next save. Anything else (a contract that does not match,
a model that does not fit, an unknown schema) is raised as it is: an older save
of the same run would be refused the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Union

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
)
from ckpt_lesson.files.apply import apply_state_payload, parts_view
from ckpt_lesson.files.checkpoint import TrainState, apply_payload, read_checkpoint, read_state_payload
from ckpt_lesson.files.hashing import part_digest
from ckpt_lesson.files.payload import PARTS_SCHEMA
from ckpt_lesson.files.safe_read import read_json_file
from ckpt_lesson.files.shard_index import INDEX_NAME
from ckpt_lesson.files.sharded import load_sharded_checkpoint
from ckpt_lesson.files.verify import VerifiedBytes, verify_record
from ckpt_lesson.runs.commit import log  # the manager's messages, under its logger name
from ckpt_lesson.runs.layout import read_manifest, step_dir_name

__all__ = ["Candidates", "SaveSource", "VerifiedSave", "load_newest_good", "load_save"]


@dataclass(eq=False)
class VerifiedSave:
    """One committed save whose every part was verified against its manifest while it downloaded.

    Attributes:
        name: The save's folder name, ``step-XXXXXXXX`` (messages name it like a local save).
        url: Where it lives, e.g. ``s3://bucket/run/step-00000240``; ``str()`` gives it.
        manifest: The manifest, matched to the commit marker and sealed-checked.
        parts: ``{file name: its verified bytes}``, one entry per manifest part.

    Example:
        >>> save = VerifiedSave("step-00000240", "s3://b/run/step-00000240", {"parts": []})
        >>> str(save)
        's3://b/run/step-00000240'
    """

    name: str
    url: str
    manifest: dict[str, Any]
    parts: dict[str, VerifiedBytes] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.url


#: A save to restore: its local folder, or its verified bytes in memory.
SaveSource = Union[Path, VerifiedSave]  # noqa: UP007 - a runtime alias; ``X | Y`` needs no quotes from 3.10 on


class Candidates(NamedTuple):
    """The saves a restore may choose from, and how to open one.

    Attributes:
        where: The run, for messages (a folder or a URL).
        steps: Their steps, ascending; the restore tries them newest first.
        open: ``open(step) -> SaveSource``; it may raise damage
            (``CorruptCheckpointError``, ``IncompleteCheckpointError``), which
            makes the restore try the next older step.
        noun: What the saves are called in the "none is usable" message.
        hint: The last line of that message: where to look next.
        relist: ``relist() -> steps``: the saves there are *now*, asked again when
            a candidate vanished or turned out damaged (another process's
            retention, or its next save, changes the run while it is restored).
    """

    where: str
    steps: list[int]
    open: Callable[[int], SaveSource]
    noun: str = "save(s)"
    hint: str = "Copy the folder for inspection; 'python -m ckpt_lesson scan DIR' shows the same list."
    relist: Callable[[], list[int]] | None = None


def load_save(
    target: SaveSource,
    step: int,
    into: Mapping[str, Any] | tuple[Any, Any, Any],
    *,
    strict: bool = True,
    map_location: Any = "cpu",
    check_contract: Callable[[SaveSource, dict[str, Any]], None],
    mmap: bool = True,
    check_values: Callable[[dict[str, Any], int], None] | None = None,
) -> tuple[dict[str, Any], Any]:
    """Verify one published save and restore it into the live objects.

    Args:
        target: The ``step-XXXXXXXX`` folder, or a save verified into memory
            (a :class:`VerifiedSave`, its parts already hashed).
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
        check_values: State API: called with the saved values and the step once the payload
            is read and before anything is applied; it raises to refuse the save.

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
    # A save in memory: its manifest is the one the marker pinned, and every part's size and
    # digest were checked as it streamed in, so the folder's stat and hash steps are skipped.
    in_memory = isinstance(target, VerifiedSave)
    manifest = target.manifest if in_memory else read_manifest(target)
    if manifest["step"] != step:
        raise CorruptCheckpointError(f"{target.name}: manifest records step {manifest['step']}")
    parts_save = manifest.get("payload_schema") == PARTS_SCHEMA
    if positional and parts_save:
        raise StateMismatchError(
            f"{target.name}: saved through the state API (mgr.save(step, state)); restore it the same way, "
            "with mgr.restore_latest({'model': model, 'optimizer': opt, ...})."
        )
    check_contract(target, manifest)
    for part in [] if in_memory else manifest["parts"]:  # presence and size first: a stat each, free
        path, want = target / part["file"], part["bytes"]
        if not path.is_file() or path.is_symlink():
            raise IncompleteCheckpointError(f"{target.name}: part {part['file']} is missing")
        if (size := path.stat().st_size) != want:
            raise CorruptCheckpointError(f"{target.name}: {part['file']}: size {size} != recorded {want}")
    source: Any = target
    if manifest["layout"] == "single":
        algo, want = part_digest({p["file"]: p for p in manifest["parts"]}["checkpoint.pt"])
        if in_memory:
            source = target.parts["checkpoint.pt"]
        else:
            _verify_other_parts(target, manifest, skip={"checkpoint.pt"})
            source = target / "checkpoint.pt"
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
        # Sharded loaders read a folder: the store restore hands a sharded save over as a
        # verified folder in its cache, never in memory (store_restore.open_verified).
        _verify_other_parts(target, manifest, skip=set())  # pins index.json; the loader checks the rest
        if positional:  # the sharded positional loader applies as it reads
            state = load_sharded_checkpoint(target, *into, map_location=map_location)
            # Everything was applied already; the next (older) candidate replaces all five buckets.
            _check_step(target, state.step, step)
            return manifest, state
        payload = read_state_payload(target, map_location=map_location)
    if positional:
        _check_step(target, TrainState.from_dict(payload["state"], source=str(source)).step, step)
        return manifest, apply_payload(payload, *into, source=str(source))
    view = parts_view(payload, source=str(target))
    _check_step(target, view["step"], step)  # before anything is applied
    if check_values is not None:
        check_values(view["values"], step)
    restored = apply_state_payload(payload, into, source=str(target), strict=strict)
    # A save in memory has no local path; its URL says where it came from (as last_restore["path"]).
    restored.path = target if isinstance(target, Path) else str(target)
    restored.save_id = manifest.get("save_id")
    return manifest, restored


def _check_step(target: SaveSource, saved: int, step: int) -> None:
    if saved != step:
        raise CorruptCheckpointError(f"{target.name}: payload holds step {saved}")


def _verify_other_parts(target: Path, manifest: dict[str, Any], *, skip: set[str]) -> None:
    """Hash every manifest part except ``skip`` and, when sharded, the files the index covers."""
    if manifest["layout"] == "sharded":
        # Those are verified by the sharded loader, against the index.json pinned here. An
        # unreadable index skips nothing: every part is then hashed against the manifest instead.
        try:
            index = read_json_file(target / INDEX_NAME, what="index")
            entries = [*index["shards"], index["meta"]]
            skip = skip | {
                e["file"] for e in entries if isinstance(e, dict) and isinstance(e.get("file"), str)
            }
        except (OSError, ValueError, KeyError, TypeError):  # CorruptCheckpointError is a ValueError
            pass
    for part in manifest["parts"]:
        if part["file"] in skip:
            continue
        problem = verify_record(target / part["file"], part)
        if problem:
            raise CorruptCheckpointError(f"{target.name}: {problem}")


def load_newest_good(
    candidates: Candidates,
    load: Callable[[SaveSource, int], tuple[dict[str, Any], Any]],
    *,
    skipped: list[dict[str, Any]],
) -> tuple[int, SaveSource, dict[str, Any], Any]:
    """Try the saves newest first; load the first that verifies, skipping (and logging) damage.

    When a save turns out damaged or gone and ``candidates.relist`` is set, the
    saves are listed again and the newest one not tried yet comes next, newer
    ones included: a restore that races another process's retention (which
    deleted the save being read, after committing a newer one) follows the run.

    Args:
        candidates: The steps to try and how to open each (a folder, or a save
            verified into memory).
        load: ``load(source, step) -> (manifest, result)``: :func:`load_save` with the live
            objects bound; raises on damage.
        skipped: A list this function appends ``{"step", "status", "reason"}`` to,
            one per damaged or incomplete save passed over (the caller keeps it
            for its report even when this raises); with a re-listing also
            ``"relisted"``, the steps found then.

    Returns:
        ``(step, source, manifest, result)`` of the save that was loaded.

    Raises:
        CheckpointError: No save is usable (the message lists each one's
            reason), or an error that is not damage (an older save would not fix it).

    Example:
        >>> step, source, manifest, state = load_newest_good(  # doctest: +SKIP
        ...     mgr._restore_candidates(), load, skipped=[])
    """
    steps, tried = list(candidates.steps), set()
    while untried := [s for s in steps if s not in tried]:
        step = max(untried)  # the newest not tried yet: after a re-listing, possibly newer than the last
        tried.add(step)
        try:
            # Opening is inside: a download that finds a part damaged or gone is damage too.
            target = candidates.open(step)
            manifest, state = load(target, step)
        except (CorruptCheckpointError, IncompleteCheckpointError, OSError) as exc:
            # An OSError (EIO) reading a part is damage to this copy, like a wrong hash: fall back.
            # LoadEnvironmentError is not caught: once the hashes match, an older save would fail alike
            # (and a store that cannot be reached is no reason to pick an older save either).
            status = "incomplete" if isinstance(exc, IncompleteCheckpointError) else "corrupt"
            entry = {"step": step, "status": status, "reason": str(exc)}
            if candidates.relist is not None:
                # The run may have moved on meanwhile (another process's retention removed this save,
                # and its next save is newer): follow it rather than only falling back.
                steps = candidates.relist()
                newer = sorted(s for s in steps if s > step and s not in tried)
                entry["relisted"] = steps
                if newer:
                    entry["reason"] = (
                        f"{str(exc).rstrip('.')}. Listed the saves again: newer step(s) {newer} appeared; "
                        "trying them."
                    )
            skipped.append(entry)
            log.warning("restore: skipping %s (%s): %s", step_dir_name(step), status, entry["reason"])
            continue
        if skipped:
            which = "newer" if all(s["step"] > step for s in skipped) else "other"
            log.warning("restored step %d after skipping %d %s save(s)", step, len(skipped), which)
        else:
            log.info("restored step %d from %s", step, target)
        return step, target, manifest, state
    lines = "\n".join(f"  step {s['step']}: {s['status']}: {s['reason']}" for s in skipped)
    raise CheckpointError(
        f"{candidates.where}: {len(skipped)} {candidates.noun} found but none is usable:\n{lines}\n"
        f"Nothing was restored. {candidates.hint}"
    )
