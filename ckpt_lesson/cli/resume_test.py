"""``python -m ckpt_lesson resume-test [options] -- COMMAND...``: does your script really resume?

A script can save checkpoints every few minutes and still not resume: the
RNG is reseeded, the optimizer is rebuilt, the data loader starts the epoch
over, or the save itself is cut in half by the kill it was meant to survive.
None of that raises an error; the run just quietly becomes a different run.

This command finds out by experiment. It runs the command once without
interruption (the baseline), then in trials that kill it at chosen moments
(right after a save is published, in the middle of a save, at random) and
restart it until it finishes. Each run gets a fresh checkpoint folder,
handed over as ``$CKPT_LESSON_CKPT_DIR`` and wherever ``{ckpt_dir}`` appears
in the command. The script reports its steps with one call,
``ckpt_lesson.log_step(step, loss, sample_ids=ids)`` (free when not under
this tool), or ``--step-pattern`` reads them from its output.

The trial's stitched trajectory (each step from the last process that ran it)
must equal the baseline's: exactly by default, within ``--atol``/``--rtol`` if
given. The verdict names the first differing step, the kill that caused it,
and, where the shape of the failure tells, the likely mistake.

A PASS needs more than equal trajectories: a kill after a published save and
a restart that really resumed (see :mod:`ckpt_lesson.resume_test.verdict`); matching runs
without them are INCONCLUSIVE.

Exit status: 0 PASS, 1 FAIL, 2 usage error (bad options, a command that
cannot start, fails or reports no steps on its own, steps that go back, an
unwritable --workdir), 3 INCONCLUSIVE, 128 + the signal when stopped.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
from pathlib import Path

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.resume_test.plan import KINDS
from ckpt_lesson.resume_test.session import run_session
from ckpt_lesson.runs.steplog import CKPT_DIR_ENV, STEP_LOG_ENV

__all__ = ["configure", "run"]

EPILOG = f"""\
what the command gets (each run, baseline and every trial, has its own fresh folder):
  ${CKPT_DIR_ENV}  the checkpoint folder; also substituted for {{ckpt_dir}} in the arguments
  ${STEP_LOG_ENV}  where ckpt_lesson.log_step(step, loss, sample_ids=None, **metrics)
                        appends one JSON line per step (log_step does nothing when it is unset)

what is compared:
  the trial's stitched trajectory (each step from the last process that ran it) against the
  baseline's: losses and metrics exactly (or within --atol/--rtol), sample ids exactly where
  reported. The verdict names the first differing step, the kill before it, and a likely cause.

kill points (--kill-at, cycled over the trials):
  after-save   right after a save is published: the restart resumes from exactly that save
  mid-save     while a save is being written: a save that is not atomic is left damaged
  random       at a random moment between two steps (possibly inside a save)
  A CheckpointManager run directory is understood exactly (.staging-step-* = a save in progress,
  step-* = published); any other folder is watched for new or growing files: those named by
  --ckpt-glob, else those that look like checkpoints (*.pt, *.pth, *.ckpt, *.safetensors, *.bin)
  once one appears, so that logs beside them (metrics.csv) are not taken for saves.

examples:
  python -m ckpt_lesson resume-test -- python examples/resume_train.py
  python -m ckpt_lesson resume-test --trials 2 --kill-at after-save -- python train.py --out {{ckpt_dir}}
  python -m ckpt_lesson resume-test --step-pattern 'step (\\d+) loss ([0-9.e+-]+)' -- ./train.sh
  python -m ckpt_lesson resume-test --signal TERM --grace 30 -- python train.py

verdicts (what a PASS means):
  PASS          the runs match AND resume was exercised: a kill landed after a save was published,
                a restart began past the first step (it really resumed), and steps increase within
                every process
  INCONCLUSIVE  the runs match but nothing was resumed (no save at all, a save only at the end, no
                kill after a save, every restart began at the first step): the report says which
                and what to change (save more often, a longer run, --kill-at after-save)
  FAIL          a trial differs from the baseline, crashed or hung; every failing trial gets a
                diagnosis, blamed on the kill before its first difference
  Before a difference is blamed on the save, the command runs once more without kills (only when a
  trial differs; --no-repeat-check skips it): two uninterrupted runs that differ give INCONCLUSIVE,
  naming the step and size of the difference and --atol/--rtol sized from it.
  Steps must be a global counter: a baseline whose steps go back (a per-epoch batch index) is a
  usage error.

exit status: 0 PASS, 1 FAIL, 2 usage error, 3 INCONCLUSIVE; 129/130/143 when stopped by
SIGHUP/SIGINT/SIGTERM (every process of the command is ended first, and the partial report
printed). Usage errors: a command that cannot start, fails or logs no steps on its own, steps
that do not increase, bad options, an unwritable --workdir. The report is also written to
WORKDIR/report.json, and when the runs differ, a plot of baseline vs resumed loss to WORKDIR/report.png.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m ckpt_lesson resume-test``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.usage = "%(prog)s [options] -- COMMAND [ARG ...]"
    add = parser.add_argument
    # dest "cmd", not "command": the top-level parser stores the subcommand's name in "command".
    add("cmd", nargs=argparse.REMAINDER, metavar="COMMAND",
        help="the training command and its arguments, after --")  # fmt: skip
    add("--workdir", metavar="DIR", help="where checkpoint folders, logs and the report go "
        "(a new or empty folder; default: a new temporary folder, kept and printed)")  # fmt: skip
    add("--trials", type=int, default=3, metavar="N", help="kill-and-restart trials (default: 3)")
    add("--kills", type=int, default=2, metavar="N", help="kills per trial (default: 2)")
    add("--kill-at", default=",".join(KINDS), metavar="KINDS",
        help=f"comma-separated kill points, cycled over the trials (default: {','.join(KINDS)})")  # fmt: skip
    add("--signal", choices=("KILL", "TERM"), default="KILL",
        help="KILL (default): a crash; TERM: a preemption notice, then KILL after --grace")  # fmt: skip
    add("--grace", type=float, default=10.0, metavar="SECONDS",
        help="with --signal TERM: seconds before the KILL follows (default: 10)")  # fmt: skip
    add("--seed", type=int, default=0, help="seeds the choice of kill points (default: 0)")
    add("--timeout", type=float, default=600.0, metavar="SECONDS",
        help="limit for each run of the command, baseline and every restart (default: 600)")  # fmt: skip
    add(
        "--atol",
        type=float,
        default=0.0,
        metavar="TOL",
        help="absolute tolerance for losses and metrics (default: 0, exact)",
    )
    add(
        "--rtol",
        type=float,
        default=0.0,
        metavar="TOL",
        help="relative tolerance for losses and metrics (default: 0, exact)",
    )
    add("--step-pattern", metavar="REGEX",
        help="read steps from the command's stdout instead of log_step: named groups (?P<step>...) "
        "and (?P<loss>...), or two plain groups in that order")  # fmt: skip
    add("--ckpt-glob", action="append", default=[], metavar="PATTERN",
        help="a plain folder's checkpoint files (repeatable; matched against the path in the folder or the "
        "bare name, e.g. '*.ckpt'): mid-save kills aim at them, other files (logs) are not saves. Default: "
        "names ending in .pt, .pth, .ckpt, .safetensors or .bin are preferred once one appears")  # fmt: skip
    add("--no-repeat-check", action="store_true",
        help="when a trial differs, do not run the command a second time uninterrupted to check that "
        "the baseline repeats (the check costs one more uninterrupted run, only when a trial differs; "
        "two uninterrupted runs that differ give INCONCLUSIVE with suggested --atol/--rtol)")  # fmt: skip
    add("--json", action="store_true", help="print the report as JSON instead of text")
    add("--lose-machine", action="store_true",
        help="restart each kill on a fresh 'machine': a copy of the working folder taken before the "
        "baseline (code and inputs), new HOME, TMPDIR and caches, no local checkpoint folder; only a "
        "store named in the command or its environment (s3://..., also --flag=s3://...; {run_id} for a "
        "per-run prefix, unique per invocation) survives. Files written outside the machine are "
        "named, and keep the verdict from PASS")  # fmt: skip


def _check_options(args: argparse.Namespace) -> tuple[list[str], tuple[str, ...]]:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CheckpointError("no command given: put it after --, e.g. resume-test -- python train.py.")
    for name in ("trials", "kills"):
        if getattr(args, name) < 1:
            raise CheckpointError(f"--{name} must be >= 1, got {getattr(args, name)}.")
    for name in ("timeout", "grace"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise CheckpointError(f"--{name} must be a number of seconds > 0, got {value}.")
    for name in ("atol", "rtol"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            raise CheckpointError(f"--{name} must be a number >= 0, got {value}.")
    if any(not g.strip() for g in args.ckpt_glob):
        raise CheckpointError("--ckpt-glob needs a pattern, e.g. --ckpt-glob '*.ckpt'.")
    kinds = tuple(k.strip() for k in args.kill_at.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if not kinds or unknown:
        raise CheckpointError(
            f"--kill-at {args.kill_at!r}: choose from {', '.join(KINDS)} (comma-separated)."
        )
    program = command[0]
    if os.sep not in program and shutil.which(program) is None:
        raise CheckpointError(
            f"command not found: {program!r} is not on PATH; check the spelling or give its path."
        )
    if os.sep in program and not Path(program).is_file():
        raise CheckpointError(f"command not found: {program!r} does not exist.")
    return command, kinds


def run(args: argparse.Namespace) -> int:
    """Check the options, then run the session (:func:`~ckpt_lesson.resume_test.session.run_session`).

    Args:
        args: The parsed options (see :func:`configure`).

    Returns:
        0 when every trial matches the baseline (PASS), 1 otherwise (FAIL).

    Raises:
        CheckpointError: A usage error (the CLI prints it as one line and exits 2): bad options,
            an unusable --workdir, or a command that cannot start, fails on its own, times out
            or reports no steps in the baseline run.

    Example:
        >>> run(build_parser().parse_args(["resume-test", "--", "python", "train.py"]))  # doctest: +SKIP
        0
    """
    command, kinds = _check_options(args)
    return run_session(args, command, kinds)
