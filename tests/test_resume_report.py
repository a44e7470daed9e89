"""The report: JSON with every number, a short text, a plot only when the runs differ."""

from __future__ import annotations

import json
from pathlib import Path

from ckpt_lesson.resume_test.compare import trajectory
from ckpt_lesson.resume_test.diagnose import judge_trial
from ckpt_lesson.resume_test.plan import TrialPlan
from ckpt_lesson.resume_test.report import build_report, format_text, write_json, write_plot
from ckpt_lesson.resume_test.runner import Attempt, Kill, TrialRun
from ckpt_lesson.resume_test.steps import StepRecord
from ckpt_lesson.resume_test.watch import MANAGER


def run(index, steps, losses=None, started=0.0):
    losses = losses or {}
    recs = [StepRecord(s, losses.get(s, 1.0 / s), None, {}, started + s) for s in steps]
    return Attempt(index, Path("."), started, ended=started + 20, exit_code=0, records=recs)


def make(losses=None, signal="KILL"):
    baseline = run(1, range(1, 11))
    first = run(1, range(1, 6))
    staging = {"name": ".staging-step-00000005-1-a", "step": 5, "status": "incomplete", "reason": "staging"}
    code = 75 if signal == "TERM" else -9
    first.kill = Kill("mid-save", 5, "during the save of step 5 (staging folder present)", True, 5, signal,
                      held_save=True, exit_code=code, damaged=[staging])  # fmt: skip
    t = TrialRun(
        TrialPlan(1, "mid-save", "mid-save"), Path("t1"), [first, run(2, range(5, 11), losses, 100.0)]
    )
    base = trajectory(baseline.records)
    verdict = judge_trial(t, base, atol=0, rtol=0, layout=MANAGER, exact=[], timeout=60)
    report = build_report(command=["python", "train.py"], workdir=Path("w"), settings={"signal": signal},
                          baseline=baseline, layout=MANAGER, trials=[t], verdicts=[verdict],
                          notes=[])  # fmt: skip
    return baseline, t, verdict, report


def test_a_passing_report_has_the_numbers_and_no_diagnosis():
    _, _, _, report = make()
    assert report["verdict"] == "PASS" and report["diagnosis"] is None and report["first_difference"] is None
    assert report["baseline"]["steps"] == 10 and report["restarts"] == 1
    assert report["steps_redone"] == [1] and report["recovery_seconds"] == [6.0]
    assert report["damaged_saves"][0]["name"] == ".staging-step-00000005-1-a"
    text = format_text(report)
    assert text.startswith("resume-test: PASS") and "diagnosis" not in text
    assert "steps redone per restart: 1" in text and "trial 1: .staging-step-00000005-1-a incomplete" in text


def test_a_failing_report_names_the_step_both_values_the_trial_and_the_kill():
    _, _, _, report = make({6: 0.5})
    first = report["first_difference"]
    assert report["verdict"] == "FAIL" and report["failed_trial"] == 1
    assert (first["step"], first["baseline"], first["resumed"]) == (6, 1 / 6, 0.5)
    text = format_text(report)
    assert (
        f"first difference  step 6, loss: baseline {1 / 6!r} vs resumed 0.5 (trial 1, after the kill " in text
    )
    assert text.splitlines()[-2].startswith("diagnosis    the first step after resume matches, the second")


def test_a_term_kill_shows_how_the_process_ended():
    _, _, _, report = make(signal="TERM")
    assert "(TERM: exit 75)" in format_text(report)


def test_the_report_is_valid_json_on_disk(tmp_path):
    _, _, _, report = make({6: float("nan")})
    write_json(report, tmp_path / "report.json")
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == "FAIL"


def test_a_plot_is_written_only_when_the_runs_differ(tmp_path):
    baseline, t, verdict, _ = make()
    assert write_plot(tmp_path / "same.png", baseline, [t], [verdict]) is None
    assert not (tmp_path / "same.png").exists()
    baseline, t, verdict, _ = make({6: 0.5})
    path = write_plot(tmp_path / "differ.png", baseline, [t], [verdict])
    assert path == str(tmp_path / "differ.png")
    assert (tmp_path / "differ.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_staging_folder_still_there_at_a_second_kill_is_listed_once():
    baseline = run(1, range(1, 11))
    staging = {"name": ".staging-step-00000005-1-a", "step": 5, "status": "incomplete", "reason": "staging"}
    first, second = run(1, range(1, 6)), run(2, range(5, 8), started=50.0)
    for attempt, step in ((first, 5), (second, 7)):
        attempt.kill = Kill("mid-save", step, f"during the save of step {step}", True, step, "KILL",
                            held_save=True, exit_code=-9, damaged=[staging])  # fmt: skip
    t = TrialRun(TrialPlan(1, "mid-save", "mid-save"), Path("t1"), [first, second, run(3, range(7, 11))])
    verdict = judge_trial(
        t, trajectory(baseline.records), atol=0, rtol=0, layout=MANAGER, exact=[], timeout=60
    )
    report = build_report(command=["python", "train.py"], workdir=Path("w"), settings={"signal": "KILL"},
                          baseline=baseline, layout=MANAGER, trials=[t], verdicts=[verdict],
                          notes=[])  # fmt: skip
    assert [d["name"] for d in report["damaged_saves"]] == [".staging-step-00000005-1-a"]


def test_none_found_is_qualified_when_a_restart_crashed_on_a_save_the_tool_cannot_judge():
    _, _, _, report = make()
    report["damaged_saves"], report["trials"][0]["status"] = [], "crashed"
    line = next(ln for ln in format_text(report).splitlines() if ln.startswith("damaged or incomplete"))
    assert line.startswith("damaged or incomplete saves after kills: none found by the tool, but the restart")
    assert "trial(s) [1] crashed" in line
