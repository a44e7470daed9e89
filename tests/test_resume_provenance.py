"""The evidence record ties a resume-test result to the code, the environment and the saves."""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_lesson import cli
from ckpt_lesson.files.storage import open_storage
from ckpt_lesson.resume_test.provenance import code_version, environment, format_evidence
from ckpt_lesson.runs.store_commit import read_commit

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "resume_train.py")


def _git(cwd: Path, *args: str) -> str:
    command = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args]
    return subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_a_git_working_folder_gives_its_commit_and_whether_it_has_uncommitted_changes(tmp_path):
    (tmp_path / "train.py").write_text("print(1)\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "train.py")
    _git(tmp_path, "commit", "-q", "-m", "first")
    head = _git(tmp_path, "rev-parse", "HEAD")
    clean = code_version(["python", "train.py"], tmp_path)
    assert (clean["kind"], clean["commit"], clean["dirty"]) == ("git", head, False)
    assert clean["script"]["sha256"] == hashlib.sha256(b"print(1)\n").hexdigest()
    (tmp_path / "train.py").write_text("print(2)\n")
    assert code_version(["python", "train.py"], tmp_path)["dirty"] is True


def test_outside_a_repository_the_script_is_hashed(tmp_path):
    (tmp_path / "train.py").write_bytes(b"x = 1\n")
    version = code_version(["python", "-u", "train.py", "--lr", "1"], tmp_path)
    assert version == {"kind": "script", "path": str(tmp_path / "train.py"),
                       "sha256": hashlib.sha256(b"x = 1\n").hexdigest()}  # fmt: skip


def test_the_versions_are_those_of_the_interpreter_the_command_names(tmp_path):
    found = environment([sys.executable, "train.py"], {}, tmp_path)
    assert found["source"] == "the command's interpreter"
    assert (found["python"], found["torch"]) == (platform.python_version(), torch.__version__)
    other = environment(["./train.sh"], {}, tmp_path)
    assert other["source"].startswith("the interpreter running resume-test")


def test_the_text_head_shows_code_environment_scenario_and_the_saves_resumed_from():
    record = {
        "code": {"kind": "git", "commit": "a" * 40, "dirty": True, "folder": "/x", "script": None},
        "environment": {"source": "the command's interpreter", "python": "3.11.7", "torch": "2.13.0",
                        "cuda": None},
        "scenario": {"signal": "KILL", "kill_at": ["after-save"], "trials": 1, "kills": 1, "seed": 0,
                     "grace": 10.0, "lose_machine": True},
        "resumed_from": [{"trial": 1, "restart": 2, "first_step": 11, "resumed_from_step": 10,
                          "save": "step-00000010", "save_id": "b" * 32}],
    }  # fmt: skip
    assert format_evidence(json.loads(json.dumps(record))) == [
        "code         git aaaaaaaaaaaa with uncommitted changes",
        "environment  Python 3.11.7, torch 2.13.0, CUDA none",
        "scenario     SIGKILL at after-save; 1 trial(s) x 1 kill(s), seed 0; machine lost at every kill",
        "resumed from trial 1 run 2: step 10 (save id bbbbbbbbbbbb)",
    ]


@pytest.mark.parametrize("lose", [False, True], ids=["same-machine", "lose-machine"])
def test_a_restart_from_a_bucket_records_the_save_id_of_the_commit_it_resumed_from(
    tmp_path, capsys, s3_bucket, monkeypatch, lose
):
    for name, value in s3_bucket.env().items():
        monkeypatch.setenv(name, value)
    argv = ["resume-test", *(["--lose-machine"] if lose else []), "--trials", "1", "--kills", "1",
            "--kill-at", "after-save", "--workdir", str(tmp_path / "w"), "--", sys.executable, EXAMPLE,
            "--steps", "20", f"--ckpt-dir=s3://{s3_bucket.name}/{{run_id}}"]  # fmt: skip
    code = cli.main(argv)
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "w" / "report.json").read_text())
    if lose:  # without --lose-machine the bucket's saves are not watched, so no kill aims at them
        assert code == 0 and report["failure_domain"]["verdict"] == "PASS", out
    (resumed,) = report["evidence"]["resumed_from"]
    step = resumed["resumed_from_step"]
    assert step is not None and resumed["first_step"] == step + 1
    # The save is named by its URL in the trial's own prefix, and its id is the one its COMMIT marker holds.
    prefix, _, name = resumed["save"].rpartition("/")
    assert prefix.startswith(f"s3://{s3_bucket.name}/") and prefix.endswith("-trial-01")
    assert name == f"step-{step:08d}"
    marker, _ = read_commit(open_storage(prefix), step)
    assert resumed["save_id"] == marker["save_id"]
    assert f"step {step} (save id {marker['save_id'][:12]})" in out
