"""The lesson's demo run: both checkpoint variants, killed and resumed, and the summary it writes.

The lesson's ``python3 code/main.py`` trains, interrupts and resumes once with a single-file
checkpoint and once with a sharded one, prints each result and writes ``resume-demo.json``. The
command ``python -m ckpt_lesson lesson-demo`` (:mod:`ckpt_lesson.cli.lesson_demo`) only parses the
lesson's flags and calls :func:`run_lesson_demo`.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from ckpt_lesson.course.demo import RESUME_TOLERANCE, run_resume_demo
from ckpt_lesson.files.atomic import atomic_write_json

__all__ = ["LESSON_SUMMARY_SCHEMA", "run_lesson_demo"]

#: Schema of the summary the lesson's demo writes.
LESSON_SUMMARY_SCHEMA = "resume-demo.v1"


def run_lesson_demo(
    *, total_steps: int, interrupt_at: int, num_shards: int, seed: int, out: str | Path
) -> tuple[dict[str, Any], Path, list[str]]:
    """Run both variants, print each result as the lesson does, write the summary.

    Args:
        total_steps: Steps of each run.
        interrupt_at: The step after which the run is killed.
        num_shards: Shards of the sharded variant.
        seed: The training seed.
        out: Folder for ``resume-demo.json``.

    Returns:
        ``(results by variant, the summary's path, the variants whose resumed loss drifted)``.

    Raises:
        CheckpointError: Bad settings or a failed child run.

    Example:
        >>> results, path, drifted = run_lesson_demo(  # doctest: +SKIP
        ...     total_steps=12, interrupt_at=5, num_shards=2, seed=0, out="lesson-out")
    """
    results = {}
    with tempfile.TemporaryDirectory(prefix="ckpt-demo-") as scratch:
        for name, sharded in (("single", False), ("sharded", True)):
            print(f"running resume demo ({'sharded' if sharded else 'single file'} checkpoint)")
            r = run_resume_demo(
                total_steps=total_steps,
                interrupt_at=interrupt_at,
                ckpt_dir=Path(scratch) / name,
                sharded=sharded,
                num_shards=num_shards,
                seed=seed,
            )
            # The lesson prints everything but the loss lists; ours has more lists (ids) and a temp path.
            shown = {k: v for k, v in r.items() if not isinstance(v, list) and k != "checkpoint"}
            print(json.dumps(shown, indent=2))
            results[name] = r
    summary: dict[str, Any] = {"schema": LESSON_SUMMARY_SCHEMA}
    for name, r in results.items():
        summary[name] = {k: r[k] for k in ("max_loss_diff_after_resume", "interrupt_at", "total_steps")}
    summary["sharded"]["num_shards"] = num_shards
    path = Path(out) / "resume-demo.json"
    atomic_write_json(summary, path)
    drifted = [n for n, r in results.items() if not r["max_loss_diff_after_resume"] < RESUME_TOLERANCE]
    return results, path, drifted
