"""log_step: silent and free without the variable, one JSON line per call with it."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from ckpt_lesson import CheckpointError
from ckpt_lesson.runs import steplog
from ckpt_lesson.runs.steplog import STEP_LOG_ENV, log_step


@pytest.fixture(autouse=True)
def fresh_descriptors(monkeypatch):
    """Each test opens its own log file; the descriptors it opened are closed after it."""
    opened: dict[str, int] = {}
    monkeypatch.setattr(steplog, "_open_log", opened)
    yield
    for fd in opened.values():
        os.close(fd)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_log_step_does_nothing_when_the_variable_is_unset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    log_step(1, 0.5, sample_ids=[1, 2])
    log_step("not even a step", object())  # no validation either: an unset hook costs nothing
    assert list(tmp_path.iterdir()) == []


def test_log_step_appends_one_json_line_per_call(tmp_path, monkeypatch):
    target = tmp_path / "steps.jsonl"
    monkeypatch.setenv(STEP_LOG_ENV, str(target))
    log_step(1, 0.5)
    log_step(2, 0.25, sample_ids=[3, "b"], lr=0.001)
    first, second = read(target)
    assert first["step"] == 1 and first["loss"] == 0.5 and "sample_ids" not in first
    assert second["sample_ids"] == [3, "b"] and second["metrics"] == {"lr": 0.001}
    assert second["t"] >= first["t"] > 0


def test_log_step_accepts_numpy_scalars_and_arrays(tmp_path, monkeypatch):
    target = tmp_path / "steps.jsonl"
    monkeypatch.setenv(STEP_LOG_ENV, str(target))
    log_step(np.int64(7), np.float32(0.5), sample_ids=np.array([4, 5]))
    (record,) = read(target)
    assert record["step"] == 7 and record["loss"] == 0.5 and record["sample_ids"] == [4, 5]


def test_log_step_keeps_a_nan_loss_so_a_blown_up_run_is_compared_as_one(tmp_path, monkeypatch):
    target = tmp_path / "steps.jsonl"
    monkeypatch.setenv(STEP_LOG_ENV, str(target))
    log_step(1, float("nan"))
    assert math.isnan(read(target)[0]["loss"])


@pytest.mark.parametrize(
    "step, loss, ids, message",
    [
        (-1, 0.5, None, "step must be an int >= 0"),
        (1.5, 0.5, None, "step must be an int >= 0"),
        (True, 0.5, None, "step must be an int >= 0"),
        (1, "low", None, "loss must be a number"),
        (1, 0.5, "abc", "not one string"),
        (1, 0.5, [1.5], "ints or strings"),
    ],
)
def test_log_step_refuses_bad_values_and_writes_nothing(tmp_path, monkeypatch, step, loss, ids, message):
    target = tmp_path / "steps.jsonl"
    monkeypatch.setenv(STEP_LOG_ENV, str(target))
    with pytest.raises(CheckpointError, match=message):
        log_step(step, loss, sample_ids=ids)
    assert not target.exists() or target.read_text() == ""


def test_log_step_follows_the_variable_to_a_new_file(tmp_path, monkeypatch):
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path / "a.jsonl"))
    log_step(1, 0.5)
    monkeypatch.setenv(STEP_LOG_ENV, str(tmp_path / "b.jsonl"))
    log_step(2, 0.5)
    assert [r["step"] for r in read(tmp_path / "a.jsonl")] == [1]
    assert [r["step"] for r in read(tmp_path / "b.jsonl")] == [2]
