"""``resume-test`` end to end on the torch-free fake trainer: verdicts, exit codes, usage errors."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest

from ckpt_lesson.cli import main


def cli(capsys, *args):
    code = main(["resume-test", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_help_documents_every_option_the_environment_and_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as info:
        main(["resume-test", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--workdir", "--trials", "--kills", "--kill-at", "--signal", "--grace", "--seed",
                 "--timeout", "--atol", "--rtol", "--step-pattern", "--json"):  # fmt: skip
        assert flag in out
    for text in ("CKPT_LESSON_CKPT_DIR", "CKPT_LESSON_STEP_LOG", "{ckpt_dir}", "log_step", "after-save",
                 "mid-save", "random", "INCONCLUSIVE",
                 "exit status: 0 PASS, 1 FAIL, 2 usage error, 3 INCONCLUSIVE"):  # fmt: skip
        assert text in out


def test_a_resuming_script_passes_with_exit_0_and_a_json_report(tmp_path, capsys, fake_command):
    code, out, err = cli(capsys, "--workdir", str(tmp_path / "w"), "--trials", "2", "--kills", "1",
                         "--kill-at", "after-save,mid-save",
                         "--", *fake_command("--sleep", "0.02"))  # fmt: skip
    assert (code, err) == (0, "")
    assert out.startswith("resume-test: PASS  (2 trial(s), 2 restart(s), SIGKILL)")
    report = json.loads((tmp_path / "w" / "report.json").read_text())
    assert report["verdict"] == "PASS" and report["baseline"]["save_steps"] == [4, 8, 12]
    assert [t["kills"][0]["kind"] for t in report["trials"]] == ["after-save", "mid-save"]
    assert not (tmp_path / "w" / "report.png").exists()


def test_a_script_that_reseeds_on_resume_fails_with_exit_1_a_diagnosis_and_a_plot(
    tmp_path, capsys, fake_command
):
    code, out, _ = cli(capsys, "--workdir", str(tmp_path), "--trials", "1", "--kills", "1", "--kill-at",
                       "after-save", "--", *fake_command("--mistake", "reseed", "--ids"))  # fmt: skip
    assert code == 1 and out.startswith("resume-test: FAIL")
    assert "diverges at the first step after resume, on the same samples: RNG state not restored" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["first_difference"]["trial"] == 1 and report["plot"] == str(tmp_path / "report.png")
    assert (tmp_path / "report.png").exists()


def test_a_script_that_saves_nowhere_it_was_told_is_inconclusive_with_a_hint(tmp_path, capsys, fake_command):
    code, out, _ = cli(capsys, "--workdir", str(tmp_path), "--trials", "1", "--kills", "1",
                       "--", *fake_command("--layout", "none", "--sleep", "0.02"))  # fmt: skip
    assert code == 3 and out.startswith("resume-test: INCONCLUSIVE")
    assert "inconclusive no save at all: the baseline wrote nothing into its checkpoint folder" in out


def test_steps_can_come_from_stdout_with_a_pattern_and_json_goes_to_stdout(tmp_path, capsys, fake_command):
    code, out, _ = cli(capsys, "--workdir", str(tmp_path), "--trials", "1", "--kills", "1", "--json",
                       "--step-pattern", r"step (?P<step>\d+) loss (?P<loss>\S+)",
                       "--", *fake_command("--print"))  # fmt: skip
    report = json.loads(out)
    assert code == 0 and report["verdict"] == "PASS" and report["baseline"]["steps"] == 12


def test_without_workdir_a_temporary_folder_is_made_and_kept(tmp_path, capsys, monkeypatch, fake_command):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code, out, _ = cli(capsys, "--trials", "1", "--kills", "1", "--", *fake_command())
    (made,) = tmp_path.iterdir()
    assert code == 0 and made.name.startswith("resume-test-") and (made / "report.json").exists()
    assert f"report       {made}/report.json" in out


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "no command given: put it after --"),
        (["--", "no-such-command-xyz"], "command not found: 'no-such-command-xyz' is not on PATH"),
        (["--", "/no/such/dir/train.py"], "command not found: '/no/such/dir/train.py' does not exist"),
        (["--trials", "0", "--", "true"], "--trials must be >= 1"),
        (["--timeout", "0", "--", "true"], "--timeout must be a number of seconds > 0"),
        (["--atol", "-1", "--", "true"], "--atol must be a number >= 0"),
        (["--kill-at", "sometimes", "--", "true"], "--kill-at 'sometimes': choose from"),
        (["--step-pattern", "step (\\d+)", "--", "true"], "--step-pattern 'step (\\\\d+)' needs groups"),
    ],
)
def test_bad_options_are_one_line_errors_with_exit_2(tmp_path, capsys, args, message):
    code, out, err = cli(capsys, "--workdir", str(tmp_path), *args)
    assert code == 2 and out == ""
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_a_command_that_fails_on_its_own_is_a_usage_error(tmp_path, capsys, fake_command):
    code, _, err = cli(capsys, "--workdir", str(tmp_path), "--", *fake_command("--fail", "3"))
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: the baseline run (no kills) exited with code 3;")


def test_a_command_that_logs_no_steps_is_a_usage_error(tmp_path, capsys):
    code, _, err = cli(capsys, "--workdir", str(tmp_path), "--", sys.executable, "-c", "pass")
    assert code == 2 and err.count("\n") == 1
    assert "the baseline run logged no steps: call ckpt_lesson.log_step(step, loss)" in err


def test_a_pattern_that_matches_nothing_says_so(tmp_path, capsys, fake_command):
    code, _, err = cli(capsys, "--workdir", str(tmp_path), "--step-pattern", r"it (\d+): (\S+)",
                       "--", *fake_command("--print"))  # fmt: skip
    assert code == 2 and "no line of its stdout matched --step-pattern" in err


def test_a_workdir_that_cannot_be_written_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    code, _, err = cli(capsys, "--workdir", str(tmp_path / "file" / "sub"), "--", "true")
    assert code == 2 and "not writable" in err and err.count("\n") == 1
    code, _, err = cli(capsys, "--workdir", str(tmp_path / "file"), "--", "true")
    assert code == 2 and "is a file" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_a_read_only_workdir_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "ro").mkdir(mode=0o500)
    code, _, err = cli(capsys, "--workdir", str(tmp_path / "ro"), "--", "true")
    assert code == 2 and "not writable" in err


def test_a_workdir_already_used_is_refused_so_checkpoint_folders_start_empty(tmp_path, capsys):
    (tmp_path / "baseline").mkdir()
    code, _, err = cli(capsys, "--workdir", str(tmp_path), "--", "true")
    assert code == 2 and "already holds a resume-test run" in err


def test_a_save_written_in_place_fails_when_a_kill_lands_inside_it(tmp_path, capsys, fake_command):
    code, out, _ = cli(capsys, "--workdir", str(tmp_path), "--trials", "1", "--kills", "1", "--kill-at",
                       "mid-save", "--", *fake_command("--mistake", "in-place"))  # fmt: skip
    assert code == 1 and "crashed" in out and "the save is not atomic" in out
    assert "damaged or incomplete saves after kills: 1: trial 1: state.json possibly incomplete" in out


NEVER_LOADS = """
import torch
from ckpt_lesson import CheckpointManager, TrainState, log_step
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
manager = CheckpointManager(__import__("os").environ["CKPT_LESSON_CKPT_DIR"], every_steps=5)
state = TrainState()  # never restore_latest: every restart begins again at step 1
x = torch.randn(8, 4)
for step in range(1, 21):
    loss = model(x).pow(2).mean()
    optimizer.zero_grad(); loss.backward(); optimizer.step()
    state.step = step
    log_step(step, loss.item())
    if step % 5 == 0:
        manager.save(model, optimizer, None, state)
"""


def test_a_script_that_never_loads_is_told_it_began_again_at_step_1_not_only_that_the_save_exists(
    tmp_path, capsys
):
    script = tmp_path / "never_loads.py"
    script.write_text(NEVER_LOADS)
    code, out, _ = cli(capsys, "--workdir", str(tmp_path / "w"), "--trials", "1", "--kills", "1",
                       "--kill-at", "after-save", "--json", "--", sys.executable, str(script))  # fmt: skip
    report = json.loads(out)
    assert code == 1 and report["verdict"] == "FAIL"
    diagnosis = report["trials"][0]["diagnosis"]
    assert diagnosis.startswith("the restart began again at step 1; it did not restore a save"), diagnosis
    # The crash it led to, the manager's refusal to overwrite step 5, is quoted as the consequence.
    assert "; it then crashed (exit 1: " in diagnosis and "step 5 is already saved" in diagnosis


def test_kills_beyond_the_saves_to_aim_at_are_noted_as_left_out_not_as_random_kills(
    tmp_path, capsys, fake_command
):
    code, out, _ = cli(capsys, "--workdir", str(tmp_path / "w"), "--trials", "1", "--kills", "3",
                       "--kill-at", "after-save", "--", *fake_command("--sleep", "0.1"))  # fmt: skip
    report = json.loads((tmp_path / "w" / "report.json").read_text())
    assert code == 0, out  # saves at steps 4 and 8 before the last: two kills, both after a save
    assert len(report["trials"][0]["kills"]) == 2
    assert any("the extra kills were left out" in n for n in report["notes"]), report["notes"]
    assert not any("killed at random instead" in n for n in report["notes"])
