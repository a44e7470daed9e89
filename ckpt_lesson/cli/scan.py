"""``python -m ckpt_lesson scan DIR``: verify every save in a run directory, print a table.

Exit status: 0 when every save is ok, 1 when one is corrupt or incomplete, 2 for a bad DIR.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.runs.scan import ScanResult, scan_checkpoints

# ---------------------------------------------------------------- CLI: python -m ckpt_lesson scan


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m ckpt_lesson scan``."""
    parser.add_argument("run_dir", metavar="DIR", help="run directory holding step-XXXXXXXX save folders")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.epilog = "Exit status: 0 all saves ok, 1 something corrupt or incomplete, 2 bad DIR or no saves."


def run(args: argparse.Namespace) -> int:
    """Print the scan; exit 0 when every save is ok, 1 otherwise."""
    results = scan_checkpoints(args.run_dir)
    if not results:
        # "0 saves, exit 0" would read as "all good" for a typo'd path or the parent of run folders.
        raise CheckpointError(
            f"{args.run_dir}: no saves found; expected a run directory holding step-XXXXXXXX folders "
            "(written by CheckpointManager). Pass the run directory itself, not its parent or a step folder."
        )
    if args.json:
        rows = [{**asdict(r), "path": str(r.path), "name": r.path.name} for r in results]
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(results))
    return 0 if all(r.ok for r in results) else 1


def format_table(results: list[ScanResult]) -> str:
    """A plain-text table (step, status, reason) plus a one-line summary, no paths."""
    lines = [f"{'step':>8}  {'status':<10}  reason"]
    for r in results:
        label = f"{r.step:>8}" if not r.path.name.startswith(".") else f"{'(' + str(r.step) + ')':>8}"
        lines.append(f"{label}  {r.status:<10}  {r.reason}".rstrip())
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "corrupt", "incomplete")}
    lines.append(
        f"{len(results)} save(s): {counts['ok']} ok, {counts['corrupt']} corrupt, "
        f"{counts['incomplete']} incomplete"
    )
    return "\n".join(lines)
