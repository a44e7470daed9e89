"""``python -m ckpt_lesson lesson-demo``: the lesson's ``python3 code/main.py``, flags and all.

The lesson's script runs its resume demo twice, single file then sharded, each
in a scratch directory, prints each result without the loss lists, and writes
a short ``resume-demo.json`` summary. This command does the same with the same
flags and defaults (``--total-steps 24 --interrupt-at 10 --num-shards 3 --seed 11``),
so its text and its outputs read the same. Two deliberate differences:

* The summary goes to ``--out`` (default ``outputs/lesson/``), not the repo's
  ``outputs/``: ``python -m ckpt_lesson demo --out outputs`` owns ``outputs/resume-demo.json``
  and writes it in its own, richer format.
* A drifted resume is one line on stderr and exit code 1, where the lesson's
  ``assert`` prints a traceback (and ``python -O`` would skip the check).

``--sharded`` is accepted and, as in the lesson, changes nothing: both
variants always run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ckpt_lesson.course.demo import DEFAULT_OUT
from ckpt_lesson.course.lesson_run import LESSON_SUMMARY_SCHEMA, run_lesson_demo
from ckpt_lesson.errors import CheckpointError

__all__ = ["LESSON_OUT", "LESSON_SUMMARY_SCHEMA", "configure", "main", "parse_args", "run"]

#: Where the summary goes unless ``--out`` says otherwise.
LESSON_OUT = DEFAULT_OUT / "lesson"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the lesson's flags (same names and defaults) plus ``--out``."""
    parser.add_argument("--total-steps", type=int, default=24, help="length of the run (default 24)")
    parser.add_argument("--interrupt-at", type=int, default=10, help="save here, then SIGKILL (default 10)")
    parser.add_argument(
        "--sharded", action="store_true", help="accepted for the lesson's sake; both variants always run"
    )
    parser.add_argument("--num-shards", type=int, default=3, help="shards for the sharded run (default 3)")
    parser.add_argument("--seed", type=int, default=11, help="seed (default 11)")
    parser.add_argument(
        "--out", type=Path, default=LESSON_OUT, help="folder for resume-demo.json (default outputs/lesson/)"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The lesson's ``parse_args``: ``argv`` (default ``sys.argv[1:]``) into a namespace.

    Example:
        >>> parse_args(["--total-steps", "12"]).total_steps
        12
    """
    parser = argparse.ArgumentParser(
        prog="python -m ckpt_lesson lesson-demo", description=__doc__.split("\n")[0]
    )
    configure(parser)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    """Run both variants (:func:`~ckpt_lesson.course.lesson_run.run_lesson_demo`); 1 if a resume drifted.

    Raises:
        CheckpointError: Bad flags (e.g. ``--interrupt-at`` outside the run) or a failed child.
    """
    results, path, drifted = run_lesson_demo(
        total_steps=args.total_steps, interrupt_at=args.interrupt_at, num_shards=args.num_shards,
        seed=args.seed, out=args.out,
    )  # fmt: skip
    print(f"wrote {path}")
    for name in drifted:
        diff = results[name]["max_loss_diff_after_resume"]
        print(f"FAILED {name}: loss drifted after resume (max |diff| {diff:.3g})", file=sys.stderr)
    return 1 if drifted else 0


def main(argv: Sequence[str] | None = None) -> int:
    """The lesson's ``main``: parse the flags, run, return the exit code (errors as one line, code 2).

    Example:
        >>> main(["--total-steps", "12", "--interrupt-at", "5", "--out", "lesson-out"])  # doctest: +SKIP
        0
    """
    args = parse_args(argv)
    try:
        return run(args)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
