"""resume-test drives scripts that use the Lightning plugin and the Hugging Face callback.

Each case is a real resume-test run: a baseline, one kill, one restart (three processes, each
paying about 6-7 s to import Lightning or transformers). The four cases run two at a time, in
threads of this process, before the first test looks at its report.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="lightning is not installed: pip install -r requirements.txt")
pytest.importorskip("transformers", reason="transformers is not installed: pip install -r requirements.txt")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate: pip install -r requirements.txt")

from ckpt_lesson.cli import main  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ONE_KILL = ("--trials", "1", "--kills", "1")
#: case -> (script, resume-test options, the script's arguments). A kill during a save leaves a
#: temp file (Lightning) or a folder without manifest (HF) that the restart must pass over; the
#: seeds aim it at Lightning's step-12 save (resume from the end of epoch 0) and at HF's step-8
#: save (resume from step 4, mid-epoch: the Trainer skips the batches already trained on).
CASES = {
    "lightning": ("resume_lightning.py", (*ONE_KILL, "--kill-at", "mid-save", "--seed", "0"), ()),
    "hf": ("resume_hf.py", (*ONE_KILL, "--kill-at", "mid-save", "--seed", "4"), ()),
    "lightning-no-resume": (
        "resume_lightning.py",
        (*ONE_KILL, "--kill-at", "after-save"),
        ("--mistake", "no-resume"),
    ),
    "hf-no-resume": ("resume_hf.py", (*ONE_KILL, "--kill-at", "after-save"), ("--mistake", "no-resume")),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrations")

    def one(case: str) -> tuple[int, dict]:
        script, options, script_args = CASES[case]
        workdir = root / case
        command = [sys.executable, str(EXAMPLES / script), *script_args]
        code = main(["resume-test", "--workdir", str(workdir), *options, "--", *command])
        report = json.loads((workdir / "report.json").read_text()) if code in (0, 1) else {}
        return code, report

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {case: pool.submit(one, case) for case in CASES}
    return {case: future.result() for case, future in futures.items()}


@pytest.mark.parametrize("case, saves", [("lightning", [6, 12, 18]), ("hf", [4, 8, 12, 16, 18])])
def test_a_script_using_the_integration_resumes_bit_for_bit_after_a_kill_during_a_save(reports, case, saves):
    code, report = reports[case]
    assert code == 0, report.get("diagnosis")
    assert report["settings"]["atol"] == 0 and report["settings"]["rtol"] == 0  # exact, not close
    assert report["baseline"]["save_steps"] == saves and report["baseline"]["steps"] == 18
    (kill,) = report["trials"][0]["kills"]
    assert kill["kind"] == "mid-save" and report["restarts"] == 1


@pytest.mark.parametrize(
    "case, handover", [("lightning-no-resume", "ckpt_path"), ("hf-no-resume", "resume_from_checkpoint")]
)
def test_a_script_that_never_hands_the_checkpoint_to_the_trainer_fails_with_that_diagnosis(
    reports, case, handover
):
    code, report = reports[case]
    assert code == 1 and report["verdict"] == "FAIL"
    assert "it did not restore a save" in report["diagnosis"]
    assert handover in report["diagnosis"]
