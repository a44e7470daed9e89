"""Kill a training run for real, resume it in a fresh process, compare every loss.

The claim this lesson makes is strong: a resumed run is *the same run*, loss
for loss, bit for bit. A claim like that is only worth something with an
honest experiment behind it, so this module runs one:

1. **Baseline.** Train ``total_steps`` steps without interruption.
2. **Interrupted run.** A child process trains to ``interrupt_at``, saves a
   checkpoint, tells the parent the save is complete, and keeps training.
   The parent then sends ``SIGKILL``: no ``finally`` blocks, no ``atexit``,
   no chance to tidy up, exactly like a pre-empted spot machine.
3. **Resumed run.** A *fresh* child process, told only where the checkpoint
   is (and the run's config), loads it and trains to ``total_steps``. It
   never sees the baseline's losses; the parent compares afterwards.

Two negative controls (in :mod:`ckpt_lesson.course.controls`) show what the
comparison catches: a resume that skips the RNG restore, and one that builds a
fresh optimizer. Both "work" (no error, a plausible loss curve) and both
quietly turn into a different run.

Run it with ``python -m ckpt_lesson demo``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt_lesson.course.controls import CONTROL_KINDS, caller_rng_preserved, control_records, max_loss_diff
from ckpt_lesson.course.demo_worker import (
    COURSE_SIZES,
    build_run,
    kill_after_save,
    release_resumer,
    spawn_child,
)
from ckpt_lesson.course.training import train
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.files.shard_index import INDEX_NAME, META_NAME

__all__ = ["RESUME_TOLERANCE", "demo_failures", "run_full_demo", "run_resume_demo"]

#: The CLI fails above this. On CPU the real difference is exactly 0.0; the
#: tolerance only exists so a GPU run with non-deterministic kernels can pass.
RESUME_TOLERANCE = 1e-4
#: The single-file variant's checkpoint inside ``ckpt_dir`` (the lesson's name).
SINGLE_FILE_NAME = "ckpt.pt"
_CHECKOUT = Path(__file__).resolve().parents[2]
#: Where ``python -m ckpt_lesson demo`` writes unless ``--out`` says otherwise: ``outputs/latest/``
#: of the checkout (ignored by git), or ``./outputs/latest`` when the package is installed (never a
#: folder inside the installed package). The committed ``outputs/`` files change only when asked
#: for (``--out outputs``): a run on another CPU rounds the losses' last bits differently and
#: would show a learner's clone modified files.
DEFAULT_OUT = (_CHECKOUT if (_CHECKOUT / "pyproject.toml").is_file() else Path()) / "outputs" / "latest"


def _validate(total_steps: int, interrupt_at: int, num_shards: int) -> None:
    for name, value in (
        ("total_steps", total_steps),
        ("interrupt_at", interrupt_at),
        ("num_shards", num_shards),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{name} must be an int, got {value!r}.")
    if not 0 < interrupt_at < total_steps:
        raise CheckpointError(
            f"interrupt_at={interrupt_at} must satisfy 0 < interrupt_at < total_steps={total_steps}: the "
            "kill has to happen after at least one step and before the end. Pick e.g. "
            f"--interrupt-at {max(1, total_steps // 2)} or raise --total-steps."
        )
    if num_shards < 1:
        raise CheckpointError(f"num_shards={num_shards} must be >= 1; pass --num-shards 1 or more.")


def _validate_sizes(sizes: dict[str, int]) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{name} must be an int >= 1, got {value!r}.")


def _baseline(total_steps: int, seed: int, sizes: dict[str, int]) -> tuple[list[float], list[list[int]]]:
    with caller_rng_preserved():
        data, model, optimizer, scheduler = build_run(seed, total_steps, sizes)
        state, bs = TrainState(), sizes["batch_size"]
        records = train(
            model, optimizer, scheduler, state, data, until_step=total_steps, seed=seed, batch_size=bs
        )
    return [r.loss for r in records], [list(r.sample_ids) for r in records]


def _clear_previous_save(ckpt_dir: Path, sharded: bool) -> Path:
    # Like the lesson, the demo reuses fixed names in ckpt_dir, so a second run
    # replaces the first one's checkpoint. Only the demo's own names are
    # touched; index.json goes first because its presence is the commit: a
    # crash halfway through this cleanup leaves an unfinished save, never a
    # finished-looking one with missing parts.
    if not sharded:
        (ckpt_dir / SINGLE_FILE_NAME).unlink(missing_ok=True)
        return ckpt_dir / SINGLE_FILE_NAME
    (ckpt_dir / INDEX_NAME).unlink(missing_ok=True)
    (ckpt_dir / META_NAME).unlink(missing_ok=True)
    for shard in sorted(ckpt_dir.glob("model.shard-*.pt")):
        shard.unlink()
    return ckpt_dir


def run_resume_demo(
    *,
    total_steps: int = 30,
    interrupt_at: int = 12,
    in_dim: int = 16,
    hidden: int = 24,
    out_dim: int = 4,
    batch_size: int = 4,
    batches_per_epoch: int = 5,
    seed: int = 11,
    ckpt_dir: str | os.PathLike[str],
    sharded: bool = False,
    num_shards: int = 3,
) -> dict[str, Any]:
    """Baseline, SIGKILLed child, fresh resumed child; compare losses and batches.

    The lesson's signature, defaults and file layout; the experiment is
    stricter than the lesson's in-process one (a real kill, a fresh process).

    Args:
        total_steps: Length of the whole run.
        interrupt_at: The checkpoint's step; the child is killed after saving it.
        in_dim, hidden, out_dim: Sizes of :func:`make_model` (the lesson's defaults).
        batch_size, batches_per_epoch: The data: ``batch_size * batches_per_epoch``
            samples, reshuffled every epoch. ``run_full_demo`` (the CLI, notebook 05)
            passes the course's sizes instead (``COURSE_SIZES``).
        seed: Seeds the generators, the data and the batch order.
        ckpt_dir: Where the checkpoint goes (created if missing). Single file:
            ``ckpt_dir/ckpt.pt``; sharded: ``index.json``, ``meta.pt`` and
            ``model.shard-NNN.pt`` straight into ``ckpt_dir``. A previous run's
            checkpoint of the same kind there is replaced, as in the lesson.
        sharded: Save with ``save_sharded_checkpoint`` instead of one file.
        num_shards: Shard count for the sharded variant.

    Returns:
        The lesson's keys: ``interrupt_at``, ``total_steps``, ``sharded``,
        ``max_loss_diff_after_resume`` (0.0 on CPU), ``full_losses`` (the
        baseline, ``total_steps`` long) and ``resumed_losses`` (the
        checkpoint's loss history plus the fresh process's steps, also
        ``total_steps`` long). Ours besides: ``losses_before_interrupt``,
        ``max_loss_diff_before_interrupt``, ``sample_ids_match`` plus both id
        lists (steps after the checkpoint), ``killed_by_sigkill``,
        ``interrupted_returncode``, ``checkpoint``, ``seed``, ``num_shards``.

    Raises:
        CheckpointError: Bad arguments (including ``interrupt_at`` not strictly
            inside the run), or a child failed (the message carries the end of its stderr).

    Example:
        >>> r = run_resume_demo(total_steps=20, interrupt_at=7, ckpt_dir="ckpt")  # doctest: +SKIP
        >>> r["max_loss_diff_after_resume"], r["sample_ids_match"]  # doctest: +SKIP
        (0.0, True)
    """
    _validate(total_steps, interrupt_at, num_shards)
    sizes = {
        "in_dim": in_dim,
        "hidden": hidden,
        "out_dim": out_dim,
        "batch_size": batch_size,
        "batches_per_epoch": batches_per_epoch,
    }
    _validate_sizes(sizes)
    ckpt_dir = Path(ckpt_dir)
    if ckpt_dir.exists() and not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: is a file, not a directory; pass a directory as ckpt_dir.")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    # Fixed hidden names for the children's signal files, removed when they are read.
    tag = "sharded" if sharded else SINGLE_FILE_NAME
    ready, out = ckpt_dir / f".{tag}.ready.json", ckpt_dir / f".{tag}.resumed.json"
    for stale in (ready, out):
        stale.unlink(missing_ok=True)
    target = _clear_previous_save(ckpt_dir, sharded)
    config = {
        "seed": seed,
        "total_steps": total_steps,
        "sharded": sharded,
        "ckpt": str(target),
        "sizes": sizes,
    }
    with tempfile.TemporaryFile() as err_killed, tempfile.TemporaryFile() as err_resumed:
        # Both children start now so their torch imports overlap. The resumer
        # is a separate, fresh process: it builds its objects, then blocks on
        # stdin and does not open the checkpoint until the parent says "go",
        # which happens only after the first child is dead.
        resumer = spawn_child(
            {**config, "role": "resume", "out": str(out)}, err_resumed, stdin=subprocess.PIPE
        )
        killed = None
        try:
            killed = spawn_child(
                {
                    **config,
                    "role": "interrupted",
                    "interrupt_at": interrupt_at,
                    "num_shards": num_shards,
                    "ready": str(ready),
                    "parent": os.getpid(),
                },
                err_killed,
            )
            full_losses, full_ids = _baseline(total_steps, seed, sizes)
            returncode = kill_after_save(killed, ready, err_killed, interrupt_at)
            resumed = release_resumer(resumer, out, err_resumed, target)
        finally:
            for proc in (resumer, killed):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
    if resumed["start_step"] != interrupt_at:
        raise CheckpointError(
            f"{target}: the resumed process started at step {resumed['start_step']}, expected {interrupt_at}."
        )
    return {
        "total_steps": total_steps,
        "interrupt_at": interrupt_at,
        "seed": seed,
        "sharded": sharded,
        "num_shards": num_shards if sharded else None,
        "checkpoint": str(target),
        "interrupted_returncode": returncode,
        "killed_by_sigkill": returncode == -signal.SIGKILL,
        "full_losses": full_losses,
        "losses_before_interrupt": resumed["losses_before"],
        # As in the lesson: the history the checkpoint carried, then the resumed steps.
        "resumed_losses": resumed["losses_before"] + resumed["losses"],
        "max_loss_diff_before_interrupt": max_loss_diff(resumed["losses_before"], full_losses[:interrupt_at]),
        "max_loss_diff_after_resume": max_loss_diff(resumed["losses"], full_losses[interrupt_at:]),
        "baseline_sample_ids": full_ids[interrupt_at:],
        "resumed_sample_ids": resumed["sample_ids"],
        "sample_ids_match": resumed["sample_ids"] == full_ids[interrupt_at:],
    }


def run_full_demo(
    *,
    total_steps: int = 30,
    interrupt_at: int = 12,
    num_shards: int = 3,
    seed: int = 11,
    ckpt_dir: str | os.PathLike[str],
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Everything ``python -m ckpt_lesson demo`` runs, as one dict for :func:`write_demo_artifacts`.

    The single-file and sharded resumes and both negative controls, all
    against the same baseline. Notebook 05 calls this too, so with the same
    arguments on the same machine both give the same results.

    Args:
        total_steps, interrupt_at, num_shards, seed: The run's shape.
        ckpt_dir: Where the checkpoints go.
        progress: Called with one line before each phase (the CLI prints it
            to stderr, so a 20-30 s run is not silent); ``None`` stays quiet.

    Returns:
        ``{"config": {...}, "baseline": {"losses", "sample_ids"}, "variants":
        {name: {"resumed_losses", "max_loss_diff_after_resume",
        "sample_ids_match", "real_resume", ...}}}``.

    Example:
        >>> results = run_full_demo(ckpt_dir="ckpt")  # doctest: +SKIP
        >>> write_demo_artifacts(results, "outputs")  # doctest: +SKIP
    """
    _validate(total_steps, interrupt_at, num_shards)
    say = progress or (lambda line: None)
    kwargs = {"total_steps": total_steps, "interrupt_at": interrupt_at, "seed": seed, "ckpt_dir": ckpt_dir}
    kwargs.update(COURSE_SIZES)  # the course's model and data (the controls build the same)
    phases = len(CONTROL_KINDS) + 2
    say(f"[1/{phases}] single-file checkpoint: SIGKILL at step {interrupt_at}, resume in a fresh process")
    runs = {"single_file": run_resume_demo(**kwargs)}
    say(f"[2/{phases}] sharded checkpoint ({num_shards} shards): the same kill and resume")
    runs["sharded"] = run_resume_demo(**kwargs, sharded=True, num_shards=num_shards)
    single = runs["single_file"]
    variants: dict[str, dict[str, Any]] = {}
    for name, r in runs.items():
        keep = ("resumed_losses", "max_loss_diff_after_resume", "max_loss_diff_before_interrupt")
        keep += ("sample_ids_match", "killed_by_sigkill", "interrupted_returncode", "num_shards")
        variants[name] = {"real_resume": True, **{k: r[k] for k in keep}}
        # Store the steps after the checkpoint, as for the controls (and the committed outputs/).
        variants[name]["resumed_losses"] = r["resumed_losses"][interrupt_at:]
    expected_ids = single["baseline_sample_ids"]
    for i, kind in enumerate(CONTROL_KINDS, start=3):
        say(f"[{i}/{phases}] negative control {kind}: a broken resume that must diverge")
        records = control_records(kind, ckpt_path=single["checkpoint"], total_steps=total_steps, seed=seed)
        losses = [r.loss for r in records]
        variants[kind] = {
            "real_resume": False,
            "resumed_losses": losses,
            "max_loss_diff_after_resume": max_loss_diff(losses, single["full_losses"][interrupt_at:]),
            "sample_ids_match": [list(r.sample_ids) for r in records] == expected_ids,
        }
    return {
        "config": {
            "total_steps": total_steps,
            "interrupt_at": interrupt_at,
            "num_shards": num_shards,
            "seed": seed,
            "resume_tolerance": RESUME_TOLERANCE,
        },
        "baseline": {"losses": single["full_losses"], "sample_ids": expected_ids},
        "variants": variants,
    }


def demo_failures(results: dict[str, Any]) -> list[str]:
    """What went wrong in ``results`` (from :func:`run_full_demo`); empty when the lesson's claims hold."""
    problems = []
    for name, v in results["variants"].items():
        diff = v["max_loss_diff_after_resume"]
        if v["real_resume"] and (diff > RESUME_TOLERANCE or not v["sample_ids_match"]):
            problems.append(f"{name}: max |loss diff| {diff:.3g}, sample ids match: {v['sample_ids_match']}")
        if not v["real_resume"] and diff == 0.0:
            problems.append(f"{name}: the negative control did not diverge, so it demonstrates nothing")
    return problems
