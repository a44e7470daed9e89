"""Loading one managed save: check everything that is cheap before anything that is not.

:meth:`~ckpt_lesson.runs.manager.CheckpointManager.restore_latest` walks the saves
newest first and hands each candidate folder to :func:`load_save`. The order of
the checks inside is the lesson:

1. the manifest parses and names the right step (a few hundred bytes);
2. the resume contract passes, from the manifest alone: same data, model,
   config and environment, every bucket covered (nothing loaded yet);
3. every part exists with its recorded size (a ``stat`` each, no reading);
4. every part hashes to its recorded digest, and only then is the payload
   unpickled (safely, ``weights_only``) and applied.

A save is a local folder, or (a restore from an object store) a save whose
parts were verified into memory as they downloaded; for those, steps 3 and 4's
hashing is already done and only the weights-only load remains
(:mod:`ckpt_lesson.runs.save_source`).

Damage (``CorruptCheckpointError``, ``IncompleteCheckpointError``) makes the
manager try the next older save. Anything else (a contract that does not match,
a model that does not fit, an unknown schema) is raised as it is: an older save
of the same run would be refused the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
)
from ckpt_lesson.files.checkpoint import BUCKETS, TrainState, apply_payload, read_checkpoint
from ckpt_lesson.files.integrity import part_digest
from ckpt_lesson.files.payload import PARTS_SCHEMA
from ckpt_lesson.files.schema import current_env
from ckpt_lesson.files.sharded import load_sharded_checkpoint
from ckpt_lesson.runs.contract import ResumeReport, check_contract, resume_report
from ckpt_lesson.runs.save_source import (
    Candidates,
    SaveSource,
    check_parts_present,
    source_folder,
    source_manifest,
    source_part,
    verify_other_parts,
)
from ckpt_lesson.runs.scan import step_dir_name

__all__ = [
    "check_parts_present",  # from save_source, where they learned to pass a save in memory
    "check_resume_contract",
    "load_newest_good",
    "load_positional",
    "load_save",
    "restore_newest",
    "verify_other_parts",
]

# The manager's messages, under the manager's logger name (see ckpt_lesson.runs.commit for why).
log = logging.getLogger("ckpt_lesson.runs.manager")

#: ``check(target, manifest)``: raises when the save must not be resumed; see :func:`check_resume_contract`.
ContractCheck = Callable[[SaveSource, dict[str, Any]], None]


def load_save(
    target: SaveSource,
    step: int,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    *,
    map_location: Any,
    check_contract: ContractCheck,
    mmap: bool = True,
) -> tuple[dict[str, Any], TrainState]:
    """Verify one published save and restore it into the live objects.

    Args:
        target: The ``step-XXXXXXXX`` folder, or a save verified into memory
            (:class:`~ckpt_lesson.runs.save_source.VerifiedSave`, its parts already hashed).
        step: The step its name promises; manifest and payload must agree.
        model, optimizer, scheduler: Restored in place.
        map_location: As for ``torch.load``.
        check_contract: Called with ``(target, manifest)`` before any part is
            read; it raises to refuse the save.
        mmap: Copy the weights from a mapping of the verified file (see
            :func:`~ckpt_lesson.files.checkpoint.read_checkpoint`); ``False`` reads
            the file into memory, which no truncation by another process can disturb.

    Returns:
        ``(manifest, state)``.

    Raises:
        IncompleteCheckpointError: A part is missing.
        CorruptCheckpointError: Wrong step, size or digest, or an unreadable part.
        CheckpointError: Whatever ``check_contract`` or the loaders raise.

    Example:
        >>> no_contract = lambda target, manifest: None
        >>> manifest, state = load_save(  # doctest: +SKIP
        ...     run / "step-00000240", 240, model, opt, sched, map_location="cpu", check_contract=no_contract)
    """
    manifest = source_manifest(target)
    if manifest["step"] != step:
        raise CorruptCheckpointError(f"{target.name}: manifest records step {manifest['step']}")
    if manifest.get("payload_schema") == PARTS_SCHEMA:
        raise StateMismatchError(
            f"{target.name}: saved through the state API (mgr.save(step, state)); restore it the same way, "
            "with mgr.restore_latest({'model': model, 'optimizer': opt, ...})."
        )
    check_contract(target, manifest)
    check_parts_present(target, manifest)
    return load_positional(
        target, manifest, step, model, optimizer, scheduler, map_location=map_location, mmap=mmap
    )


def load_positional(
    target: SaveSource,
    manifest: dict[str, Any],
    step: int,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    *,
    map_location: Any,
    mmap: bool = True,
) -> tuple[dict[str, Any], TrainState]:
    """The positional save's payload, verified and applied (the end of :func:`load_save`)."""
    if manifest["layout"] == "single":
        by_name = {p["file"]: p for p in manifest["parts"]}
        verify_other_parts(target, manifest, skip={"checkpoint.pt"})
        # One pass: load_verified_file checks footer and the manifest's digest while hashing.
        path = source_part(target, "checkpoint.pt")
        algo, want = part_digest(by_name["checkpoint.pt"])
        payload = read_checkpoint(
            path, map_location=map_location, expected_digest=want, algo=algo, mmap_model=mmap
        )
        saved = TrainState.from_dict(payload["state"], source=str(path))
        if saved.step != step:
            raise CorruptCheckpointError(f"{target.name}: payload holds step {saved.step}")
        return manifest, apply_payload(payload, model, optimizer, scheduler, source=str(path))
    # Sharded: pin index.json to the manifest; the loader checks every shard against the index.
    verify_other_parts(target, manifest, skip=set())
    state = load_sharded_checkpoint(
        source_folder(target), model, optimizer, scheduler, map_location=map_location
    )
    if state.step != step:
        # Everything was applied already; the next (older) candidate replaces all five buckets.
        raise CorruptCheckpointError(f"{target.name}: payload holds step {state.step}")
    return manifest, state


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
            verified into memory; see :mod:`~ckpt_lesson.runs.save_source`).
        load: ``load(source, step) -> (manifest, result)``: :func:`load_save` with the live
            objects bound, or the state API's ``load_state_save``; raises on damage.
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
        ...     folder_candidates(run_dir, [40, 80]), load, skipped=[])
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


def restore_newest(
    candidates: Candidates,
    load: Callable[[SaveSource, int], tuple[dict[str, Any], Any]],
    *,
    record: dict[str, Any],
) -> tuple[int, Any] | None:
    """:func:`load_newest_good`, filling ``record`` (the manager's ``last_restore``) as it goes.

    Args:
        record: Filled with ``step``, ``save_id``, ``path``, ``skipped`` and
            ``manifest`` at once (so a failed restore still reports what it
            skipped), and ``layout`` and ``seconds`` after a restore.

    Returns:
        ``(step, result)``, or ``None`` when there are no candidates (a fresh start).

    Raises:
        CheckpointError: As :func:`load_newest_good`.

    Example:
        >>> found = restore_newest(folder_candidates(run_dir, [40, 80]), load, record={})  # doctest: +SKIP
    """
    started = time.perf_counter()
    skipped: list[dict[str, Any]] = []
    record.update(step=None, save_id=None, path=None, skipped=skipped, manifest=None)
    if not candidates.steps:
        log.info("%s: no saves; starting fresh", candidates.where)
        return None
    step, target, manifest, state = load_newest_good(candidates, load, skipped=skipped)
    record.update(
        step=step,
        save_id=manifest.get("save_id"),
        path=str(target),
        layout=manifest["layout"],
        manifest=manifest,
        seconds=time.perf_counter() - started,
    )
    return step, state
