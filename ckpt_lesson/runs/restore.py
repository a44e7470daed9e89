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

Damage (``CorruptCheckpointError``, ``IncompleteCheckpointError``) makes the
manager try the next older save. Anything else (a contract that does not match,
a model that does not fit, an unknown schema) is raised as it is: an older save
of the same run would be refused the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
)
from ckpt_lesson.files.checkpoint import BUCKETS, TrainState, apply_payload, read_checkpoint
from ckpt_lesson.files.integrity import part_digest
from ckpt_lesson.files.safe_read import read_json_file
from ckpt_lesson.files.schema import current_env
from ckpt_lesson.files.sharded import INDEX_NAME, load_sharded_checkpoint
from ckpt_lesson.files.state_payload import PARTS_SCHEMA
from ckpt_lesson.files.verify import verify_record
from ckpt_lesson.runs.contract import ResumeReport, check_contract, resume_report
from ckpt_lesson.runs.scan import read_manifest, step_dir_name

__all__ = [
    "check_parts_present",
    "check_resume_contract",
    "index_parts",
    "load_newest_good",
    "load_positional",
    "load_save",
    "restore_newest",
    "verify_other_parts",
]

# The manager's messages, under the manager's logger name (see ckpt_lesson.runs.commit for why).
log = logging.getLogger("ckpt_lesson.runs.manager")

#: ``check(target, manifest)``: raises when the save must not be resumed; see :func:`check_resume_contract`.
ContractCheck = Callable[[Path, dict[str, Any]], None]


def load_save(
    target: Path,
    step: int,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    *,
    map_location: Any,
    check_contract: ContractCheck,
    mmap: bool = True,
) -> tuple[dict[str, Any], TrainState]:
    """Verify one published save folder and restore it into the live objects.

    Args:
        target: The ``step-XXXXXXXX`` folder.
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
    manifest = read_manifest(target)
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


def check_parts_present(target: Path, manifest: dict[str, Any]) -> None:
    """Every manifest part exists with its recorded size: a ``stat`` each, no reading.

    Raises:
        IncompleteCheckpointError: A part is missing.
        CorruptCheckpointError: A part has another size.
    """
    for part in manifest["parts"]:  # presence and size first: free, and names a missing part exactly
        path = target / part["file"]
        if not path.is_file() or path.is_symlink():
            raise IncompleteCheckpointError(f"{target.name}: part {part['file']} is missing")
        if path.stat().st_size != part["bytes"]:
            size = path.stat().st_size
            raise CorruptCheckpointError(
                f"{target.name}: {part['file']}: size {size} != recorded {part['bytes']}"
            )


def load_positional(
    target: Path,
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
        path = target / "checkpoint.pt"
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
    state = load_sharded_checkpoint(target, model, optimizer, scheduler, map_location=map_location)
    if state.step != step:
        # Everything was applied already; the next (older) candidate replaces all five buckets.
        raise CorruptCheckpointError(f"{target.name}: payload holds step {state.step}")
    return manifest, state


def check_resume_contract(
    target: Path,
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


def verify_other_parts(target: Path, manifest: dict[str, Any], *, skip: set[str]) -> None:
    """Hash every manifest part except ``skip`` (and, when sharded, the files the index covers).

    Raises:
        CorruptCheckpointError: A part's size or digest differs from the manifest.

    Example:
        >>> verify_other_parts(target, manifest, skip={"checkpoint.pt"})  # doctest: +SKIP
    """
    if manifest["layout"] == "sharded":
        index = {p["file"] for p in index_parts(target)}
        skip = skip | index  # verified by the sharded loader, against the index pinned below
    for part in manifest["parts"]:
        if part["file"] in skip:
            continue
        problem = verify_record(target / part["file"], part)
        if problem:
            raise CorruptCheckpointError(f"{target.name}: {problem}")


def index_parts(target: Path) -> list[dict[str, Any]]:
    """Files the sharded index lists (shards + meta); read only after index.json itself is verified.

    An unreadable index yields ``[]``: every part is then hashed against the manifest instead.

    Example:
        >>> [p["file"] for p in index_parts(target)]  # doctest: +SKIP
        ['model.shard-000.pt', 'model.shard-001.pt', 'meta.pt']
    """
    try:
        index = read_json_file(target / INDEX_NAME, what="index")
        entries = [*index["shards"], index["meta"]]
        return [e for e in entries if isinstance(e, dict) and isinstance(e.get("file"), str)]
    except (OSError, ValueError, KeyError, TypeError):  # CorruptCheckpointError is a ValueError
        return []


def load_newest_good(
    run_dir: Path,
    steps: list[int],
    load: Callable[[Path, int], tuple[dict[str, Any], Any]],
    *,
    skipped: list[dict[str, Any]],
) -> tuple[int, Path, dict[str, Any], Any]:
    """Try the saves newest first; load the first that verifies, skipping (and logging) damage.

    Args:
        run_dir: The run directory; ``steps`` are its published steps, ascending.
        load: ``load(folder, step) -> (manifest, result)``: :func:`load_save` with the live
            objects bound, or the state API's ``load_state_save``; raises on damage.
        skipped: A list this function appends ``{"step", "status", "reason"}`` to,
            one per damaged or incomplete save passed over (the caller keeps it
            for its report even when this raises).

    Returns:
        ``(step, folder, manifest, result)`` of the save that was loaded.

    Raises:
        CheckpointError: No save is usable (the message lists each one's
            reason), or an error that is not damage (an older save would not fix it).
    """
    for step in reversed(steps):
        target = run_dir / step_dir_name(step)
        try:
            manifest, state = load(target, step)
        except (CorruptCheckpointError, IncompleteCheckpointError, OSError) as exc:
            # An OSError (EIO) reading a part is damage to this copy, like a wrong hash: fall back.
            # LoadEnvironmentError is not caught: once the hashes match, an older save would fail alike.
            status = "incomplete" if isinstance(exc, IncompleteCheckpointError) else "corrupt"
            skipped.append({"step": step, "status": status, "reason": str(exc)})
            log.warning("restore: skipping %s (%s): %s", target.name, status, exc)
            continue
        if skipped:
            log.warning("restored step %d after skipping %d newer save(s)", step, len(skipped))
        else:
            log.info("restored step %d from %s", step, target.name)
        return step, target, manifest, state
    lines = "\n".join(f"  step {s['step']}: {s['status']}: {s['reason']}" for s in skipped)
    raise CheckpointError(
        f"{run_dir}: {len(skipped)} save(s) found but none is usable:\n{lines}\n"
        "Nothing was restored. Copy the folder for inspection; "
        "'python -m ckpt_lesson scan DIR' shows the same list."
    )


def restore_newest(
    run_dir: Path,
    steps: list[int],
    load: Callable[[Path, int], tuple[dict[str, Any], Any]],
    *,
    record: dict[str, Any],
) -> tuple[int, Any] | None:
    """:func:`load_newest_good`, filling ``record`` (the manager's ``last_restore``) as it goes.

    Args:
        record: Filled with ``step``, ``save_id``, ``path``, ``skipped`` and
            ``manifest`` at once (so a failed restore still reports what it
            skipped), and ``layout`` and ``seconds`` after a restore.

    Returns:
        ``(step, result)``, or ``None`` when ``steps`` is empty (a fresh start).

    Raises:
        CheckpointError: As :func:`load_newest_good`.

    Example:
        >>> found = restore_newest(run_dir, [40, 80], load, record={})  # doctest: +SKIP
    """
    started = time.perf_counter()
    skipped: list[dict[str, Any]] = []
    record.update(step=None, save_id=None, path=None, skipped=skipped, manifest=None)
    if not steps:
        log.info("%s: no saves; starting fresh", run_dir)
        return None
    step, target, manifest, state = load_newest_good(run_dir, steps, load, skipped=skipped)
    record.update(
        step=step,
        save_id=manifest.get("save_id"),
        path=str(target),
        layout=manifest["layout"],
        manifest=manifest,
        seconds=time.perf_counter() - started,
    )
    return step, state
