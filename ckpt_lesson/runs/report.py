"""Recovery reports: what each restore chose, skipped, redid and cost.

"It resumed" is not a measurement. Every restore appends one JSON line to
``RUN_DIR/recovery.jsonl`` with:

* the chosen save (step, save id) and every newer save skipped, with why;
* **steps redone**: the last step the crashed process executed minus the
  restored step. The last executed step comes from ``progress.json``, a tiny
  heartbeat rewritten after every step with ``os.replace`` but *without*
  fsync: it survives a killed process (the page cache outlives it), not a
  power cut, which is fine for a statistic and is why it is never used to
  *choose* a save. Without a heartbeat the field is ``null``, not a guess;
* **recovery time**: from the process start to the end of its first step
  after the restore, i.e. everything a restart costs (interpreter and torch
  import, scanning, verifying, loading, the first step);
* the **age of the last good save** at restore time, and the **code version**
  (``git rev-parse HEAD`` of the package's checkout, or ``null``).

For a run in a bucket the local folder is scratch that dies with the machine,
so the log lives in the bucket too (``RecoveryRecorder(folder, store=URL)``),
where :func:`read_recovery_log` of the URL reads it. The per-step heartbeat
stays local: on a new machine it is gone, and the record says "steps redone:
unknown" rather than guessing.

``python -m ckpt_lesson report RUN_DIR_OR_URL [--json]`` prints the log's
totals (:func:`summarize_recoveries`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import subprocess
import time
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError
from ckpt_lesson.files.safe_read import MAX_RECORD_BYTES, parse_json_text, read_json_file, read_regular_file
from ckpt_lesson.files.side_files import append_beside, replace_beside
from ckpt_lesson.files.storage import is_store_url, open_storage

__all__ = [
    "PROGRESS_NAME",
    "RECOVERY_LOG",
    "RecoveryRecorder",
    "RecoverySummary",
    "append_recovery_record",
    "build_recovery_record",
    "code_version",
    "process_start_time",
    "read_progress",
    "read_recovery_log",
    "record_progress",
    "summarize_recoveries",
]

log = logging.getLogger(__name__)
_HEARTBEAT_WARNED = False

RECOVERY_LOG = "recovery.jsonl"
PROGRESS_NAME = "progress.json"
_IMPORTED_AT = time.time()


def record_progress(run_dir: str | os.PathLike[str], step: int) -> bool:
    """Note that ``step`` finished (cheap: a tiny write and a rename, no fsync).

    A heartbeat is a convenience for the recovery report, never a reason to
    stop training: a full disk or read-only folder is logged (once per process)
    and the temp file removed.

    Returns:
        ``True`` when the heartbeat was written.
    """
    global _HEARTBEAT_WARNED
    data = json.dumps({"step": int(step), "wall": time.time()}).encode("utf-8")
    try:
        # A random O_EXCL temp name, no symlink followed, no FIFO waited on (side_files.py).
        replace_beside(Path(run_dir) / PROGRESS_NAME, data)
    except (OSError, CheckpointError) as exc:
        if not _HEARTBEAT_WARNED:
            log.warning("could not write %s (%s); training goes on without a heartbeat", PROGRESS_NAME, exc)
            _HEARTBEAT_WARNED = True
        return False
    return True


def read_progress(run_dir: str | os.PathLike[str]) -> int | None:
    """The last step recorded by :func:`record_progress`, or ``None``."""
    try:
        data = read_json_file(Path(run_dir) / PROGRESS_NAME, limit=1 << 16, what="heartbeat")
        step = data["step"]
    except (OSError, ValueError, KeyError, TypeError):  # damaged or hostile: no heartbeat known
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def process_start_time() -> float:
    """Wall-clock time this process started (Linux ``/proc``), else when this module was imported.

    The age comes from ``/proc/uptime`` minus the process's start tick, both
    counted from boot at 10 ms resolution (``btime`` is rounded to whole
    seconds, so it is not used).
    """
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # stat(5) field 22: starttime in ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - max(0.0, uptime - started)
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


@lru_cache(maxsize=1)
def code_version() -> str | None:
    """``git rev-parse HEAD`` of the checkout this package runs from, or ``None``."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    head = out.stdout.strip()
    return head if out.returncode == 0 and len(head) == 40 else None


def build_recovery_record(
    last_restore: dict[str, Any],
    *,
    last_executed_step: int | None,
    started_at: float,
    first_step_at: float | None,
    now: float | None = None,
    version: str | None = None,
) -> dict[str, Any]:
    """One recovery-log line from a manager's ``last_restore`` and the timings.

    Args:
        last_restore: ``CheckpointManager.last_restore`` after a restore.
        last_executed_step: From :func:`read_progress` *before* training
            overwrote it; ``None`` when unknown.
        started_at: :func:`process_start_time`.
        first_step_at: Wall time the first step after the restore ended.
        now: Wall time of the restore (defaults to ``time.time()``).
        version: Code version (defaults to :func:`code_version`).
    """
    now = time.time() if now is None else now
    step = last_restore.get("step")
    manifest = last_restore.get("manifest") or {}
    skipped = [  # with "relisted" where the restore listed the saves again after this one (it may be newer)
        {"step": s.get("step"), "status": s.get("status"), "reason": s.get("reason")}
        | ({"relisted": list(s["relisted"])} if "relisted" in s else {})
        for s in last_restore.get("skipped", [])
    ]
    redone = None
    if last_executed_step is not None and step is not None:
        redone = max(0, last_executed_step - step)
    created = manifest.get("created_at")
    return {
        "schema": "ckpt.recovery.v1",
        "at": now,
        "chosen": {"step": step, "save_id": last_restore.get("save_id")},
        "skipped": skipped,
        "fallback": bool(skipped),
        "incomplete_saves": sum(1 for s in skipped if s["status"] == "incomplete"),
        "corrupt_saves": sum(1 for s in skipped if s["status"] == "corrupt"),
        "last_executed_step": last_executed_step,
        "steps_redone": redone,
        "recovery_seconds": None if first_step_at is None else first_step_at - started_at,
        "last_good_save_age_seconds": None if created is None else now - float(created),
        "code_version": code_version() if version is None else version,
    }


def append_recovery_record(run_dir: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Append ``record`` as one line of ``recovery.jsonl`` (flushed and fsynced)."""
    line = json.dumps(record, sort_keys=True, allow_nan=False) + "\n"
    # Not open(..., "a"): that follows a symlink out of the run directory and blocks on a FIFO.
    append_beside(Path(run_dir) / RECOVERY_LOG, line.encode("utf-8"))


def read_recovery_log(
    run_dir: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Every complete record of ``recovery.jsonl``; a torn last line (a crash mid-append) is ignored.

    Args:
        run_dir: A run directory, or a run's URL (``s3://bucket/runs/exp1``): then the log kept in the store.
        storage_options: fsspec options for a URL (``None``: credentials from the environment).

    Raises:
        CheckpointError: ``run_dir`` is not a directory, or nothing at all lies under the URL.
        LoadEnvironmentError: The bucket is missing or cannot be reached.
        CorruptCheckpointError: The log holds no record at all, only damaged lines.
    """
    if is_store_url(run_dir):
        storage = open_storage(str(run_dir), storage_options)
        try:
            raw = storage.read_bytes(RECOVERY_LOG, limit=MAX_RECORD_BYTES)
        except FileNotFoundError:
            if storage.list_keys():
                return []
            # "no restores recorded", exit 0, would read as "all fine" for a typo'd bucket or prefix;
            # list_keys names a missing bucket itself, an empty prefix is refused here, as scan does.
            raise CheckpointError(
                f"{run_dir}: no run found (no saves, no {RECOVERY_LOG}); pass the prefix a manager "
                "saved to, e.g. s3://BUCKET/runs/exp1 ('python -m ckpt_lesson scan URL' lists its saves)."
            ) from None
        return _parse_log(raw, storage.where(RECOVERY_LOG))
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: not a run directory; pass the folder that holds step-* saves.")
    path = run_dir / RECOVERY_LOG
    if not path.exists() and not path.is_symlink():
        return []
    # Regular, size-capped: see files/safe_read.py.
    return _parse_log(read_regular_file(path, what="recovery log"), str(path))


def _parse_log(raw: bytes, where: str) -> list[dict[str, Any]]:
    """The records of a log's bytes (``where`` names it in messages); see :func:`read_recovery_log`."""
    lines = raw.split(b"\n")
    torn_tail = not raw.endswith(b"\n")  # a crash mid-append leaves a last line without its newline
    if lines and not lines[-1].strip():
        lines.pop()
    records, bad = [], 0
    for i, line in enumerate(lines):
        try:
            rec = parse_json_text(line, where=f"{RECOVERY_LOG} line {i + 1}")
        except CheckpointError:
            if i < len(lines) - 1 or not torn_tail:  # only an unterminated last line may be torn
                bad += 1
            continue
        if _is_record(rec):
            records.append(rec)
        else:
            bad += 1
    if bad and not records:
        raise CorruptCheckpointError(
            f"{where}: {bad} line(s) and none is a recovery record (not JSON, or wrongly typed fields); "
            "the log is damaged or not ours. Move it aside; new restores start a fresh log."
        )
    if bad:
        log.warning("%s: ignored %d damaged line(s)", where, bad)
    return records


_NUMERIC_FIELDS = ("steps_redone", "recovery_seconds", "last_good_save_age_seconds", "corrupt_saves")


def _is_record(rec: Any) -> bool:
    """A recovery record: a JSON object whose numeric fields are numbers (finite) or null."""
    if not isinstance(rec, dict):
        return False
    values = [rec.get(key) for key in (*_NUMERIC_FIELDS, "incomplete_saves")]
    # type(), not isinstance(): True is an int to isinstance, and JSON never yields a subclass.
    return all(v is None or (type(v) in (int, float) and math.isfinite(v)) for v in values)


class RecoveryRecorder:
    """Glue for a training loop: heartbeat every step, one record after the first resumed step.

    Args:
        run_dir: The folder of the heartbeat and the log (for a run in a store: a local scratch folder).
        started_at: When the process started (default :func:`process_start_time`).
        store: A run's URL whose ``recovery.jsonl`` the log is fetched from now and put back to
            after each record (the single-process loop and rank 0 of a multi-rank manager on a store).
        storage_options: fsspec options for ``store`` (``None``: credentials from the environment).

    Example:
        >>> rec = RecoveryRecorder(run_dir)                 # doctest: +SKIP
        >>> state = mgr.restore_latest(model, opt, sched)   # doctest: +SKIP
        >>> rec.restored(mgr.last_restore)                  # doctest: +SKIP
        >>> # in after_step: rec.step_done(state.step)
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        started_at: float | None = None,
        store: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.storage = None if store is None else open_storage(store, storage_options)
        if self.storage is not None:
            with suppress(FileNotFoundError):  # a store that holds no log yet: the first record starts it
                log_bytes = self.storage.read_bytes(RECOVERY_LOG, limit=MAX_RECORD_BYTES)
                (self.run_dir / RECOVERY_LOG).write_bytes(log_bytes)
        self.started_at = process_start_time() if started_at is None else started_at
        # Read before this process overwrites it: the crashed process's last step.
        self.last_executed_step = read_progress(self.run_dir)
        self._pending: dict[str, Any] | None = None
        self._restored_at: float | None = None
        self.record: dict[str, Any] | None = None

    def restored(self, last_restore: dict[str, Any] | None) -> None:
        """Call right after a restore that found a save (not after a fresh start)."""
        if last_restore and last_restore.get("step") is not None:
            self._pending = last_restore
            self._restored_at = time.time()

    def step_done(self, step: int) -> dict[str, Any] | None:
        """Call after every step; returns the recovery record when it was just written."""
        record_progress(self.run_dir, step)
        if self._pending is None:
            return None
        self.record = build_recovery_record(
            self._pending,
            last_executed_step=self.last_executed_step,
            started_at=self.started_at,
            first_step_at=time.time(),
            now=self._restored_at,
        )
        try:
            append_recovery_record(self.run_dir, self.record)
        except (OSError, CheckpointError) as exc:
            # The log is a report about training, never a reason to stop it (a FIFO or a symlink
            # planted at its name, a full disk): say so once and keep going.
            log.warning("could not append to %s (%s); this restore is not in the report", RECOVERY_LOG, exc)
        self._pending = None
        if self.storage is not None:
            self.storage.put_bytes(RECOVERY_LOG, (self.run_dir / RECOVERY_LOG).read_bytes())
        return self.record


@dataclass(frozen=True)
class RecoverySummary:
    """Totals over a run's recovery log."""

    restores: int
    fallbacks: int
    incomplete_saves: int
    corrupt_saves: int
    steps_redone_total: int | None
    steps_redone_max: int | None
    recovery_seconds_median: float | None
    recovery_seconds_max: float | None
    save_age_seconds_max: float | None

    def format(self) -> str:
        def num(x: float | None, unit: str = "") -> str:
            return "unknown" if x is None else f"{x:.2f}{unit}" if isinstance(x, float) else f"{x}{unit}"

        med = num(self.recovery_seconds_median, " s")
        rows = [
            ("restores", str(self.restores)),
            ("fallbacks", f"{self.fallbacks} (a newer save was skipped)"),
            ("incomplete saves", str(self.incomplete_saves)),
            ("corrupt saves", str(self.corrupt_saves)),
            ("steps redone", f"{num(self.steps_redone_total)} total, {num(self.steps_redone_max)} max"),
            ("recovery time", f"median {med}, max {num(self.recovery_seconds_max, ' s')}"),
            ("last good save age", f"max {num(self.save_age_seconds_max, ' s')}"),
        ]
        return "\n".join(f"{k:<20}{v}" for k, v in rows)


def summarize_recoveries(records: list[dict[str, Any]]) -> RecoverySummary:
    """Totals, medians and maxima over recovery records (unknown values are left out)."""

    def known(key: str) -> list[Any]:
        return [r[key] for r in records if r.get(key) is not None]

    redone, secs, ages = known("steps_redone"), known("recovery_seconds"), known("last_good_save_age_seconds")
    return RecoverySummary(
        restores=len(records),
        fallbacks=sum(1 for r in records if r.get("fallback")),
        incomplete_saves=sum(int(r.get("incomplete_saves") or 0) for r in records),
        corrupt_saves=sum(int(r.get("corrupt_saves") or 0) for r in records),
        steps_redone_total=sum(redone) if redone else None,
        steps_redone_max=max(redone) if redone else None,
        recovery_seconds_median=float(statistics.median(secs)) if secs else None,
        recovery_seconds_max=float(max(secs)) if secs else None,
        save_age_seconds_max=float(max(ages)) if ages else None,
    )
