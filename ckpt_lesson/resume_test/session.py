"""One resume-test session: the baseline run, the trials, the report and its verdict.

The command module (:mod:`ckpt_lesson.cli.resume_test`) checks the options;
this module does the work with them. It is kept apart so the tool reads as a
package of its own, with the shell front end as a thin layer on top.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.resume_test.compare import trajectory
from ckpt_lesson.resume_test.diagnose import exact_resumes, judge_trial
from ckpt_lesson.resume_test.image import take_image
from ckpt_lesson.resume_test.machine import (
    format_failure_domain,
    judge_lost_machine,
    machine_for,
    new_session_id,
)
from ckpt_lesson.resume_test.outside import written_paths
from ckpt_lesson.resume_test.plan import plan_trials
from ckpt_lesson.resume_test.procs import ATTEMPT_ENV, Stopped, become_subreaper
from ckpt_lesson.resume_test.provenance import evidence_record, resumed_saves
from ckpt_lesson.resume_test.repeat import check_repeat
from ckpt_lesson.resume_test.report import build_report, format_text, write_json, write_plot
from ckpt_lesson.resume_test.runner import Attempt, RunSpec, run_attempt, run_trial
from ckpt_lesson.resume_test.steps import StepPattern
from ckpt_lesson.resume_test.stop import StopSignals, left_running_notes, report_stop
from ckpt_lesson.resume_test.verdict import check_baseline, decide
from ckpt_lesson.resume_test.watch import NONE
from ckpt_lesson.runs.steplog import CKPT_DIR_ENV, STEP_LOG_ENV

__all__ = ["prepare_workdir", "run_session"]


def prepare_workdir(path: str | None) -> Path:
    """A new or empty folder for this run, checked writable before anything runs.

    Raises:
        CheckpointError: It cannot be created, is a file, is not writable, or
            already holds a ``resume-test`` run (checkpoint folders must start empty).

    Example:
        >>> prepare_workdir(None).name.startswith("resume-test-")  # doctest: +SKIP
        True
    """
    if path is None:
        try:
            return Path(tempfile.mkdtemp(prefix="resume-test-"))
        except OSError as exc:
            raise CheckpointError(
                f"cannot create a temporary folder ({exc.strerror}); pass --workdir."
            ) from exc
    workdir = Path(path)
    if workdir.exists() and not workdir.is_dir():
        raise CheckpointError(f"--workdir {path}: is a file; pass a folder.")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=workdir, prefix=".probe-"):
            pass
    except OSError as exc:
        raise CheckpointError(
            f"--workdir {path}: not writable ({exc.strerror or exc}); pass a folder you can write."
        ) from exc
    if (workdir / "baseline").exists() or any(workdir.glob("trial-*")):
        raise CheckpointError(
            f"--workdir {path}: already holds a resume-test run; pass a new or empty folder "
            "(every run needs a fresh checkpoint folder)."
        )
    return workdir


def run_session(args: argparse.Namespace, command: list[str], kinds: tuple[str, ...]) -> int:
    """Run the baseline and the trials for checked options, write the report, print the verdict.

    Args:
        args: The parsed options of ``resume-test`` (see :func:`ckpt_lesson.cli.resume_test.configure`).
        command: The user's command, without the leading ``--``.
        kinds: The checked ``--kill-at`` kinds.

    Returns:
        The exit status: 0 PASS, 1 FAIL, 3 INCONCLUSIVE, 128 + the signal when stopped.

    Raises:
        CheckpointError: An unusable --workdir, or a baseline run that fails, times out or
            reports no steps.

    Example:
        >>> run_session(args, ["python", "train.py"], ("after-save",))  # doctest: +SKIP
        0
    """
    pattern = StepPattern(args.step_pattern) if args.step_pattern else None
    workdir = prepare_workdir(args.workdir)
    env = {k: v for k, v in os.environ.items() if k not in (STEP_LOG_ENV, CKPT_DIR_ENV, ATTEMPT_ENV)}
    lose = getattr(args, "lose_machine", False)
    # A new machine boots with the code and inputs as they were before the baseline (see image.py).
    image = take_image(Path.cwd(), workdir / "machine-image", workdir=workdir) if lose else None
    spec = RunSpec(tuple(command), Path.cwd(), env, pattern, args.signal, args.grace, args.timeout,
                   tuple(args.ckpt_glob), lose_machine=lose, session_id=new_session_id(), image=image,
                   workdir=workdir)  # fmt: skip
    # Orphans of the command (a helper whose parent exited) are handed to this process, not to init:
    # they stay findable and are reaped here (see ckpt_lesson.resume_test.procs).
    become_subreaper()
    progress: dict[str, Any] = {"during": "the baseline run", "baseline": None, "trials": []}
    with StopSignals():
        try:
            return _run(args, spec, command, kinds, workdir, progress)
        except Stopped as stop:
            return report_stop(stop, args, workdir, progress)


def _run(
    args: argparse.Namespace, spec: RunSpec, command: list[str], kinds: tuple[str, ...], workdir: Path,
    progress: dict[str, Any],
) -> int:  # fmt: skip
    started = time.time()  # files written since then outside the workdir: see outside.py
    bar = tqdm(total=args.trials, unit="trial", file=sys.stderr, leave=False,
               disable=not sys.stderr.isatty(), desc="baseline")  # fmt: skip
    # The evidence record's code version and environment, as they are before anything runs.
    record = evidence_record(command=command, cwd=spec.cwd, env=spec.env, settings=_settings(args, kinds),
                             lose_machine=spec.lose_machine)  # fmt: skip
    try:
        baseline = run_attempt(
            spec, workdir / "baseline" / "attempt-1", workdir / "baseline" / "ckpt", index=1
        )
        progress["baseline"] = baseline
        check_baseline(baseline, timeout=args.timeout, step_pattern=args.step_pattern)
        base = trajectory(baseline.records)
        layout = baseline.layout
        steps = [r.step for r in baseline.records]
        seconds = _typical_step_seconds(baseline)
        plans = plan_trials(steps=steps, save_steps=baseline.save_steps, trials=args.trials, kinds=kinds,
                            kills=args.kills, seed=args.seed, step_seconds=seconds)  # fmt: skip
        trials = progress["trials"]
        for plan in plans:
            progress["during"] = f"trial {plan.index} of {len(plans)}"
            bar.set_description(f"trial {plan.index}/{len(plans)} ({plan.kind})")
            trials.append(run_trial(spec, workdir / f"trial-{plan.index:02d}", plan, layout=layout))
            bar.update(1)
    finally:
        bar.close()
    exact = exact_resumes(trials, base, atol=args.atol, rtol=args.rtol)
    verdicts = [
        judge_trial(t, base, atol=args.atol, rtol=args.rtol, layout=layout, exact=exact, timeout=args.timeout)
        for t in trials
    ]
    repeat = _repeat_check(args, spec, workdir, baseline, verdicts, progress)
    report = build_report(
        command=command, workdir=workdir, settings=_settings(args, kinds), baseline=baseline,
        layout=layout, trials=trials, verdicts=verdicts,
        notes=_notes(plans, baseline, trials, layout, args.kills),
    )  # fmt: skip
    domain = _lost_machine(spec, trials, baseline, started) if spec.lose_machine else None
    store_resumed = domain is not None and domain["verdict"] == "PASS" and domain["store"] is not None
    outcome = decide(baseline, trials, verdicts, layout, store_resumed=store_resumed)
    report["verdict"], report["inconclusive"] = outcome.verdict, outcome.reasons
    exit_code = outcome.exit_code
    report["repeatability"] = repeat
    record["resumed_from"] = resumed_saves(trials, verdicts)
    report["evidence"] = record
    if repeat["checked"] and not repeat["repeats"] and report["verdict"] == "FAIL":
        # Two uninterrupted runs differ: the trials' differences say nothing about the save.
        report["verdict"], report["inconclusive"], exit_code = "INCONCLUSIVE", [repeat["explanation"]], 3
    if domain is not None:  # the failure domain's verdict joins the trajectory's
        report["failure_domain"] = domain
        if domain["verdict"] == "FAIL":
            report["verdict"], exit_code = "FAIL", 1
        elif domain["verdict"] == "INCONCLUSIVE" and report["verdict"] == "PASS":
            report["verdict"], exit_code = "INCONCLUSIVE", 3
            report["inconclusive"].append("lose-machine: " + domain["explanation"])
    report["plot"] = write_plot(workdir / "report.png", baseline, trials, verdicts)
    write_json(report, workdir / "report.json")
    if args.json:
        import json

        print(json.dumps(report, indent=2, allow_nan=True))
    else:
        print(format_text(report))
        if "failure_domain" in report:
            print(format_failure_domain(report["failure_domain"]))
    return exit_code


def _repeat_check(
    args: argparse.Namespace, spec: RunSpec, workdir: Path, baseline: Attempt, verdicts: list[Any],
    progress: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """A second uninterrupted run when trials differ (and only crashed-free differences): see repeat.py."""
    failed = [v for v in verdicts if not v.ok]
    if not failed:
        return {"checked": False, "why": "no trial differed"}
    if any(v.status != "finished" or v.first_difference is None for v in failed):
        return {"checked": False, "why": "a trial crashed or hung: that is no matter of repeatability"}
    if getattr(args, "no_repeat_check", False):
        return {"checked": False, "why": "--no-repeat-check"}
    progress["during"] = "the control run (a second uninterrupted run)"
    control = run_attempt(spec, workdir / "control" / "attempt-1", workdir / "control" / "ckpt", index=1)
    return check_repeat(baseline, control, atol=args.atol, rtol=args.rtol)


def _lost_machine(spec: RunSpec, trials: list[Any], baseline: Attempt, started: float) -> dict[str, Any]:
    """The failure-domain section, with every file written outside the simulated machines."""
    inside = spec.workdir or spec.cwd
    outside: set[str] = set()
    for folder in [baseline.folder.parent, *(t.folder for t in trials)]:
        ran = machine_for(spec, folder, folder / "ckpt", 1).command  # its {run_id} filled in
        outside |= set(written_paths(ran, since=started, inside=inside))
    outside |= {path for t in trials for a in t.attempts for path in a.outside_writes}
    return judge_lost_machine(trials, baseline.records[0].step, sorted(outside))


def _typical_step_seconds(baseline: Attempt) -> float:
    """The median time between two step reports (startup excluded: random kills land between steps)."""
    times = [r.t for r in baseline.records]
    gaps = sorted(b - a for a, b in zip(times[:-1], times[1:], strict=True) if b >= a)
    return gaps[len(gaps) // 2] if gaps else 0.01


def _settings(args: argparse.Namespace, kinds: tuple[str, ...]) -> dict[str, Any]:
    return {
        "trials": args.trials, "kills": args.kills, "kill_at": list(kinds), "signal": args.signal,
        "grace": args.grace, "seed": args.seed, "timeout": args.timeout, "atol": args.atol,
        "rtol": args.rtol, "step_pattern": args.step_pattern, "ckpt_glob": list(args.ckpt_glob),
        "repeat_check": not getattr(args, "no_repeat_check", False),
    }  # fmt: skip


def _notes(plans: list[Any], baseline: Attempt, trials: list[Any], layout: str, kills: int) -> list[str]:
    notes = []
    # Random kills stood in for aimed ones only where the baseline had no save to aim at; with fewer
    # saves than aimed kills, the extra kills were dropped instead (the others did land after saves).
    last = max(r.step for r in baseline.records)
    no_save = not [s for s in baseline.save_steps if s < last]
    fallback = [p.index for p in plans if no_save and p.requested.replace("random", "").strip("+")]
    if fallback and layout != NONE:
        notes.append(f"trial(s) {fallback}: no save before the last step to aim at; killed at random instead")
    dropped = [p.index for p in plans if p.index not in fallback and len(p.targets) < kills]
    if dropped:
        notes.append(
            f"trial(s) {dropped}: fewer saves before the last step than kills aimed at saves; the extra "
            "kills were left out (save more often or run longer for more)"
        )
    warnings = {
        a.watch_warning for a in [baseline, *(a for t in trials for a in t.attempts)] if a.watch_warning
    }
    notes += sorted(warnings)
    left = [("baseline", baseline.left_running)]
    left += [(f"trial {t.plan.index} run {a.index}", a.left_running) for t in trials for a in t.attempts]
    notes += left_running_notes(left)
    unkilled = [t.plan.index for t in trials if not any(a.kill for a in t.attempts)]
    if unkilled:
        notes.append(
            f"trial(s) {unkilled}: the command finished before the planned kill point: nothing tested there"
        )
    return notes
