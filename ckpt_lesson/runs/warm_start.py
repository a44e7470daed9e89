"""Warm start: begin a NEW experiment from a save's weights, never a resume in disguise.

There are three things one can want from a checkpoint, and they must not blur:

=====================  ===========================================  =============================
intent                 what is loaded                               what it is
=====================  ===========================================  =============================
use the weights        model weights (inference, evaluation)        not training at all
new experiment         model weights into a new run directory,      a new run with its own id,
from weights           fresh optimizer, schedule, RNG, counters     recording where it came from
resume                 all five buckets, contract checked           the *same* run, continued
=====================  ===========================================  =============================

:meth:`CheckpointManager.restore_latest` is the resume and refuses a save that
misses any bucket its manifest ``covers`` (a resume with a fresh optimizer is
a different run that looks like the old one). :func:`warm_start_from` is the
honest alternative for "the optimizer state is gone, or I changed the data or
the schedule": it reads *only* the model weights, checks their hashes (from
the manifest when there is one, else the file's own footer), loads them, and
writes ``warm_start.json`` into the new run directory with a new run id and
the source's save id. The new directory holds no ``step-*`` save, so nothing
can mistake it for a continuation.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.errors import CheckpointError, IncompleteCheckpointError, StateMismatchError
from ckpt_lesson.files.atomic import atomic_write_json
from ckpt_lesson.files.checkpoint import check_model_state, load_verified_file, require_footer
from ckpt_lesson.files.hashing import part_digest
from ckpt_lesson.runs.contract import model_fingerprint
from ckpt_lesson.runs.layout import MANIFEST_NAME, read_manifest
from ckpt_lesson.short_repr import short_repr

__all__ = ["WARM_START_NAME", "WarmStartRecord", "read_warm_start", "warm_start_from"]

#: File written into the new run directory.
WARM_START_NAME = "warm_start.json"
_SHARD_PREFIX = "model.shard-"
#: What a source gives: ``(weights, save_id, step, {file: (algo, digest)}, verified_by)``.
_Found = tuple[dict[str, Any], str | None, int | None, dict[str, tuple[str, str]], str]


@dataclass(frozen=True)
class WarmStartRecord:
    """Where a new run's initial weights came from.

    Attributes:
        kind: Always ``"warm_start"`` (a resume never writes this record).
        run_id: A new id for the new run.
        source: The file or save folder the weights came from (as given).
        source_save_id: The source manifest's ``save_id``, or ``None`` for a bare file.
        source_step: The step the source was saved at, when known.
        source_sha256: Digest of each weight-bearing file, by file name, in
            ``source_algo`` (the name predates the choice of algorithm).
        verified_by: ``"manifest"`` (hashes recorded at save time),
            ``"footer"`` (the file's own integrity footer) or ``"none"``.
        model_fingerprint: Names/shapes/dtypes fingerprint of the loaded weights.
        created_at: Wall-clock time of the warm start.
        source_algo: Algorithm of ``source_sha256``'s digests (records from
            earlier versions lack it: they are sha256).
    """

    __repr__ = short_repr  # one short line: see ckpt_lesson/short_repr.py

    kind: str
    run_id: str
    source: str
    source_save_id: str | None
    source_step: int | None
    source_sha256: dict[str, str]
    verified_by: str
    model_fingerprint: str
    created_at: float
    source_algo: str = "sha256"


def warm_start_from(
    source: str | os.PathLike[str],
    model: torch.nn.Module,
    *,
    run_dir: str | os.PathLike[str] | None = None,
    map_location: str | torch.device = "cpu",
) -> WarmStartRecord:
    """Load only the model weights of ``source`` into ``model``, as a new experiment.

    Args:
        source: A published save folder (``step-XXXXXXXX`` with
            ``manifest.json``, single-file or sharded), or a ``.pt`` file
            (a full checkpoint, or a bare ``state_dict``).
        model: Built with the same architecture; only its weights change.
        run_dir: The NEW run's directory; ``warm_start.json`` is written there.
            It may exist but must not hold saves or an earlier warm start.
        map_location: Passed to ``torch.load``.

    Returns:
        A :class:`WarmStartRecord` (also written to ``run_dir``).

    Raises:
        CheckpointError: ``run_dir`` already holds a run; the source is
            missing, corrupt (hash mismatch) or unsafe; the weights do not fit
            the model (``StateMismatchError``, model unchanged).

    Example:
        >>> rec = warm_start_from("old_run/step-00000280", model, run_dir="new_run")  # doctest: +SKIP
        >>> rec.kind, rec.source_step
        ('warm_start', 280)
    """
    src = Path(source)
    new_dir = Path(run_dir) if run_dir is not None else None
    if new_dir is not None:
        _refuse_existing_run(new_dir)
    if src.is_dir():
        weights, save_id, step, hashes, verified_by = _weights_from_save_dir(src, map_location)
    else:
        weights, save_id, step, hashes, verified_by = _weights_from_file(src, map_location)
    check_model_state(weights, model, source=str(src))
    model.load_state_dict(weights, strict=True)
    record = WarmStartRecord(
        kind="warm_start",
        run_id=uuid.uuid4().hex,
        source=str(src),
        source_save_id=save_id,
        source_step=step,
        source_sha256={name: digest for name, (_, digest) in hashes.items()},
        verified_by=verified_by,
        model_fingerprint=model_fingerprint(weights),
        created_at=time.time(),
        # One save writes every part with one algorithm; "+" joins them if a hand-made save mixed some.
        source_algo="+".join(sorted({algo for algo, _ in hashes.values()})),
    )
    if new_dir is not None:
        new_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(asdict(record), new_dir / WARM_START_NAME)
    return record


def read_warm_start(run_dir: str | os.PathLike[str]) -> WarmStartRecord | None:
    """The warm-start record of a run directory, or ``None`` when it began from scratch."""
    import json

    path = Path(run_dir) / WARM_START_NAME
    if not path.is_file():
        return None
    try:
        return WarmStartRecord(**json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: not a warm-start record ({exc}).") from exc


def _refuse_existing_run(run_dir: Path) -> None:
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: exists and is not a directory; choose a new run directory.")
    taken = sorted(
        p.name for p in run_dir.iterdir() if p.name.startswith("step-") or p.name == WARM_START_NAME
    )
    if taken:
        raise CheckpointError(
            f"{run_dir}: already holds a run ({', '.join(taken[:3])}); a warm start begins a NEW run. "
            "Choose an empty directory, or resume that run instead."
        )


def _model_block(obj: Any, where: str) -> dict[str, Any]:
    """The model state dict inside a loaded payload, or the payload itself if it is one."""
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        return obj["model"]
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    raise StateMismatchError(
        f"{where}: holds no model weights (no 'model' state_dict); nothing to warm start from."
    )


def _weights_from_file(path: Path, map_location: Any) -> _Found:
    obj, digest = load_verified_file(path, map_location=map_location)
    require_footer(obj, digest, path)  # the same rule as read_checkpoint: one rule for both
    step = None
    if isinstance(obj, dict) and isinstance(obj.get("state"), dict):
        step = obj["state"].get("step")
    verified_by = "footer" if digest.has_footer else "none"
    return _model_block(obj, str(path)), None, step, {path.name: (digest.algo, digest.digest)}, verified_by


def _weights_from_save_dir(step_dir: Path, map_location: Any) -> _Found:
    if not (step_dir / MANIFEST_NAME).is_file():
        raise IncompleteCheckpointError(
            f"{step_dir}: no {MANIFEST_NAME}; the save never finished. Warm start from a published save."
        )
    manifest = read_manifest(step_dir)
    parts = {p["file"]: p for p in manifest["parts"]}
    if manifest["layout"] == "single":
        names = ["checkpoint.pt"]
    else:
        names = sorted(n for n in parts if n.startswith(_SHARD_PREFIX))
        if not names:
            raise IncompleteCheckpointError(f"{step_dir}: the manifest lists no model shards.")
    weights: dict[str, Any] = {}
    hashes: dict[str, tuple[str, str]] = {}
    for name in names:
        part = parts[name]
        # Only the weight-bearing parts are read, but each one is checked against
        # the hash recorded at save time before torch.load sees a byte.
        algo, want = part_digest(part)
        obj, digest = load_verified_file(
            step_dir / name,
            map_location=map_location,
            expected_digest=want,
            algo=algo,
            expected_size=part["bytes"],
        )
        block = _model_block(obj, f"{step_dir.name}/{name}")
        dup = sorted(set(block) & set(weights))
        if dup:
            raise StateMismatchError(
                f"{step_dir}: key {dup[0]!r} appears in two shards; the save is malformed."
            )
        weights.update(block)
        hashes[name] = (digest.algo, digest.digest)
    return weights, manifest.get("save_id"), manifest.get("step"), hashes, "manifest"
