"""After a kill: what the dead process left in its checkpoint folder that is not a good save.

A :class:`~ckpt_lesson.CheckpointManager` folder, and the integrations' saves (a folder manifest,
a file footer), carry their own records and are judged exactly by ``scan_checkpoints``. A stock
writer's plain folder has no record: the best evidence left is "this file was being written in
place when the process was killed" (see :class:`~watch.SaveBurst`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.safe_read import parse_json_text
from ckpt_lesson.files.storage import open_storage
from ckpt_lesson.resume_test.watch import MANAGER, FolderWatcher, SaveBurst
from ckpt_lesson.runs.layout import published_steps, read_manifest, step_dir_name
from ckpt_lesson.runs.scan import scan_checkpoints
from ckpt_lesson.runs.store_commit import committed_steps, read_commit

__all__ = ["damage_after_kill", "newest_save", "newest_store_save"]


def newest_save(ckpt_dir: Path) -> dict[str, Any] | None:
    """The newest published save of a CheckpointManager folder, as the restart will find it.

    Returns:
        ``{"name", "step", "save_id", "covers"}`` from its manifest (``covers`` lists the saved
        parts, ``"rng"`` among them when the generators were saved); ``None`` when there is none
        or its manifest does not read (a damaged save is reported by :func:`damage_after_kill`).

    Example:
        >>> newest_save(Path("w/trial-01/ckpt"))  # doctest: +SKIP
        {'name': 'step-00000030', 'step': 30, 'save_id': 'ab7d...', 'covers': ['model', ..., 'rng']}
    """
    try:
        steps = published_steps(ckpt_dir)
        if not steps:
            return None
        folder = ckpt_dir / f"step-{steps[-1]:08d}"
        manifest = read_manifest(folder)
    except (OSError, CheckpointError):
        return None
    covers = manifest.get("covers")
    return {
        "name": folder.name,
        "step": steps[-1],
        "save_id": manifest.get("save_id") if isinstance(manifest.get("save_id"), str) else None,
        "covers": [str(c) for c in covers] if isinstance(covers, list) else None,
    }


def newest_store_save(url: str) -> dict[str, Any] | None:
    """The newest committed save in a store (``s3://...``), as a restart on any machine will find it.

    A run that saves to a bucket leaves nothing in its local checkpoint folder, so the save a
    restart resumed from, and its id, can only be read from the store: the ``COMMIT`` marker of
    the highest committed step, checked against the manifest it names.

    Args:
        url: The store URL the command was given (``{run_id}`` already filled in).

    Returns:
        ``{"name", "step", "save_id", "covers"}`` as :func:`newest_save` returns, ``name`` being the
        save's URL; ``None`` when the store holds no committed save, or cannot be read, or its
        newest marker or manifest does not check out (the restart's own error will say why).

    Example:
        >>> newest_store_save("s3://bucket/run-1")  # doctest: +SKIP
        {'name': 's3://bucket/run-1/step-00000010', 'step': 10, 'save_id': '5d0c...', 'covers': [...]}
    """
    try:
        storage = open_storage(url)
        steps = committed_steps(storage)
        if not steps:
            return None
        marker, raw = read_commit(storage, steps[-1])
        manifest = parse_json_text(raw, where=url)
    except (OSError, CheckpointError):
        return None
    covers = manifest.get("covers") if isinstance(manifest, dict) else None
    return {
        "name": f"{url.rstrip('/')}/{step_dir_name(steps[-1])}",
        "step": steps[-1],
        "save_id": marker["save_id"],
        "covers": [str(c) for c in covers] if isinstance(covers, list) else None,
    }


def damage_after_kill(ckpt_dir: Path, watcher: FolderWatcher, burst: SaveBurst) -> list[dict[str, Any]]:
    """What the killed process left that is not a good save: one dict per damaged or doubtful entry.

    Args:
        ckpt_dir: The checkpoint folder.
        watcher: Its watcher (the layout and the last snapshot).
        burst: The save that was at work when the kill came (plain folders).

    Returns:
        ``{"name", "step", "status", "reason"}`` for each; empty when every save is good.

    Example:
        >>> damage_after_kill(Path("w/trial-01/ckpt"), watcher, burst)  # doctest: +SKIP
        [{'name': 'checkpoint.pt', 'step': None, 'status': 'possibly incomplete', 'reason': '...'}]
    """
    if watcher.layout == MANAGER:
        try:
            results = scan_checkpoints(ckpt_dir)
        except CheckpointError:
            return []
        return [
            {"name": r.path.name, "step": r.step, "status": r.status, "reason": r.reason}
            for r in results
            if not r.ok
        ]
    exact = _recorded_damage(ckpt_dir)
    if exact is not None:
        return exact
    # A generic folder has no commit record: the best evidence is "it was being written at the kill".
    return [
        {"name": name, "step": None, "status": "possibly incomplete",
         "reason": f"was being written when the process was killed ({size} bytes)"}
        for name, size in burst.cut_short(watcher.files())
    ]  # fmt: skip


def _recorded_damage(ckpt_dir: Path) -> list[dict[str, Any]] | None:
    """The integrations' saves carry their own records (a folder manifest, a file footer): judged exactly.

    ``None`` when nothing in the folder verifies (a stock writer, or no save yet): then only the
    generic evidence of files cut short is left.
    """
    try:
        results = scan_checkpoints(ckpt_dir)
    except CheckpointError:
        return None
    if not any(r.ok for r in results):
        return None
    return [
        {"name": r.path.name, "step": r.step, "status": r.status, "reason": r.reason}
        for r in results
        if not r.ok
    ]
