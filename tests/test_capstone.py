"""Notebook 05's capstone: a run SIGKILLed after a save and resumed in a fresh process."""

from __future__ import annotations

from ckpt_lesson.course import capstone


def test_a_run_killed_after_step_12s_save_resumes_in_a_fresh_process_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ckpt_work/yours here: the package's functions run
    run = capstone.run_capstone(tmp_path / "capstone")
    assert run["lines"][-1] == "resumed from step 12: epoch 0, batch 12"
    assert len(run["resumed"]) == len(run["baseline"]) == capstone.TOTAL
    assert run["resumed"] == run["baseline"]  # exact: the same arithmetic, not close
    assert run["same_weights"] is True
