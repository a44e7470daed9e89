"""``python -m ckpt_lesson report DIR``: summarise a run's restores from ``recovery.jsonl``."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path

from ckpt_lesson.runs.report import RECOVERY_LOG, read_recovery_log, summarize_recoveries


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir",
        help="a run directory (holds step-* saves and recovery.jsonl), or its bucket URL (s3://...)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    records = read_recovery_log(args.run_dir)  # a URL's credentials from the AWS_* environment
    summary = summarize_recoveries(records)
    if args.json:
        # Strict JSON: NaN and Infinity are not JSON, so they become null (unknown).
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in asdict(summary).items()
        }
        print(json.dumps(clean, indent=2, sort_keys=True, allow_nan=False))
    elif not records:
        name = Path(args.run_dir).name  # for a URL, its last part too
        print(f"{name}: no restores recorded ({RECOVERY_LOG} is absent or empty)")
    else:
        print(summary.format())
    return 0
