"""Stopping ``resume-test`` from outside: a cancelled CI job, a closed terminal, Ctrl-C.

A tool that starts training processes must not leave them behind when it is
stopped itself. SIGTERM (what CI runners and ``kill`` send), SIGHUP (a closed
terminal) and SIGINT (Ctrl-C) all become one :class:`~procs.Stopped`
exception, raised wherever the tool is waiting. On its way out, the run in
progress ends every process of the command (its group, and by token those
that left it: see :mod:`procs`); then the tool prints what it learned
so far and exits with 128 + the signal's number, as a shell would report it.
A second signal while that happens is ignored: the cleanup finishes.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from ckpt_lesson.resume_test.compare import trajectory
from ckpt_lesson.resume_test.diagnose import judge_trial
from ckpt_lesson.resume_test.procs import Stopped, stop_now_or_later
from ckpt_lesson.resume_test.runner import Attempt

__all__ = ["StopSignals", "left_running_notes", "report_stop", "stopped_report"]

SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class StopSignals:
    """While active, SIGTERM/SIGHUP/SIGINT raise :class:`Stopped` (main thread only; else a no-op).

    Example:
        >>> with StopSignals():
        ...     pass
    """

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        for sig in SIGNALS:  # the cleanup that follows must not be cut short by a second signal
            signal.signal(sig, signal.SIG_IGN)
        stop_now_or_later(signum)

    def __enter__(self) -> StopSignals:
        # signal.signal works only in the main thread: called from a worker thread (tests run
        # several resume-tests side by side), the tool keeps the process's handlers.
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def left_running_notes(left: list[tuple[str, list[int]]]) -> list[str]:
    """One note for the processes the command left running (``[(where, pids), ...]``), if any.

    Example:
        >>> left_running_notes([("baseline", [4242])])
        ['your command left 1 process(es) running after it ended (baseline: pid 4242); all were killed']
    """
    runs = [(where, pids) for where, pids in left if pids]
    if not runs:
        return []
    total = sum(len(p) for _, p in runs)
    where = "; ".join(f"{w}: pid {', '.join(map(str, p))}" for w, p in runs[:4])
    more = f"; +{len(runs) - 4} more run(s)" if len(runs) > 4 else ""
    return [f"your command left {total} process(es) running after it ended ({where}{more}); all were killed"]


def stopped_report(
    signum: int, workdir: Path, during: str, done: list[dict[str, Any]], left: list[tuple[str, list[int]]]
) -> tuple[str, dict[str, Any]]:
    """The partial report after a stop: text to print, and the JSON written to WORKDIR/report.json.

    Args:
        signum: The signal that stopped the tool.
        workdir: The run's folder.
        during: What was running (``"the baseline run"``, ``"trial 2 of 3"``).
        done: The finished trials' verdicts (``TrialVerdict.to_dict()``).
        left: Processes found still running, per run.

    Example:
        >>> text, _ = stopped_report(15, Path("w"), "the baseline run", [], [])
        >>> text.splitlines()[0]
        'resume-test: STOPPED by SIGTERM during the baseline run (exit 143); no verdict'
    """
    name = signal.Signals(signum).name
    lines = [f"resume-test: STOPPED by {name} during {during} (exit {128 + signum}); no verdict"]
    lines.append("stopped      every process of the command was ended before exiting")
    for t in done:
        mark = "ok  " if t["ok"] else "FAIL"
        lines.append(f"trial {t['index']:<6} {mark} (finished before the stop)")
        if t["diagnosis"]:
            lines.append(f"             diagnosis: {t['diagnosis']}")
    notes = left_running_notes(left)
    lines += [f"note         {n}" for n in notes]
    lines.append(f"report       {workdir}/report.json (partial)")
    report = {"verdict": "STOPPED", "signal": name, "during": during, "trials": done, "notes": notes,
              "workdir": str(workdir)}  # fmt: skip
    try:
        (workdir / "report.json").write_text(
            json.dumps(report, indent=2, allow_nan=True) + "\n", encoding="utf-8"
        )
    except OSError:  # the text report still goes out
        pass
    return "\n".join(lines), report


def report_stop(stop: Stopped, args: argparse.Namespace, workdir: Path, progress: dict[str, Any]) -> int:
    """Print what is known after a SIGTERM/SIGHUP/SIGINT (the command's processes are already ended).

    Args:
        stop: The exception that unwound the run.
        args: The parsed options.
        workdir: The run's folder (the partial report.json goes there).
        progress: ``{"during": str, "baseline": Attempt | None, "trials": [TrialRun, ...]}``.

    Returns:
        The exit status: 128 + the signal's number.

    Example:
        >>> report_stop(Stopped(15), args, Path("w"), progress)  # doctest: +SKIP
        143
    """
    baseline, trials = progress["baseline"], progress["trials"]
    done = []
    if baseline is not None and baseline.records and baseline.exit_code == 0:
        base = trajectory(baseline.records)
        done = [
            judge_trial(t, base, atol=args.atol, rtol=args.rtol, layout=baseline.layout, exact=[],
                        timeout=args.timeout).to_dict()
            for t in trials
        ]  # fmt: skip
    left = [("baseline", baseline.left_running)] if baseline is not None else []
    left += [(f"trial {t.plan.index} run {a.index}", a.left_running) for t in trials for a in t.attempts]
    if isinstance(stop.attempt, Attempt):
        left.append((f"the run stopped ({progress['during']})", stop.attempt.left_running))
    text, report = stopped_report(stop.signum, workdir, progress["during"], done, left)
    if args.json:
        import json

        print(json.dumps(report, indent=2, allow_nan=True))
    else:
        print(text)
    return 128 + stop.signum
