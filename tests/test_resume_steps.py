"""Reading step reports while a process writes them: complete lines only, bad lines counted."""

from __future__ import annotations

import math

import pytest

from ckpt_lesson import CheckpointError
from ckpt_lesson.resume_test.steps import LineTail, StepPattern, StepReader, parse_hook_line


def test_line_tail_hands_out_complete_lines_and_keeps_the_rest(tmp_path):
    path = tmp_path / "log"
    tail = LineTail(path)
    assert tail.read_lines() == []  # not created yet
    path.write_bytes(b"one\ntw")
    assert tail.read_lines() == ["one"]
    with open(path, "ab") as f:
        f.write(b"o\nthree")
    assert tail.read_lines() == ["two"]
    assert tail.read_lines(final=True) == ["three"]
    assert tail.read_lines(final=True) == []


def test_parse_hook_line_reads_a_full_record():
    record = parse_hook_line(
        '{"step": 4, "loss": 0.5, "sample_ids": [1, "a"], "metrics": {"lr": 0.1}, "t": 9.0}'
    )
    assert (record.step, record.loss, record.sample_ids, record.metrics, record.t) == (
        4, 0.5, (1, "a"), {"lr": 0.1}, 9.0,
    )  # fmt: skip


def test_parse_hook_line_keeps_nan():
    assert math.isnan(parse_hook_line('{"step": 1, "loss": NaN}').loss)


@pytest.mark.parametrize(
    "line",
    ["", "not json", "[1, 2]", '{"step": -1, "loss": 1}', '{"step": true, "loss": 1}',
     '{"step": 1, "loss": "x"}', '{"step": 1, "loss": 1, "sample_ids": [1.5]}',
     '{"step": 1, "loss": 1, "metrics": {"a": "b"}}'],
)  # fmt: skip
def test_parse_hook_line_rejects_what_is_not_a_record(line):
    assert parse_hook_line(line) is None


def test_step_pattern_uses_named_groups_and_turns_other_names_into_metrics():
    pattern = StepPattern(r"it (?P<step>\d+) lr (?P<lr>[0-9.]+) loss (?P<loss>[0-9.e-]+)")
    record = pattern.parse("[info] it 12 lr 0.01 loss 3.5e-1", t=1.0)
    assert (record.step, record.loss, record.metrics) == (12, 0.35, {"lr": 0.01})
    assert pattern.parse("epoch done", t=1.0) is None


def test_step_pattern_takes_two_plain_groups_as_step_then_loss():
    record = StepPattern(r"step (\d+) loss (\S+)").parse("step 3 loss 0.25", t=0.0)
    assert (record.step, record.loss) == (3, 0.25)


@pytest.mark.parametrize("pattern, message", [("(", "not a valid regular expression"),
                                               (r"step (\d+)", "needs groups"),
                                               (r"(?P<step>\d+) (\S+)", "needs groups")])  # fmt: skip
def test_step_pattern_refuses_patterns_it_cannot_use(pattern, message):
    with pytest.raises(CheckpointError, match=message):
        StepPattern(pattern)


def test_step_reader_counts_hook_lines_that_do_not_parse(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\ngarbage\n{"step": 2, "loss": 0.4}\n')
    reader = StepReader(path)
    assert [r.step for r in reader.poll()] == [1, 2]
    assert reader.bad_lines == 1


def test_step_reader_with_a_pattern_ignores_other_output(tmp_path):
    path = tmp_path / "stdout.log"
    path.write_text("loading...\nstep 1 loss 0.5\nwarning: slow\nstep 2 loss 0.4\n")
    reader = StepReader(path, StepPattern(r"step (\d+) loss (\S+)"))
    assert [(r.step, r.loss) for r in reader.poll()] == [(1, 0.5), (2, 0.4)]
    assert reader.bad_lines == 0
