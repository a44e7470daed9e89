"""Notebook 05's capstone: a run SIGKILLed after a save and resumed in a fresh process."""

from __future__ import annotations

import inspect
import subprocess
import sys

from ckpt_lesson.course import capstone, solutions


def test_a_run_killed_after_step_12s_save_resumes_in_a_fresh_process_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ckpt_work/yours here: the package's functions run
    run = capstone.run_capstone(tmp_path / "capstone")
    assert run["lines"][-1] == "resumed from step 12: epoch 0, batch 12"
    assert len(run["resumed"]) == len(run["baseline"]) == capstone.TOTAL
    assert run["resumed"] == run["baseline"]  # exact: the same arithmetic, not close
    assert run["same_weights"] is True


def test_the_capstone_kills_and_resumes_the_learners_kept_functions_once_they_pass(tmp_path):
    # The learner's functions must live in __main__ (a notebook's namespace) to be kept, so a
    # script in its own process solves 01, 02, 03 and 05 with the reference solutions' source.
    functions = (
        solutions.capture_rng_state,
        solutions.restore_rng_state,
        solutions.atomic_save,
        solutions.save_checkpoint,
        solutions.load_checkpoint,
        solutions.next_batch_ids,
    )
    script = "import os, random, uuid\nfrom pathlib import Path\nimport numpy as np, torch\n"
    script += "from ckpt_lesson.files.checkpoint import TrainState\n"
    script += "".join("\n\n" + inspect.getsource(f) for f in functions)
    script += (
        "\nfrom ckpt_lesson.course.exercises import atomic, batch_position, rng_capture, round_trip\n"
        "rng_capture.check(capture_rng_state, restore_rng_state)\natomic.check(atomic_save)\n"
        "round_trip.check(save_checkpoint, load_checkpoint)\nbatch_position.check(next_batch_ids)\n"
        "from ckpt_lesson.course.capstone import run_capstone\nrun = run_capstone('capstone')\n"
        "print(run['lines'], run['resumed'] == run['baseline'], run['same_weights'])\n"
    )
    (tmp_path / "solve.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "solve.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    expected = [
        "using your next_batch_ids from 05",
        "using your save_checkpoint, load_checkpoint from 03",
        "resumed from step 12: epoch 0, batch 12",
    ]
    assert done.stdout.strip().splitlines()[-1] == f"{expected!r} True True"
