"""``python -m ckpt_lesson scan DIR``: verify every save in a run directory, print a table.

Exit status: 0 when every save is ok, 1 when one is corrupt or incomplete, 2 for a bad DIR.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.runs.layout import ScanResult
from ckpt_lesson.runs.lightning_files import LIGHTNING_SUFFIX, is_lightning_temp_file, newness
from ckpt_lesson.runs.scan import scan_checkpoints

# ---------------------------------------------------------------- CLI: python -m ckpt_lesson scan


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m ckpt_lesson scan``."""
    parser.add_argument(
        "run_dir",
        metavar="DIR",
        help="run directory holding step-XXXXXXXX save folders, Hugging Face checkpoint-N folders "
        "or Lightning .ckpt files; or a bucket URL (s3://BUCKET/PREFIX)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.epilog = "Exit status: 0 all saves ok, 1 something corrupt or incomplete, 2 bad DIR or no saves."


def run(args: argparse.Namespace) -> int:
    """Print the scan; exit 0 when every save is ok, 1 otherwise."""
    results = scan_checkpoints(args.run_dir)  # a URL's credentials and endpoint from the AWS_* environment
    if not results:
        # "0 saves, exit 0" would read as "all good" for a typo'd path or the parent of run folders.
        raise CheckpointError(
            f"{args.run_dir}: no saves found; expected a run directory holding step-XXXXXXXX folders "
            "(written by CheckpointManager), checkpoint-N folders (Hugging Face) or .ckpt files (Lightning). "
            "Pass the run directory itself, not its parent or a step folder."
        )
    if args.json:
        rows = [{**asdict(r), "path": str(r.path), "name": r.path.name} for r in results]
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(results))
    return 0 if all(r.ok for r in results) else 1


def format_table(results: list[ScanResult]) -> str:
    """A plain-text table (step, status, reason) plus a one-line summary, no paths.

    A Lightning ``.ckpt`` row names its file and epoch (one folder holds
    ``last.ckpt`` and ``epoch=3-step=12.ckpt`` of the same step), and the
    newest good file is named at the end: the one to resume from.
    """
    lines = [f"{'step':>8}  {'status':<10}  reason"]
    for r in results:
        step = "?" if r.step is None else str(r.step)
        label = f"{step:>8}" if not r.path.name.startswith(".") else f"{'(' + step + ')':>8}"
        lines.append(f"{label}  {r.status:<10}  {_what(r)}".rstrip())
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "corrupt", "incomplete", "unverified")}
    lines.append(
        f"{len(results)} save(s): {counts['ok']} ok, {counts['corrupt']} corrupt, "
        f"{counts['incomplete']} incomplete"
        + (f", {counts['unverified']} unverified" if counts["unverified"] else "")
    )
    files = [r for r in results if r.path.suffix == LIGHTNING_SUFFIX and not r.path.name.startswith(".")]
    if files:
        good = [r for r in files if r.ok]
        newest = max(good, key=newness) if good else None
        lines.append(
            f"newest good file: {newest.path.name}" if newest else "no good .ckpt file to resume from"
        )
    return "\n".join(lines)


def _what(r: ScanResult) -> str:
    if r.path.suffix != LIGHTNING_SUFFIX and not is_lightning_temp_file(r.path.name):
        return r.reason
    head = r.path.name + (f" (epoch {r.epoch})" if r.epoch is not None else "")
    reason = r.reason.removeprefix(f"{r.path.name}: ")  # the row names the file already
    return f"{head}: {reason}" if reason else head
