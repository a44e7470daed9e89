"""``python -m ckpt_lesson bench``: what our safety costs against plain PyTorch, measured honestly.

This module checks the flags, makes sure ``MALLOC_MMAP_THRESHOLD_`` is set
(re-executing itself when it is missing), then calls
:func:`ckpt_lesson.bench.runner.measure`; the rules that keep the numbers
honest are written there. Writes ``benchmarks/results/bench-<time>.json`` (or
``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ckpt_lesson.bench.runner import MMAP_ENV, MMAP_VALUE, measure, print_table


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size-mb", type=float, default=128.0, help="total state size (weights + AdamW moments)"
    )
    parser.add_argument("--reps", type=int, default=5, help="repetitions (each runs every variant once)")
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all pairs)")
    parser.add_argument("--dir", default=None, help="folder for the files written (default: system temp)")
    parser.add_argument("--out", default=None, help="JSON result path (default: benchmarks/results/)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffled order")


def run(args: argparse.Namespace) -> int:
    from ckpt_lesson.bench.cases import PAIRS

    if args.reps < 1 or args.size_mb <= 0:
        print("error: --reps must be >= 1 and --size-mb > 0", file=sys.stderr)
        return 2
    wanted = [p for p in PAIRS if not args.only or p[0] in args.only.split(",")]
    if not wanted:
        print(f"error: --only matches no variant; choose from {[p[0] for p in PAIRS]}", file=sys.stderr)
        return 2
    if os.environ.get(MMAP_ENV) != MMAP_VALUE:
        # glibc reads the variable at process start: re-run this command with it set.
        env = {**os.environ, MMAP_ENV: MMAP_VALUE}
        argv = ["bench", "--size-mb", str(args.size_mb), "--reps", str(args.reps), "--seed", str(args.seed)]
        for flag, value in (("--only", args.only), ("--dir", args.dir), ("--out", args.out)):
            argv += [flag, value] if value else []
        return subprocess.call([sys.executable, "-m", "ckpt_lesson", *argv], env=env)
    result = measure(wanted, size_mb=args.size_mb, reps=args.reps, seed=args.seed, folder=args.dir)
    out = (
        Path(args.out)
        if args.out
        else Path("benchmarks") / "results" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print_table(result)
    print(f"wrote {out}")
    return 0
