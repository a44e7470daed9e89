"""``python -m ckpt_lesson COMMAND ...``: one entry point, one module per command.

Each command lives in its own module, which defines ``configure(parser)`` to
add its arguments and ``run(args) -> int`` to do the work. Adding a command
is one line in :data:`COMMANDS` plus its module.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

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


class OneLineParser(argparse.ArgumentParser):
    """argparse, except that a usage error is one line on stderr (exit 2), like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


#: Python parameter names in library messages, and the flags that set them from the command line.
FLAG_NAMES = {
    "env_policy='warn'": "--env-policy warn",
    "env_policy='allow'": "--env-policy allow",
    "resume='auto'": "--resume auto",
    "resume='never'": "--resume never",
    "resume='must'": "--resume must",
    "env_policy": "--env-policy",
    "total_steps": "--total-steps",
    "interrupt_at": "--interrupt-at",
    "num_shards": "--num-shards",
    "keep_last": "--keep-last",
    "batch_size": "--batch-size",
    "every_steps": "--ckpt-every-steps",
    "every_seconds": "--ckpt-every-seconds",
    "backup_suffix": "--backup-suffix",
    "stop_after_step": "--stop-after-step",
}
_FLAG_RE = re.compile("|".join(rf"(?<![\w-]){re.escape(k)}(?![\w])" for k in FLAG_NAMES))


def one_line(message: str) -> str:
    """A library message as the command line shows it: one line, flags instead of parameter names.

    Example:
        >>> one_line("pass env_policy='warn'\n  to continue")
        'pass --env-policy warn | to continue'
    """
    text = _FLAG_RE.sub(lambda m: FLAG_NAMES[m.group(0)], message)
    return " | ".join(part.strip() for part in text.splitlines() if part.strip())


def describe_error(exc: BaseException) -> str:
    """One line for any error a command can end with (the traceback is for CKPT_LESSON_DEBUG=1)."""
    if isinstance(exc, CheckpointError):
        return one_line(str(exc))
    if isinstance(exc, OSError):
        where = f"{str(exc.filename)[:200]}: " if exc.filename else ""
        hint = {
            errno.ENOSPC: "no space left on device; free space or choose another --ckpt-dir/--out",
            errno.EROFS: "read-only file system; choose a writable folder",
            errno.ENAMETOOLONG: "a path or file name is too long; shorten it",
            errno.EACCES: "permission denied; check the folder's permissions",
        }.get(exc.errno or 0, exc.strerror or str(exc))
        return one_line(f"{where}{hint}")
    if isinstance(exc, RuntimeError) and "unexpected pos" in str(exc):
        return "no space left on device while writing a checkpoint; free space or choose another folder"
    return one_line(f"{type(exc).__name__}: {exc}")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m ckpt_lesson",
        description="Crash-safe checkpoint save and resume for PyTorch training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineParser)
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
    except (Exception, MemoryError) as exc:  # every error is one line; KeyboardInterrupt stays itself
        if os.environ.get("CKPT_LESSON_DEBUG"):
            raise
        print(f"error: {describe_error(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
