"""The examples prove the tool: the correct script passes, each classic mistake fails with its diagnosis.

These start real PyTorch processes (about 3 s each, mostly importing torch), so every case uses
the fewest kills that expose its mistake (a kill right after a save is published resumes from
exactly that save, and the next few steps show what the restore missed), and the cases run two
at a time, in threads of this process, before the first test looks at its report.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ckpt_lesson.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "resume_train.py"
ONE_KILL = ("--trials", "1", "--kills", "1")
AFTER_SAVE = (*ONE_KILL, "--kill-at", "after-save", "--seed", "0")
#: case -> (resume-test options, the example's arguments). Seed 0 aims the after-save kill at the
#: save of step 30: mid-epoch (16 batches per epoch) and mid accumulation window (30 % 4 == 2).
CASES = {
    "good": (("--trials", "1", "--kills", "3", "--kill-at", "after-save,mid-save,random"), ()),
    # A preemption notice right after a save, with 4 micro-batches per update: saves wait for the
    # end of the window (steps 12, 24, 36), and the notice makes it save and exit 75. Seed 2 aims at
    # the save of step 12: one aimed at step 36 raced the run's last 4 steps (about 0.1 s), and in
    # one CI run the script finished before the notice came (no kill, INCONCLUSIVE).
    "term": (
        (*ONE_KILL, "--kill-at", "after-save", "--seed", "2", "--signal", "TERM", "--grace", "30"),
        ("--accumulate", "4"),
    ),  # fmt: skip
    "rng": (AFTER_SAVE, ("--mistake", "rng")),
    "fresh-optimizer": (AFTER_SAVE, ("--mistake", "fresh-optimizer")),
    "epoch-restart": (AFTER_SAVE, ("--mistake", "epoch-restart")),
    "accumulation-window": (AFTER_SAVE, ("--mistake", "accumulation-window")),
    # Up to three kills aimed at saves in progress: one that lands inside torch.save leaves a
    # truncated file, and every restart then dies loading it.
    "torch-save": (("--trials", "1", "--kills", "3", "--kill-at", "mid-save"), ("--mistake", "torch-save")),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")

    def one(case: str) -> tuple[int, dict, Path]:
        options, script_args = CASES[case]
        command = [sys.executable, str(EXAMPLE), *script_args]
        workdir = root / case
        code = main(["resume-test", "--workdir", str(workdir), *options, "--", *command])
        # Every verdict (PASS 0, FAIL 1, INCONCLUSIVE 3) writes a report; a usage error (2) does not.
        report_file = workdir / "report.json"
        report = json.loads(report_file.read_text()) if report_file.exists() else {}
        return code, report, workdir

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {case: pool.submit(one, case) for case in CASES}
    return {case: future.result() for case, future in futures.items()}


def test_the_correct_example_passes_kills_after_during_and_between_saves(reports):
    code, report, _ = reports["good"]
    assert code == 0, report.get("diagnosis")
    assert report["baseline"]["save_steps"] == [10, 20, 30, 40] and report["baseline"]["layout"] == "manager"
    assert sorted(k["kind"] for k in report["trials"][0]["kills"]) == ["after-save", "mid-save", "random"]
    assert report["restarts"] == 3
    # The evidence record: the environment of the command's interpreter, and the save each resumed from.
    evidence = report["evidence"]
    assert evidence["environment"]["torch"] == torch.__version__ and evidence["code"]["kind"] in (
        "git",
        "script",
    )
    ids = [r["save_id"] for r in evidence["resumed_from"] if r["save_id"]]
    assert ids and all(len(i) == 32 for i in ids), evidence["resumed_from"]


def test_the_correct_example_saves_on_update_boundaries_and_exits_75_on_a_preemption_notice(reports):
    code, report, _ = reports["term"]
    assert code == 0, (report.get("inconclusive"), report.get("diagnosis"))
    (kill,) = report["trials"][0]["kills"]
    assert kill["point"] == "right after step-00000012 was published"
    assert report["baseline"]["save_steps"] == [12, 24, 36]
    assert (kill["signal"], kill["exit_code"], kill["forced"]) == ("TERM", 75, False)
    assert report["steps_redone"] == [0]  # it saved on the way out: nothing to redo


@pytest.mark.parametrize(
    "case, diagnosis",
    [
        ("rng", "diverges at the first step after resume, on the same samples: RNG state not restored"),
        ("fresh-optimizer", "optimizer (or LR scheduler) state not restored, e.g. a fresh optimizer"),
        ("epoch-restart", "sample ids repeat from the epoch start (step 17) at the first step after resume"),
        ("accumulation-window", "a save inside a gradient-accumulation window"),
    ],
)
def test_each_restore_mistake_fails_with_its_diagnosis(reports, case, diagnosis):
    code, report, workdir = reports[case]
    assert report["trials"][0]["kills"][0]["point"] == "right after step-00000030 was published"
    assert code == 1 and report["verdict"] == "FAIL"
    assert diagnosis in report["diagnosis"]
    assert report["first_difference"]["step"] in (31, 32, 33)
    assert (workdir / "report.png").exists()


def test_torch_save_over_the_last_checkpoint_fails_when_a_kill_lands_mid_save(reports):
    code, report, _ = reports["torch-save"]
    assert code == 1, report
    assert report["baseline"]["layout"] == "files" and report["trials"][0]["status"] == "crashed"
    assert "the save is not atomic" in report["diagnosis"]
    assert any(d["name"] == "checkpoint.pt" for d in report["damaged_saves"])
