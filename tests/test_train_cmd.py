"""run_managed_training and the ``train`` CLI: interrupted runs resume bit-for-bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ckpt_lesson import cli
from ckpt_lesson.course.managed import run_managed_training
from ckpt_lesson.course.training import (
    SyntheticRegression,
    batch_sample_ids,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
    train,
)
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import TrainState, read_checkpoint
from ckpt_lesson.runs.scan import scan_checkpoints

SEED = 11
TOTAL = 12


def plain_run(total_steps=TOTAL, seed=SEED, batch_size=16):
    """The same run with no manager at all: the trajectory every managed run must reproduce."""
    seed_everything(seed)
    data = SyntheticRegression(seed=seed)
    model = make_model()
    opt, sched = make_optimizer_and_scheduler(model, total_steps=total_steps)
    state = TrainState()
    records = train(model, opt, sched, state, data, until_step=total_steps, seed=seed, batch_size=batch_size)
    return state.losses, {r.step: list(r.sample_ids) for r in records}


def final_losses(run_dir, step):
    return read_checkpoint(run_dir / f"step-{step:08d}" / "checkpoint.pt")["state"]["losses"]


def test_an_uninterrupted_managed_run_matches_a_run_without_a_manager(tmp_path):
    losses, ids = plain_run()
    out = run_managed_training(tmp_path, total_steps=TOTAL, seed=SEED, every_steps=5)
    assert out["losses"] == losses
    assert out["sample_ids"] == ids
    assert (out["resumed_from"], out["final_step"], out["stopped_early"]) == (None, TOTAL, False)
    assert out["saved_steps"] == [5, 10, 12]  # cadence saves plus the final one


def test_an_interrupted_run_resumes_from_its_last_save_bit_for_bit(tmp_path):
    losses, ids = plain_run()
    first = run_managed_training(tmp_path, total_steps=TOTAL, every_steps=4, stop_after_step=10)
    assert (first["final_step"], first["stopped_early"], first["saved_steps"]) == (10, True, [4, 8])
    second = run_managed_training(tmp_path, total_steps=TOTAL, every_steps=4)
    assert second["resumed_from"] == 8
    assert second["losses"] == losses
    assert second["sample_ids"] == {s: ids[s] for s in range(9, TOTAL + 1)}
    assert second["last_restore"]["step"] == 8


def test_a_sharded_managed_run_resumes_bit_for_bit(tmp_path):
    losses, _ = plain_run()
    run_managed_training(tmp_path, total_steps=TOTAL, every_steps=3, num_shards=2, stop_after_step=7)
    out = run_managed_training(tmp_path, total_steps=TOTAL, every_steps=3, num_shards=2)
    assert out["resumed_from"] == 6
    assert out["losses"] == losses


def test_background_saves_publish_the_same_steps_and_resume_bit_for_bit(tmp_path):
    losses, _ = plain_run()
    first = run_managed_training(tmp_path / "run", total_steps=TOTAL, seed=SEED, every_steps=4,
                                 stop_after_step=9, async_saves=True)  # fmt: skip
    assert first["saved_steps"] == [4, 8]  # the step-8 save in flight was waited for, not lost
    out = run_managed_training(tmp_path / "run", total_steps=TOTAL, seed=SEED, every_steps=4,
                               async_saves=True)  # fmt: skip
    assert out["resumed_from"] == 8 and out["losses"] == losses
    assert final_losses(tmp_path / "run", TOTAL) == losses


def test_resume_never_refuses_a_folder_that_already_has_saves(tmp_path):
    run_managed_training(tmp_path, total_steps=4, every_steps=2)
    with pytest.raises(CheckpointError, match="already holds saves and resume='never'"):
        run_managed_training(tmp_path, total_steps=4, every_steps=2, resume="never")


def test_resume_must_refuses_to_start_without_a_save(tmp_path):
    with pytest.raises(CheckpointError, match="no save to resume from"):
        run_managed_training(tmp_path, total_steps=4, every_steps=2, resume="must")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"resume": "sometimes", "every_steps": 2}, "resume must be one of"),
        ({"total_steps": 0, "every_steps": 2}, "total_steps must be"),
        ({}, "set every_steps, every_seconds or both"),
    ],
)
def test_bad_arguments_are_refused_before_any_training(tmp_path, kwargs, match):
    kwargs = {"total_steps": 4, **kwargs}
    with pytest.raises(CheckpointError, match=match):
        run_managed_training(tmp_path, **kwargs)


def test_resuming_a_finished_run_trains_nothing_and_saves_nothing(tmp_path):
    run_managed_training(tmp_path, total_steps=6, every_steps=4)
    out = run_managed_training(tmp_path, total_steps=6, every_steps=4)
    assert (out["resumed_from"], out["final_step"], out["saved_steps"], out["sample_ids"]) == (6, 6, [], {})


def test_the_manifest_records_data_fingerprint_and_config(tmp_path):
    run_managed_training(tmp_path, total_steps=2, every_steps=2)
    from ckpt_lesson.runs.layout import read_manifest

    manifest = read_manifest(tmp_path / "step-00000002")
    fingerprint = SyntheticRegression(seed=SEED).fingerprint()
    assert manifest["data"] == {"fingerprint": fingerprint, "order_seed": SEED}
    assert manifest["metadata"]["seed"] == SEED and len(manifest["metadata"]["config_fingerprint"]) == 64


def test_train_cli_resumes_after_an_interrupted_run_and_matches_an_uninterrupted_one(tmp_path, capsys):
    losses, _ = plain_run()
    base = ["train", "--ckpt-dir", str(tmp_path), "--total-steps", str(TOTAL), "--ckpt-every-steps", "4"]
    assert cli.main([*base, "--stop-after-step", "10", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("stopped early: step 10/12 (from scratch); saved steps [4, 8]")
    assert cli.main([*base, "--resume", "auto", "--seed", "11", "--num-shards", "0", "--keep-last", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("done: step 12/12 (from step 8); saved steps [12]; final loss ")
    assert final_losses(tmp_path, TOTAL) == losses
    assert [(r.step, r.status) for r in scan_checkpoints(tmp_path)] == [(8, "ok"), (12, "ok")]


def test_train_cli_refuses_resume_never_on_a_used_folder_with_exit_2(tmp_path, capsys):
    base = ["train", "--ckpt-dir", str(tmp_path), "--total-steps", "2", "--ckpt-every-steps", "2"]
    assert cli.main(base) == 0
    assert cli.main([*base, "--resume", "never"]) == 2
    assert "error:" in capsys.readouterr().err


def test_train_cli_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--ckpt-dir", "--total-steps", "--ckpt-every-steps", "--ckpt-every-seconds", "--keep-last"):
        assert flag in text
    for flag in ("--resume", "--seed", "--num-shards"):
        assert flag in text


def test_sample_ids_follow_the_seeded_epoch_order(tmp_path):
    out = run_managed_training(tmp_path, total_steps=3, every_steps=3)
    assert out["sample_ids"][2] == batch_sample_ids(SEED, 0, 1, 256, 16)


def _cli(env, *argv):
    """``python -m ckpt_lesson ARGV`` in a child with the bucket's AWS_* environment."""
    full = {**os.environ, **env, "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "ckpt_lesson", *argv]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=300)


def test_train_cli_saves_to_a_bucket_and_resumes_from_it_with_scan_and_report_reading_it(s3_bucket):
    url = s3_bucket.url("cli-run")
    args = ("train", "--ckpt-dir", url, "--total-steps", "12", "--ckpt-every-steps", "4", "--no-progress")
    first = _cli(s3_bucket.env(), *args, "--stop-after-step", "10")
    assert first.returncode == 0, first.stderr
    second = _cli(s3_bucket.env(), *args)
    assert second.returncode == 0, second.stderr
    assert "(from step 8)" in second.stdout
    scan = _cli(s3_bucket.env(), "scan", url)
    assert scan.returncode == 0, scan.stderr
    assert "3 save(s): 3 ok" in scan.stdout
    report = _cli(s3_bucket.env(), "report", url, "--json")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["restores"] == 1  # the recovery log lives in the bucket too


def test_train_cli_names_a_missing_bucket_in_one_line_with_exit_2(s3_bucket):
    done = _cli(s3_bucket.env(), "train", "--ckpt-dir", "s3://no-such-bucket-23/run", "--total-steps", "4")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "bucket 'no-such-bucket-23' does not exist" in done.stderr
