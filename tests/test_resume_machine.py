"""``resume-test --lose-machine``: a restart on a fresh machine keeps only what lived off the machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ckpt_lesson import cli
from ckpt_lesson.resume_test.machine import FAILURE_DOMAIN, judge_lost_machine, machine_for
from ckpt_lesson.resume_test.runner import RunSpec

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "resume_train.py")
TRAIN = [sys.executable, EXAMPLE, "--steps", "20", "--ckpt-dir"]


def _resume_test(tmp_path, capsys, ckpt_dir, *options):
    workdir = str(tmp_path / "w")
    argv = ["resume-test", "--lose-machine", "--trials", "1", "--kills", "1", "--workdir", workdir,
            *options, "--", *TRAIN, ckpt_dir]  # fmt: skip
    code = cli.main(argv)
    report = json.loads((tmp_path / "w" / "report.json").read_text())
    return code, report, capsys.readouterr().out


def test_a_local_checkpoint_folder_fails_with_the_failure_domain_explanation(tmp_path, capsys):
    code, report, out = _resume_test(tmp_path, capsys, "{ckpt_dir}", "--kill-at", "after-save")
    assert code == 1 and report["verdict"] == "FAIL"
    section = report["failure_domain"]
    assert section["store"] is None and section["tested"] == FAILURE_DOMAIN
    assert section["kills"][0]["lost_saves"] and section["kills"][0]["restart_first_step"] == 1
    assert "the checkpoints lived on the machine that was lost" in out
    assert "failure domain tested: the machine" in out


def test_the_same_run_pointed_at_a_bucket_passes_after_losing_the_machine(
    tmp_path, capsys, s3_bucket, monkeypatch
):
    for name, value in s3_bucket.env().items():
        monkeypatch.setenv(name, value)
    url = f"s3://{s3_bucket.name}/{{run_id}}"
    code, report, out = _resume_test(tmp_path, capsys, url, "--kill-at", "random", "--seed", "0")
    section = report["failure_domain"]
    assert section["store"] == f"s3://{s3_bucket.name}/trial-01"
    assert [k["status"] for k in section["kills"]] == ["ok"], section
    assert code == 0 and report["verdict"] == "PASS", out
    assert f"every restart on a fresh machine resumed from s3://{s3_bucket.name}/trial-01" in out


def test_a_restart_gets_a_fresh_cwd_home_and_tmpdir_and_absolute_paths_to_its_code(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    spec = RunSpec(("python", "train.py", "{run_id}"), tmp_path, {"HOME": "/home/me"}, lose_machine=True)
    first = machine_for(spec, tmp_path / "trial-01" / "attempt-1", tmp_path / "trial-01" / "ckpt", 1)
    assert first.cwd == tmp_path and first.command == ("python", "train.py", "trial-01")
    again = machine_for(spec, tmp_path / "trial-01" / "attempt-2", tmp_path / "trial-01" / "ckpt", 2)
    assert again.cwd == tmp_path / "trial-01" / "attempt-2" / "machine" / "cwd" and again.cwd.is_dir()
    assert again.command == ("python", str(script.resolve()), "trial-01")
    assert again.env["HOME"] != "/home/me" and Path(again.env["TMPDIR"]).is_dir()


def test_no_kill_after_a_save_is_reported_as_untested():
    assert judge_lost_machine([], base_first=1)["verdict"] == "UNTESTED"
