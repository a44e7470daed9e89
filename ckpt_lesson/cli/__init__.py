"""``python -m ckpt_lesson COMMAND ...``: one entry point, one module per command.

Each command lives in its own module, which defines ``configure(parser)`` to
add its arguments and ``run(args) -> int`` to do the work. Adding a command
is one line in :data:`COMMANDS` plus its module.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ckpt_lesson.errors import CheckpointError

#: command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("ckpt_lesson.cli.bench", "time our saves and restores against plain torch (paired, shuffled)"),
    "chaos": ("ckpt_lesson.cli.chaos", "SIGKILL training at chosen points; check every restore"),
    "demo": ("ckpt_lesson.cli.demo", "kill a training run, resume it in a fresh process, compare losses"),
    "lesson-demo": (
        "ckpt_lesson.cli.lesson_demo",
        "the lesson's code/main.py: its flags, its printout, its resume-demo.json summary",
    ),
    "migrate": (
        "ckpt_lesson.cli.migrate",
        "rewrite an old checkpoint in the current schema, adding its footer",
    ),
    "report": (
        "ckpt_lesson.cli.report",
        "summarise a run's restores: fallbacks, steps redone, recovery times",
    ),
    "resume-test": (
        "ckpt_lesson.cli.resume_test",
        "kill and restart your training command; check it resumes exactly (PASS/FAIL)",
    ),
    "scan": ("ckpt_lesson.cli.scan", "verify every save in a run directory (exit 1 if any is bad)"),
    "train": ("ckpt_lesson.cli.train", "train the teaching model with managed saves and auto-resume"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ckpt_lesson",
        description="Crash-safe checkpoint save and resume for PyTorch training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).configure(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the process exit code."""
    args = build_parser().parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args))
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
