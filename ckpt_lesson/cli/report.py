"""``python -m ckpt_lesson report DIR``: summarise a run's restores from ``recovery.jsonl``."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from ckpt_lesson.runs.report import RECOVERY_LOG, read_recovery_log, summarize_recoveries


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (holds step-* saves and recovery.jsonl)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    records = read_recovery_log(args.run_dir)
    summary = summarize_recoveries(records)
    if args.json:
        print(json.dumps(asdict(summary), indent=2, sort_keys=True))
    elif not records:
        print(f"{Path(args.run_dir).name}: no restores recorded ({RECOVERY_LOG} is absent or empty)")
    else:
        print(summary.format())
    return 0
