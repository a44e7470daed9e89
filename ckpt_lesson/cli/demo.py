"""``python -m ckpt_lesson demo``: kill a training run, resume it in a fresh process, compare losses."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ckpt_lesson.course.demo import DEFAULT_OUT, _validate, demo_failures, run_full_demo
from ckpt_lesson.course.demo_artifacts import write_demo_artifacts
from ckpt_lesson.errors import CheckpointError


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``demo`` command's options."""
    parser.add_argument("--total-steps", type=int, default=30, help="length of the run (default 30)")
    parser.add_argument("--interrupt-at", type=int, default=12, help="save here, then SIGKILL (default 12)")
    parser.add_argument(
        "--num-shards", type=int, default=3, help="shards for the sharded variant (default 3)"
    )
    parser.add_argument(
        "--seed", type=int, default=11, help="seed for generators, data and order (default 11)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="artifact folder (default: outputs/latest/, ignored by git; "
        "--out outputs refreshes the committed files)",
    )
    parser.add_argument(
        "--ckpt-dir", type=Path, default=None, help="keep checkpoints here (default: a temp dir)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo, print a table, write the artifacts; 1 if a resume diverged, else 0."""
    _validate(args.total_steps, args.interrupt_at, args.num_shards)
    # Checked before 30 s of training, not after: every output folder must be usable as one.
    for flag, folder in (("--out", args.out), ("--ckpt-dir", args.ckpt_dir)):
        for p in () if folder is None else (Path(folder), *Path(folder).parents):
            if p.exists() and not p.is_dir():
                raise CheckpointError(f"{flag} {folder}: {p} is a file, not a folder; pick another {flag}.")
    kwargs = {
        "total_steps": args.total_steps,
        "interrupt_at": args.interrupt_at,
        "num_shards": args.num_shards,
        "seed": args.seed,
        # Each phase forks fresh processes and takes seconds: say what is running, on stderr so
        # stdout stays the result table.
        "progress": lambda line: print(line, file=sys.stderr, flush=True),
    }
    if args.ckpt_dir is None:
        with tempfile.TemporaryDirectory(prefix="ckpt-demo-") as tmp:
            results = run_full_demo(**kwargs, ckpt_dir=tmp)
    else:
        results = run_full_demo(**kwargs, ckpt_dir=args.ckpt_dir)
    print(f"{'variant':<18} {'max |loss diff| after resume':>30} {'sample ids match':>17}")
    for name, v in results["variants"].items():
        print(f"{name:<18} {v['max_loss_diff_after_resume']:>30.6g} {str(v['sample_ids_match']):>17}")
    paths = write_demo_artifacts(results, args.out)
    print("wrote " + ", ".join(p.name for p in paths.values()) + f" to {args.out}")
    problems = demo_failures(results)
    for problem in problems:
        print(f"FAILED {problem}", file=sys.stderr)
    return 1 if problems else 0
