"""``python -m ckpt_lesson train``: the teaching run, saved and resumed by a manager.

The recipe itself is :func:`ckpt_lesson.course.managed.run_managed_training`;
this module only turns flags into its arguments and prints a summary.
"""

from __future__ import annotations

import argparse
from typing import Any

from ckpt_lesson.course.managed import DEFAULT_EVERY_STEPS, RESUME_MODES, run_managed_training
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.runs.preemption import PreemptionHandler

# ---------------------------------------------------------------- CLI: python -m ckpt_lesson train


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m ckpt_lesson train``."""
    parser.add_argument("--ckpt-dir", required=True, help="run folder for step-XXXXXXXX saves")
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


def run(args: argparse.Namespace) -> int:
    """Run the managed training and print a one-line summary."""
    every_steps = args.ckpt_every_steps
    if every_steps is None and args.ckpt_every_seconds is None:
        every_steps = DEFAULT_EVERY_STEPS
    if args.num_shards < 0:
        raise CheckpointError(f"--num-shards must be >= 0 (0 = single file), got {args.num_shards}.")
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
    )
