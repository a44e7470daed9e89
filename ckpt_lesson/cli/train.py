"""``python -m ckpt_lesson train``: the teaching run, saved and resumed by a manager.

The recipe itself is :func:`ckpt_lesson.course.managed.run_managed_training`;
this module only turns flags into its arguments and prints a summary.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from ckpt_lesson.course.managed import DEFAULT_EVERY_STEPS, RESUME_MODES, run_managed_training
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.storage import is_store_url
from ckpt_lesson.runs.contract import ENV_POLICIES
from ckpt_lesson.runs.preemption import PreemptionHandler

# ---------------------------------------------------------------- CLI: python -m ckpt_lesson train


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m ckpt_lesson train``."""
    parser.add_argument(
        "--ckpt-dir",
        required=True,
        help="run folder for step-XXXXXXXX saves, or a bucket URL (s3://BUCKET/PREFIX; credentials and "
        "endpoint from the AWS_* environment)",
    )
    parser.add_argument("--total-steps", type=int, required=True, help="steps of the whole run")
    parser.add_argument(
        "--ckpt-every-steps",
        type=int,
        default=None,
        help=f"save every N steps (default {DEFAULT_EVERY_STEPS} when --ckpt-every-seconds is not given)",
    )
    parser.add_argument(
        "--ckpt-every-seconds", type=float, default=None, help="save every T seconds of wall time"
    )
    parser.add_argument("--keep-last", type=int, default=3, help="verified saves to keep (default 3)")
    parser.add_argument(
        "--resume",
        choices=RESUME_MODES,
        default="auto",
        help="auto: continue from the newest good save if any; never: refuse a folder with saves; "
        "must: refuse to start without one",
    )
    parser.add_argument("--seed", type=int, default=11, help="seed of data, model, RNGs and batch order")
    parser.add_argument(
        "--num-shards", type=int, default=0, help="0: one checkpoint.pt per save; N: N model shards"
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--stop-after-step",
        type=int,
        default=None,
        help="stop after this step without a final save (simulates a crash)",
    )
    parser.add_argument("--no-progress", action="store_true", help="never show the progress bar")
    parser.add_argument(
        "--env-policy",
        choices=ENV_POLICIES,
        default="refuse",
        help="a resume on a changed environment (torch/Python version, devices): refuse (default), "
        "warn and continue, or allow silently",
    )


#: Samples in the teaching data set (SyntheticRegression's default size).
DATA_SIZE = 256


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad flags before anything is built or written, naming the flag.

    Raises:
        CheckpointError: The first bad flag.
    """
    _at_least(args.total_steps, 1, "--total-steps")
    _at_least(args.keep_last, 1, "--keep-last")
    _at_least(args.num_shards, 0, "--num-shards", " (0 = single file)")
    if args.ckpt_every_steps is not None:
        _at_least(args.ckpt_every_steps, 1, "--ckpt-every-steps")
    if args.ckpt_every_seconds is not None and not (0 < args.ckpt_every_seconds < math.inf):
        raise CheckpointError(
            f"--ckpt-every-seconds must be a finite number > 0, got {args.ckpt_every_seconds}."
        )
    if not 1 <= args.batch_size <= DATA_SIZE:
        raise CheckpointError(
            f"--batch-size must be between 1 and {DATA_SIZE} (the data set's size), got {args.batch_size}."
        )
    if not 0 <= args.seed < 2**32:
        raise CheckpointError(f"--seed must be between 0 and 2**32 - 1, got {args.seed}.")
    if args.stop_after_step is not None:
        _at_least(args.stop_after_step, 1, "--stop-after-step")
    if is_store_url(args.ckpt_dir):
        return  # a bucket: CheckpointManager checks it (client installed, bucket reachable)
    ckpt_dir = Path(args.ckpt_dir)
    for p in (ckpt_dir, *ckpt_dir.parents):
        if p.exists() and not p.is_dir():
            raise CheckpointError(
                f"--ckpt-dir {ckpt_dir}: {p} is a file, not a folder; pick another --ckpt-dir."
            )
    if ckpt_dir.resolve().parts[1:2] in (("proc",), ("sys",), ("dev",)):
        raise CheckpointError(f"--ckpt-dir {ckpt_dir}: is on a pseudo file system; pick a folder on a disk.")


def _at_least(value: int, low: int, flag: str, note: str = "") -> None:
    if value < low:
        raise CheckpointError(f"{flag} must be >= {low}{note}, got {value}.")


def run(args: argparse.Namespace) -> int:
    """Run the managed training and print a one-line summary."""
    check_arguments(args)
    every_steps = args.ckpt_every_steps
    if every_steps is None and args.ckpt_every_seconds is None:
        every_steps = DEFAULT_EVERY_STEPS
    with PreemptionHandler() as preemption:  # SIGTERM/SIGINT: finish the step, save, exit 75
        out = _run_cli_training(args, every_steps, preemption)
    start = "scratch" if out["resumed_from"] is None else f"step {out['resumed_from']}"
    loss = f"{out['losses'][-1]:.6f}" if out["losses"] else "n/a"
    status = "preempted" if out["preempted"] else "stopped early" if out["stopped_early"] else "done"
    print(
        f"{status}: step {out['final_step']}/{args.total_steps} (from {start}); "
        f"saved steps {out['saved_steps']}; final loss {loss}"
    )
    return int(out["exit_code"])


def _run_cli_training(
    args: argparse.Namespace, every_steps: int | None, preemption: PreemptionHandler
) -> dict[str, Any]:
    return run_managed_training(
        args.ckpt_dir,
        total_steps=args.total_steps,
        seed=args.seed,
        every_steps=every_steps,
        every_seconds=args.ckpt_every_seconds,
        keep_last=args.keep_last,
        num_shards=args.num_shards or None,
        resume=args.resume,
        batch_size=args.batch_size,
        progress=not args.no_progress,
        stop_after_step=args.stop_after_step,
        preemption=preemption,
        env_policy=args.env_policy,
    )
