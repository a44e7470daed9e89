"""The totals of a run's recovery log: restores, fallbacks, steps redone, time to recover.

The records come from :func:`~ckpt_lesson.runs.report.read_recovery_log` (one per
restore); ``python -m ckpt_lesson report`` prints :meth:`RecoverySummary.format`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

__all__ = ["RecoverySummary", "summarize_recoveries"]


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
