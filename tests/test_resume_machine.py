"""``resume-test --lose-machine``: a restart on a fresh machine keeps only what lived off the machine."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

from ckpt_lesson import cli
from ckpt_lesson.resume_test.image import take_image
from ckpt_lesson.resume_test.machine import (
    FAILURE_DOMAIN,
    format_failure_domain,
    judge_lost_machine,
    machine_for,
    store_urls,
)
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


def _virtualenv(root: Path) -> Path:
    """A real virtualenv whose ``bin/python`` is a symlink to the base interpreter (as venv makes it).

    It sees this interpreter's packages (torch, ckpt_lesson, s3fs) through a ``.pth`` file in its
    own site-packages, and holds one module nothing else has: ``venv_only_train`` (it runs the
    example). So only an interpreter that starts from the venv's own ``bin/python`` can run the
    command, as with a venv whose packages the base interpreter lacks; resolving the symlink loses it.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site_dir = next(root.glob("lib/python*/site-packages"))
    outer = [p for p in [*site.getsitepackages(), site.getusersitepackages()] if os.path.isdir(p)]
    (site_dir / "outer.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in outer))
    (site_dir / "venv_only_train.py").write_text(
        f"import runpy\nrunpy.run_path({EXAMPLE!r}, run_name='__main__')\n"
    )
    python = root / "bin" / "python"
    assert python.is_symlink() and python.resolve() != python
    return python


def test_a_virtualenvs_interpreter_with_ckpt_dir_equals_a_bucket_resumes_on_every_new_machine(
    tmp_path, capsys, s3_bucket, monkeypatch
):
    for name, value in s3_bucket.env().items():
        monkeypatch.setenv(name, value)
    python = _virtualenv(tmp_path / "venv")
    url = f"s3://{s3_bucket.name}/{{run_id}}"
    argv = ["resume-test", "--lose-machine", "--trials", "1", "--kills", "1", "--kill-at", "random",
            "--seed", "0", "--workdir", str(tmp_path / "w"), "--", str(python), "-m", "venv_only_train",
            "--steps", "20", f"--ckpt-dir={url}"]  # fmt: skip
    code = cli.main(argv)
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "w" / "report.json").read_text())
    section = report["failure_domain"]
    # The store is found inside --ckpt-dir=URL, with this invocation's own run id.
    assert section["store"].startswith(f"s3://{s3_bucket.name}/") and section["store"].endswith("-trial-01")
    assert [k["status"] for k in section["kills"]] == ["ok"], out
    assert all(k["restart_first_step"] > 1 for k in section["kills"]), section
    assert code == 0 and report["verdict"] == "PASS", out
    assert "every restart on a fresh machine resumed from s3://" in out


def test_a_restart_gets_a_fresh_copy_of_the_working_folder_and_the_command_as_named(tmp_path):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "input.txt").write_text("x")
    (project / "python").symlink_to(sys.executable)  # a symlinked interpreter, like a venv's
    image = take_image(project, tmp_path / "w" / "machine-image", workdir=tmp_path / "w")
    (project / "data" / "input.txt").write_text("written by the baseline")  # after the image
    command = (str(project / "python"), "train.py", "{run_id}")
    spec = RunSpec(command, project, {"HOME": "/home/me", "OUT": "s3://b/{run_id}"}, lose_machine=True,
                   session_id="s1", image=image, workdir=tmp_path / "w")  # fmt: skip
    w = tmp_path / "w"
    first = machine_for(spec, w / "trial-01" / "attempt-1", w / "trial-01" / "ckpt", 1)
    assert first.cwd == project and first.command == (str(project / "python"), "train.py", "s1-trial-01")
    assert first.env["OUT"] == "s3://b/s1-trial-01" and first.env["HOME"] == "/home/me"
    again = machine_for(spec, w / "trial-01" / "attempt-2", w / "trial-01" / "ckpt", 2)
    assert again.cwd == w / "trial-01" / "attempt-2" / "machine" / "cwd"
    assert (again.cwd / "data" / "input.txt").read_text() == "x"  # as before the baseline
    assert again.command == first.command  # the interpreter as named: never resolved
    assert again.env["HOME"] != "/home/me" and Path(again.env["TMPDIR"]).is_dir()
    assert (project / "data" / "input.txt").read_text() == "written by the baseline"  # untouched


def test_store_urls_are_found_in_whole_arguments_flag_values_and_the_environment():
    command = ("python", "t.py", "s3://b/a", "--out_dir=gs://b/c", "--lr=1e-3", "/local")
    env = {"CKPT_URL": "s3://b/env", "AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "HOME": "/root"}
    assert store_urls(command, env) == ["s3://b/a", "gs://b/c", "s3://b/env"]


def test_run_ids_differ_between_two_invocations_of_the_same_command(tmp_path, capsys, fake_command):
    store = tmp_path / "store"
    firsts = []
    for n in (1, 2):
        argv = ["resume-test", "--trials", "1", "--kills", "1", "--workdir", str(tmp_path / f"w{n}"), "--",
                *fake_command("--layout", "manager", "--ckpt-dir", str(store / "{run_id}"))]  # fmt: skip
        code = cli.main(argv)
        out = capsys.readouterr().out
        assert code == 3, out  # the tool's own folder stayed empty: "no save at all"
        steps = (tmp_path / f"w{n}" / "baseline" / "attempt-1" / "steps.jsonl").read_text().splitlines()
        firsts.append(json.loads(steps[0])["step"])
    # Each baseline started from an empty prefix of its own, not from the other test's last save.
    assert firsts == [1, 1]
    assert len([p for p in store.iterdir() if p.name.endswith("-baseline")]) == 2


def test_a_script_that_reads_a_relative_data_file_finds_it_on_the_new_machine(
    tmp_path, capsys, fake_command, monkeypatch
):
    project = tmp_path / "project"
    (project / "inputs").mkdir(parents=True)
    (project / "inputs" / "data.txt").write_text("1 2 3")
    monkeypatch.chdir(project)
    argv = ["resume-test", "--lose-machine", "--trials", "1", "--kills", "1", "--kill-at", "after-save",
            "--workdir", str(tmp_path / "w"), "--",
            *fake_command("--layout", "manager", "--data", "inputs/data.txt", "--sleep", "0.1")]  # fmt: skip
    code = cli.main(argv)
    out = capsys.readouterr().out
    section = json.loads((tmp_path / "w" / "report.json").read_text())["failure_domain"]
    # The restart ran (it found its data file) and began again: the saves were on the lost machine.
    assert [k["restart_first_step"] for k in section["kills"]] == [1], out
    assert code == 1 and "the checkpoints lived on the machine that was lost" in out
    assert (project / "inputs" / "data.txt").read_text() == "1 2 3"
    assert sorted(p.name for p in project.iterdir()) == ["inputs"]


def test_a_script_that_resumes_from_an_absolute_local_path_is_not_passed_and_the_path_is_named(
    tmp_path, capsys, fake_command
):
    local = tmp_path / "my-checkpoints"  # outside the workdir: a lost machine would take it along
    train = fake_command("--layout", "manager", "--ckpt-dir", f"{local}/{{run_id}}", "--steps", "24",
                         "--sleep", "0.05")  # fmt: skip
    argv = ["resume-test", "--lose-machine", "--trials", "1", "--kills", "1",
            "--workdir", str(tmp_path / "w"), "--", *train]  # fmt: skip
    code = cli.main(argv)
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "w" / "report.json").read_text())
    section = report["failure_domain"]
    assert sorted(p.name.split("-", 3)[-1] for p in local.iterdir()) == ["baseline", "trial-01"]
    assert section["outside_writes"] == sorted(str(p) for p in local.iterdir()), out
    assert section["verdict"] == "INCONCLUSIVE" and code == 3 and report["verdict"] == "INCONCLUSIVE", out
    assert f"wrote outside the simulated machine: {local}/" in out
    assert all(any(s.name.startswith("step-") for s in p.iterdir()) for p in local.iterdir())  # kept


def test_no_kill_after_a_save_is_reported_as_untested():
    assert judge_lost_machine([], base_first=1)["verdict"] == "UNTESTED"


def test_each_trials_store_prefix_is_named_when_the_trials_used_different_ones():
    kills = [{"trial": n, "status": "ok", "why": "resumed", "store": f"s3://b/s-trial-0{n}"} for n in (1, 2)]
    section = {"tested": FAILURE_DOMAIN, "store": "s3://b/s-trial-01", "stores": [k["store"] for k in kills],
               "kills": kills, "outside_writes": [], "verdict": "PASS", "explanation": "x"}  # fmt: skip
    text = format_failure_domain(section)
    assert "durable copy: one prefix per run" in text
    assert "trial 1 (s3://b/s-trial-01): ok" in text and "trial 2 (s3://b/s-trial-02): ok" in text
