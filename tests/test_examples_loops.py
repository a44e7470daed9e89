"""The example loops (GPT, LSTM, GAN, AMP, DDP, epochs) resume bit for bit; each mistaken variant FAILs.

Each case is a real ``resume-test`` run of a real training script (fresh interpreters, torch
imported each time; the DDP loop under torchrun with 2 gloo ranks), so every case uses the fewest
kills that prove its point: a correct loop is killed right after a save is published and in the
middle of one, a mistaken one right after a save (the next few steps show what the restore
missed). The cases run two at a time, in threads of this process, before the first test looks.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckpt_lesson.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PY = (sys.executable,)
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
TWO_KILLS = ("--trials", "1", "--kills", "2", "--kill-at", "after-save,mid-save")
AFTER_SAVE = ("--trials", "1", "--kills", "1", "--kill-at", "after-save")
SHORT = ("--steps", "20")  # saves at steps 10 and 20: one to resume from, the after-save kill aims at it
#: case -> (launcher, example, resume-test options, the example's arguments). The correct loops run
#: their default 30 steps (saves at 10, 20, 30): a save for each of the two kills to aim at.
CASES = {
    "gpt": (PY, "loop_gpt.py", TWO_KILLS, ()),
    "lstm": (PY, "loop_lstm.py", TWO_KILLS, ()),
    "gan": (PY, "loop_gan.py", TWO_KILLS, ()),
    "amp": (PY, "loop_amp.py", TWO_KILLS, ()),
    "ddp": (TORCHRUN, "loop_ddp.py", TWO_KILLS, ()),  # DistributedCheckpointManager; saves at 5, 10, 15
    "epochs": (PY, "loop_epochs.py", TWO_KILLS, ()),  # 16 batches an epoch, saves every 5: mid-epoch
    "gpt-rng-after-prefetch": (PY, "loop_gpt.py", AFTER_SAVE, (*SHORT, "--mistake", "rng-after-prefetch")),
    "lstm-hidden": (PY, "loop_lstm.py", AFTER_SAVE, (*SHORT, "--mistake", "hidden")),
    "gan-one-optimizer": (PY, "loop_gan.py", AFTER_SAVE, (*SHORT, "--mistake", "one-optimizer")),
    "amp-scaler": (PY, "loop_amp.py", AFTER_SAVE, (*SHORT, "--mistake", "scaler")),
    "ddp-optimizer": (TORCHRUN, "loop_ddp.py", AFTER_SAVE, ("--mistake", "optimizer")),
    "epochs-loader": (PY, "loop_epochs.py", AFTER_SAVE, ("--mistake", "loader")),
}  # fmt: skip


@pytest.fixture(scope="module")
def reports(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("loops")
    # Only the cases this session selected: `-k epochs` runs its resume-tests, not all of them.
    chosen = {i.callspec.params.get("case") for i in request.session.items if hasattr(i, "callspec")}

    def one(case: str) -> tuple[int, dict]:
        launcher, script, options, script_args = CASES[case]
        workdir = root / case
        command = [*launcher, str(EXAMPLES / script), *script_args]
        code = main(["resume-test", "--workdir", str(workdir), *options, "--", *command])
        report = json.loads((workdir / "report.json").read_text()) if code in (0, 1) else {}
        return code, report

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {case: pool.submit(one, case) for case in CASES if case in chosen}
    return {case: future.result() for case, future in futures.items()}


@pytest.mark.parametrize("case", ["gpt", "lstm", "gan", "amp", "ddp", "epochs"])
def test_each_example_loop_resumes_bit_for_bit_after_every_kill(reports, case):
    code, report = reports[case]
    assert code == 0, report.get("diagnosis")
    assert report["verdict"] == "PASS" and report["baseline"]["layout"] == "manager"
    assert report["settings"]["atol"] == 0.0 and report["settings"]["rtol"] == 0.0  # exact, not close
    trial = report["trials"][0]
    options = CASES[case][2]
    assert report["restarts"] == len(trial["kills"]) == int(options[options.index("--kills") + 1])
    # Every restart continued from a save, not from scratch: the comparison covers a real resume.
    assert all(r["resumed_from"] and not r["from_scratch"] for r in trial["restarts"])


@pytest.mark.parametrize(
    "case, diagnosis",
    [
        ("gpt-rng-after-prefetch", "an RNG saved after the next batch was already drawn: capture it before"),
        ("lstm-hidden", "metric 'hidden_in' is back at its first-step value (0) at the first step after"),
        ("gan-one-optimizer", "optimizer (or LR scheduler) state not restored"),
        ("amp-scaler", "metric 'scale' is back at its first-step value (1024) at the first step after"),
        ("ddp-optimizer", "optimizer (or LR scheduler) state not restored"),
        (
            "epochs-loader",
            "a DataLoader(shuffle=True) whose iterator is created after the restore",
        ),
    ],
)
def test_each_loop_that_leaves_a_part_out_fails_with_a_diagnosis_naming_it(reports, case, diagnosis):
    code, report = reports[case]
    assert code == 1 and report["verdict"] == "FAIL", report
    assert diagnosis in report["diagnosis"]
    assert report["trials"][0]["kills"][0]["kind"] == "after-save"


def test_the_epoch_loop_is_killed_and_resumed_in_the_middle_of_its_epochs(reports):
    # 500 samples in batches of 32: 16 steps an epoch; a resume from an epoch boundary proves less.
    code, report = reports["epochs"]
    assert code == 0
    resumed = [r["resumed_from"] for r in report["trials"][0]["restarts"]]
    assert resumed and all(step % 16 != 0 for step in resumed), resumed
