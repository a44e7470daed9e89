"""The repeatability check: a trial that differs is judged only against a baseline that repeats."""

from __future__ import annotations

import json

from ckpt_lesson.cli import main
from ckpt_lesson.resume_test.repeat import suggest_tolerance
from ckpt_lesson.resume_test.steps import StepRecord


def _run(tmp_path, capsys, *args):
    code = main(["resume-test", "--workdir", str(tmp_path / "w"), "--trials", "1", "--kills", "1",
                 "--kill-at", "after-save", *args])  # fmt: skip
    out = capsys.readouterr().out
    return code, json.loads((tmp_path / "w" / "report.json").read_text()), out


def test_a_script_with_late_noise_is_inconclusive_naming_the_step_the_size_and_a_tolerance(
    tmp_path, capsys, fake_command
):
    # Noise from step 9 on, after the save at step 8 that the kill aims at: the resumed steps differ.
    code, report, out = _run(tmp_path, capsys, "--", *fake_command("--noise-after", "8", "--sleep", "0.1"))
    repeat = report["repeatability"]
    assert code == 3 and report["verdict"] == "INCONCLUSIVE", out
    assert repeat["checked"] and not repeat["repeats"] and repeat["first_difference"]["step"] == 9
    assert 0 < repeat["max_abs"] < 1e-6 and repeat["atol"] >= 2 * repeat["max_abs"]
    assert "the run is not reproducible: two uninterrupted runs differ from step 9 on" in out
    assert f"pass --atol {repeat['atol']:g} or --rtol {repeat['rtol']:g} next time" in out
    assert "thread counts" in out and "torch.compile" in out and "unseeded sources" in out
    assert "FAIL" not in out.splitlines()[0]


def test_the_check_can_be_skipped_and_then_the_noise_is_a_fail(tmp_path, capsys, fake_command):
    args = ["--no-repeat-check", "--", *fake_command("--noise-after", "8", "--sleep", "0.1")]
    code, report, out = _run(tmp_path, capsys, *args)
    assert code == 1 and report["verdict"] == "FAIL", out
    assert report["repeatability"] == {"checked": False, "why": "--no-repeat-check"}
    assert report["settings"]["repeat_check"] is False and not (tmp_path / "w" / "control").exists()


def test_a_real_resume_bug_still_fails_after_a_control_run_that_repeats(tmp_path, capsys, fake_command):
    code, report, out = _run(tmp_path, capsys, "--", *fake_command("--mistake", "reseed", "--sleep", "0.1"))
    assert code == 1 and report["verdict"] == "FAIL", out
    assert report["repeatability"]["checked"] and report["repeatability"]["repeats"]
    assert "repeatable   a second uninterrupted run matched the baseline" in out


def test_a_passing_script_pays_for_no_control_run(tmp_path, capsys, fake_command):
    code, report, out = _run(tmp_path, capsys, "--", *fake_command("--sleep", "0.1"))
    assert code == 0 and report["repeatability"] == {"checked": False, "why": "no trial differed"}, out


def test_suggested_tolerances_are_twice_the_largest_difference_rounded_up():
    base = {1: StepRecord(1, 1.0), 2: StepRecord(2, 2.0)}
    other = {1: StepRecord(1, 1.0), 2: StepRecord(2, 2.0 + 3.2e-8)}
    sizes = suggest_tolerance(base, other)
    assert sizes["max_abs"] == (2.0 + 3.2e-8) - 2.0 and sizes["atol"] == 7e-8
    assert abs(sizes["max_rel"] - 1.6e-8) < 1e-15 and sizes["rtol"] == 4e-8
