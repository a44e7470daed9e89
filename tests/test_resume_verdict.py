"""PASS, INCONCLUSIVE or FAIL end to end on the torch-free fake trainer, and the diagnoses it leads to.

Each case is one ``resume-test`` run with a single kill right after a save (the fewest that can
show the point); they run three at a time in threads of this process before the tests read
their reports, so the file costs about as much as its slowest case.
"""

from __future__ import annotations

import io
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from ckpt_lesson.cli import main
from ckpt_lesson.resume_test.diagnose import TrialVerdict
from ckpt_lesson.resume_test.plan import KillTarget, TrialPlan
from ckpt_lesson.resume_test.runner import Attempt, TrialRun
from ckpt_lesson.resume_test.steps import StepRecord
from ckpt_lesson.resume_test.verdict import decide

FAKE = str(Path(__file__).resolve().parent / "fake_train.py")
AFTER_SAVE = ("--trials", "1", "--kills", "1", "--kill-at", "after-save")
CASES = {
    # The word-language-model trap: never loads, and its step counter is the batch index.
    "per-epoch-steps": (AFTER_SAVE, ("--mistake", "no-load", "--epoch-steps", "5")),
    "save-only-at-end": (AFTER_SAVE, ("--save-every", "12")),
    # 0.1 s steps: the kill after the save of step 8 must come before the last 4 steps are done
    # (at 5 ms a step, a loaded machine let the script finish first: no kill, INCONCLUSIVE).
    "never-loads": (AFTER_SAVE, ("--mistake", "no-load", "--sleep", "0.1")),
    "prefetch": (AFTER_SAVE, ("--mistake", "prefetch", "--ids", "--sleep", "0.1")),
    "hidden-state": (AFTER_SAVE, ("--mistake", "hidden-state", "--ids", "--sleep", "0.1")),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("verdicts")

    def one(case: str) -> tuple[int, str, str, dict]:
        options, script_args = CASES[case]
        workdir = root / case
        out, err = io.StringIO(), io.StringIO()
        # redirect_* are process-wide; the text only matters per case, so each case also reads its
        # own report.json, and the text checks below use the JSON's fields where they can.
        with redirect_stdout(out), redirect_stderr(err):
            code = main(["resume-test", "--workdir", str(workdir), *options, "--", sys.executable, FAKE,
                         *script_args])  # fmt: skip
        report_file = workdir / "report.json"
        report = json.loads(report_file.read_text()) if report_file.exists() else {}
        return code, out.getvalue(), err.getvalue(), report

    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {case: pool.submit(one, case) for case in CASES}
    return {case: future.result() for case, future in futures.items()}


def test_a_per_epoch_step_counter_is_a_usage_error_that_asks_for_a_global_step(results):
    code, _, _, report = results["per-epoch-steps"]
    assert code == 2 and report == {}  # stopped before any trial: never a PASS


def test_a_script_that_saves_only_at_its_end_is_inconclusive_with_exit_3(results):
    code, _, _, report = results["save-only-at-end"]
    assert code == 3 and report["verdict"] == "INCONCLUSIVE"
    assert report["inconclusive"][0].startswith("the baseline saved only at its end (step 12)")
    assert "save more often or run longer" in report["inconclusive"][0]


def test_a_script_that_never_loads_but_has_a_global_step_fails_restarted_from_the_start(results):
    code, _, _, report = results["never-loads"]
    assert code == 1 and report["verdict"] == "FAIL"
    assert report["diagnosis"].startswith("the restart began again at step 1; it did not restore a save")


def test_a_prefetched_draw_is_diagnosed_as_the_rng_consumed_in_another_order(results):
    code, _, _, report = results["prefetch"]
    assert code == 1 and "the RNG was restored but consumed in another order" in report["diagnosis"]
    assert "the random RNG stream after it equals the baseline's one step later" in report["diagnosis"]


def test_a_hidden_state_left_out_of_the_save_is_diagnosed_as_other_state_missing(results):
    code, _, _, report = results["hidden-state"]
    assert code == 1
    assert (
        "on the same samples and the same RNG stream: state other than model/optimizer/RNG is missing"
        in (report["diagnosis"])
    )


def test_the_usage_error_for_steps_that_go_back_names_both_steps_and_the_fix(tmp_path, capsys):
    code = main(["resume-test", "--workdir", str(tmp_path), *AFTER_SAVE, "--", sys.executable, FAKE,
                 "--epoch-steps", "5", "--steps", "6", "--sleep", "0"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "steps do not increase (step 1 came after step 5): report a global step" in err


def test_a_run_that_finishes_before_its_planned_kill_is_inconclusive_and_says_what_to_change(tmp_path):
    # Built by hand: a real script that outruns the kill does so only now and then (that race is
    # why test_resume_examples aims its TERM case at an early save).
    records = [StepRecord(step, 1.0 / step) for step in range(1, 41)]
    baseline = Attempt(1, tmp_path, 0.0, exit_code=0, records=records, save_steps=[12, 24, 36])
    unkilled = Attempt(1, tmp_path, 0.0, exit_code=0, records=list(records), save_steps=[12, 24, 36])
    plan = TrialPlan(1, "after-save", "after-save", [KillTarget("after-save", 36)])
    trial = TrialRun(plan, tmp_path, [unkilled])
    outcome = decide(baseline, [trial], [TrialVerdict(1, "after-save", "finished", True)], "manager")
    assert (outcome.verdict, outcome.exit_code) == ("INCONCLUSIVE", 3)
    (reason,) = outcome.reasons
    assert reason.startswith("no kill happened: the command finished before its planned kill points")
    assert "pass another --seed" in reason
