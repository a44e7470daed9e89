"""The ``resume-test`` report: one JSON document, a short text summary, and a plot when runs differ.

The JSON holds everything the text says and the numbers behind it (every
kill, every restart, every damaged save), so a notebook or CI job can assert
on it. The text is meant to be read top to bottom in ten seconds: verdict,
what ran, where it first went wrong, and the one-line diagnosis last.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ckpt_lesson.files.side_files import replace_beside
from ckpt_lesson.resume_test.compare import stitch, trajectory
from ckpt_lesson.resume_test.diagnose import TrialVerdict
from ckpt_lesson.resume_test.provenance import format_evidence
from ckpt_lesson.resume_test.repeat import format_repeat
from ckpt_lesson.resume_test.runner import Attempt, TrialRun
from ckpt_lesson.resume_test.watch import FILES, MANAGER

__all__ = ["build_report", "format_text", "write_plot"]

LAYOUT_WORDS = {
    MANAGER: "a CheckpointManager run directory",
    FILES: "a plain folder, watched for new or growing files",
}


def build_report(
    *,
    command: list[str],
    workdir: Path,
    settings: dict[str, Any],
    baseline: Attempt,
    layout: str,
    trials: list[TrialRun],
    verdicts: list[TrialVerdict],
    notes: list[str],
) -> dict[str, Any]:
    """Everything about one ``resume-test`` run as plain JSON values.

    Example:
        >>> report = build_report(command=["python", "train.py"], ...)  # doctest: +SKIP
        >>> report["verdict"], report["diagnosis"]  # doctest: +SKIP
        ('FAIL', 'diverges at the first step after resume, on the same samples: ...')
    """
    steps = [r.step for r in baseline.records]
    trial_rows, redone, recovery, damaged = [], [], [], []
    for trial, verdict in zip(trials, verdicts, strict=True):
        kills = [a.kill.to_dict() for a in trial.attempts if a.kill is not None]
        seen = set()  # a save left damaged by one kill is still there at the next: list it once
        for kill in kills:
            fresh = [d for d in kill["damaged"] if d["name"] not in seen]
            seen |= {d["name"] for d in fresh}
            damaged += [{"trial": trial.plan.index, "kill": kill["point"], **d} for d in fresh]
        redone += [r.steps_redone for r in verdict.restarts]
        recovery += [r.recovery_seconds for r in verdict.restarts if r.recovery_seconds is not None]
        row = verdict.to_dict()
        row.update(requested_kind=trial.plan.requested, kills=kills, folder=str(trial.folder))
        trial_rows.append(row)
    failed = next((v for v in verdicts if not v.ok), None)
    first = None
    if failed is not None and failed.first_difference is not None:
        first = {**failed.first_difference.to_dict(), "trial": failed.index, "kill_point": failed.kill_point}
    return {
        "verdict": "PASS" if failed is None else "FAIL",
        "command": list(command),
        "workdir": str(workdir),
        "settings": settings,
        "baseline": {
            "steps": len(set(steps)),
            "first_step": min(steps),
            "last_step": max(steps),
            "seconds": round(baseline.ended - baseline.started, 3),
            "save_steps": baseline.save_steps,
            "layout": layout,
        },
        "trials": trial_rows,
        "failed_trial": failed.index if failed else None,
        "first_difference": first,
        "diagnosis": failed.diagnosis if failed else None,
        "restarts": len(redone),
        "steps_redone": redone,
        "recovery_seconds": [round(s, 3) for s in recovery],
        "damaged_saves": damaged,
        "plot": None,
        "notes": notes,
    }


def _value(v: Any) -> str:
    if isinstance(v, list) and len(v) > 8:
        return "[" + ", ".join(map(str, v[:8])) + ", ...]"
    return repr(v)


def _kill_words(kill: dict[str, Any]) -> str:
    if kill["signal"] != "TERM":
        return kill["point"]
    then = ", then KILL after the grace period" if kill["forced"] else ""
    return f"{kill['point']} (TERM: exit {kill['exit_code']}{then})"


def format_text(report: dict[str, Any]) -> str:
    """The human summary printed at the end of a run (no traceback, no raw JSON)."""
    s, b = report["settings"], report["baseline"]
    lines = [
        f"resume-test: {report['verdict']}  ({len(report['trials'])} trial(s), {report['restarts']} "
        f"restart(s), SIG{s['signal']})",
        f"baseline     {b['steps']} steps in {b['seconds']:.2f} s; saves seen after steps "
        f"{', '.join(map(str, b['save_steps'])) or 'none'} "
        f"({LAYOUT_WORDS.get(b['layout'], 'nothing was written to the checkpoint folder')})",
    ]
    if report.get("evidence"):
        lines += format_evidence(report["evidence"])
    for t in report["trials"]:
        kills = "; ".join(_kill_words(k) for k in t["kills"]) or "no kill happened (its point never came)"
        noisy = not (report.get("repeatability") or {}).get("repeats", True)
        mark = "ok  " if t["ok"] else "diff" if noisy else "FAIL"
        lines.append(f"trial {t['index']:<6} {mark} killed {kills}; {t['status']}")
        if not t["ok"] and t["diagnosis"] and t["index"] != report["failed_trial"]:
            # The first failing trial's diagnosis closes the report; every other one is shown here.
            after = f" (after the kill {t['kill_point']})" if t["kill_point"] else ""
            step = t["first_difference"]["step"] if t["first_difference"] else None
            at = f" step {step}" if step is not None else ""
            lines.append(f"             diagnosis{at}{after}: {t['diagnosis']}")
    first = report["first_difference"]
    if first is not None and first["what"] == "missing":
        lines.append(
            f"first difference  step {first['step']} was never reported by the trial (baseline loss "
            f"{first['baseline']!r}; trial {first['trial']})"
        )
    elif first is not None:
        lines.append(
            f"first difference  step {first['step']}, {first['what']}: baseline {_value(first['baseline'])} "
            f"vs resumed {_value(first['resumed'])} (trial {first['trial']}"
            + (f", after the kill {first['kill_point']})" if first["kill_point"] else ")")
        )
    redone = report["steps_redone"]
    recovery = report["recovery_seconds"]
    if redone:
        rec = f"{statistics.median(recovery):.2f} s median" if recovery else "n/a"
        lines.append(
            f"restarts     {len(redone)}; steps redone per restart: {', '.join(map(str, redone))}; "
            f"recovery (restart to first new step): {rec}"
        )
    damaged = report["damaged_saves"]
    if damaged:
        shown = "; ".join(f"trial {d['trial']}: {d['name']} {d['status']}" for d in damaged[:4])
        more = f" (+{len(damaged) - 4} more)" if len(damaged) > 4 else ""
        lines.append(f"damaged or incomplete saves after kills: {len(damaged)}: {shown}{more}")
    else:
        crashed = [t["index"] for t in report["trials"] if t["status"] == "crashed" and t["kills"]]
        lines.append(
            "damaged or incomplete saves after kills: none found"
            + (
                f" by the tool, but the restart of trial(s) {crashed} crashed: a save it cannot judge "
                "(not a CheckpointManager save, not a file written at the kill) may be incomplete"
                if crashed
                else ""
            )
        )
    for note in report["notes"]:
        lines.append(f"note         {note}")
    repeat = format_repeat(report.get("repeatability"))
    if repeat and not report["repeatability"]["repeats"]:
        lines.append(f"inconclusive {report['repeatability']['explanation']}")
    else:
        lines += [f"inconclusive {reason}" for reason in report.get("inconclusive", [])]
    if repeat and report["repeatability"]["repeats"]:
        lines.append(repeat)
    if report["diagnosis"]:
        unsure = repeat and not report["repeatability"]["repeats"]
        lines.append(f"diagnosis    {'(had the runs repeated) ' if unsure else ''}{report['diagnosis']}")
    where = f"report       {report['workdir']}/report.json"
    if report["plot"]:
        where += f"; plot {report['plot']}"
    lines.append(where)
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: Path) -> None:
    # A fresh random temp name and a rename, never a write through whatever sits at `path`.
    replace_beside(path, (json.dumps(report, indent=2, allow_nan=True) + "\n").encode("utf-8"))


def write_plot(
    path: Path, baseline: Attempt, trials: list[TrialRun], verdicts: list[TrialVerdict]
) -> str | None:
    """Plot baseline vs stitched loss for every trial that differs; returns the path, or ``None``.

    Returns ``None`` (and writes nothing) when no trial differs or matplotlib is missing.
    """
    differing = [(t, v) for t, v in zip(trials, verdicts, strict=True) if v.first_difference is not None]
    if not differing:
        return None
    try:
        # The object API, not pyplot: no global figure state (safe from threads) and no change
        # to the caller's backend (a notebook keeps its inline plots).
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    base = trajectory(baseline.records)
    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = sorted(base)
    ax.plot(xs, [base[s].loss for s in xs], color="black", lw=2, label="baseline (uninterrupted)")
    for trial, verdict in differing[:4]:
        stitched = stitch(trial.attempts)
        steps = sorted(stitched)
        line = ax.plot(steps, [stitched[s][0].loss for s in steps], "--", lw=1.5,
                       label=f"trial {trial.plan.index} ({trial.plan.kind}), stitched")[0]  # fmt: skip
        for restart in verdict.restarts:
            if restart.resumed_from is not None:
                ax.axvline(restart.resumed_from, color=line.get_color(), ls=":", lw=1)
        first = verdict.first_difference
        if first is not None and isinstance(first.resumed, float):
            ax.plot([first.step], [first.resumed], "x", color=line.get_color(), ms=10, mew=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("resume-test: baseline vs killed-and-resumed loss", fontsize=11)
    ax.text(0.0, -0.16, "dotted: resume points; x: first difference", transform=ax.transAxes, fontsize=8)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return str(path)
