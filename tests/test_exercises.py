"""Tests for the exercise graders: each passes the reference, fails plausible wrong answers,
and reports an untouched scaffold as not attempted without raising."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
import torch

from ckpt_lesson.course import exercises, graders, solutions
from ckpt_lesson.course.exercises import EXERCISES, Exercise
from ckpt_lesson.course.graders import check_cadence, check_keep_k, check_migration, check_verify_part
from ckpt_lesson.files.schema import migrate_v1_to_v2
from ckpt_lesson.runs.cadence import should_save
from ckpt_lesson.runs.retention import keep_last_k
from ckpt_lesson.runs.scan import verify_part


def scaffold(*args, **kwargs):
    raise NotImplementedError


GRADERS = [
    (check_keep_k, keep_last_k),
    (check_cadence, should_save),
    (check_verify_part, verify_part),
    (check_migration, migrate_v1_to_v2),
]


def _fails(grader, fn) -> str:
    result = grader(fn, verbose=False)
    assert result.attempted
    assert not result.passed
    assert result.first_failure
    return result.first_failure


@pytest.mark.parametrize(("grader", "reference"), GRADERS)
def test_each_grader_passes_the_package_reference(grader, reference, capsys):
    result = grader(reference)
    assert (result.passed, result.attempted, result.first_failure) == (True, True, None)
    assert result.cases >= 40
    out = capsys.readouterr().out
    assert out.startswith(f"PASS {grader.__name__}: all {result.cases} cases")
    assert out.count("\n") == 1


@pytest.mark.parametrize(("grader", "reference"), GRADERS)
def test_each_grader_reports_the_untouched_scaffold_as_not_attempted(grader, reference, capsys):
    result = grader(scaffold)
    assert (result.passed, result.attempted, result.cases, result.first_failure) == (False, False, 0, None)
    assert capsys.readouterr().out.startswith(f"NOT ATTEMPTED {grader.__name__}:")


def test_graders_leave_the_global_random_generators_alone():
    torch.manual_seed(5)
    random.seed(5)
    for grader, reference in GRADERS:
        grader(reference, verbose=False)
    after = (torch.rand(1).item(), random.random())
    torch.manual_seed(5)
    random.seed(5)
    assert after == (torch.rand(1).item(), random.random())


def test_a_failure_prints_one_line_with_inputs_expected_and_got(capsys):
    def deletes_nothing(steps, verified, k):
        return []

    result = check_keep_k(deletes_nothing)
    line = capsys.readouterr().out
    assert line.startswith("FAIL check_keep_k (case 1): [k=1, every step verified] keep_last_k(")
    assert "expected [100, 200], got []" in line
    assert result.cases == 1


def test_a_learner_exception_is_reported_as_a_failure_not_raised():
    def crashes(steps, verified, k):
        return [sorted(steps)[k + 5]]  # IndexError: a plausible off-by-many slip

    assert "raised IndexError" in _fails(check_keep_k, crashes)


# ---------------------------------------------------------------- keep-K wrong answers


def test_keep_k_fails_deleting_the_oldest_without_checking_verification():
    def count_all_steps(steps, verified, k):
        return sorted(steps)[:-k]

    assert "no verified step at all" in _fails(check_keep_k, count_all_steps)


def test_keep_k_fails_sorting_steps_as_strings():
    def string_sorted(steps, verified, k):
        ordered = sorted(steps, key=str)
        good = [s for s in ordered if s in verified]
        if len(good) < k:
            return []
        return [s for s in ordered[: ordered.index(good[-k])]]

    assert "different digit counts" in _fails(check_keep_k, string_sorted)


def test_keep_k_fails_deleting_unverified_steps_newer_than_the_kept_ones():
    def deletes_all_unverified(steps, verified, k):
        keep = keep_last_k(steps, verified, k)
        return sorted(set(keep) | {s for s in steps if s not in verified})

    assert _fails(check_keep_k, deletes_all_unverified)


def test_keep_k_fails_an_answer_that_modifies_its_input():
    def sorts_in_place(steps, verified, k):
        steps.sort()
        return keep_last_k(steps, verified, k)

    assert "modified its inputs" in _fails(check_keep_k, sorts_in_place)


def test_keep_k_fails_an_answer_in_descending_order():
    def descending(steps, verified, k):
        return sorted(keep_last_k(steps, verified, k), reverse=True)

    assert "not in ascending order" in _fails(check_keep_k, descending)


# ---------------------------------------------------------------- cadence wrong answers


def test_cadence_fails_a_strict_greater_than_on_the_time_rule():
    def strict(step, now, *, last_step, last_time, every_steps, every_seconds):
        if step == 0 or step == last_step:
            return False
        if every_steps and step % every_steps == 0:
            return True
        return bool(every_seconds) and last_time is not None and now - last_time > every_seconds

    assert "exactly every_seconds have passed" in _fails(check_cadence, strict)


def test_cadence_fails_when_the_step_rule_shadows_the_time_rule():
    def elif_bug(step, now, *, last_step, last_time, every_steps, every_seconds):
        if step == 0 or step == last_step:
            return False
        if every_steps:
            return step % every_steps == 0
        return last_time is not None and now - last_time >= every_seconds

    assert "only the time rule fires" in _fails(check_cadence, elif_bug)


def test_cadence_fails_a_timer_that_counts_from_the_start_of_the_run():
    def from_start(step, now, *, last_step, last_time, every_steps, every_seconds):
        if step == 0 or step == last_step:
            return False
        if every_steps and step % every_steps == 0:
            return True
        return every_seconds is not None and last_time is not None and now >= every_seconds

    assert "from the last save" in _fails(check_cadence, from_start)


def test_cadence_fails_saving_the_same_step_twice():
    def no_repeat_guard(step, now, *, last_step, last_time, every_steps, every_seconds):
        if step == 0:
            return False
        if every_steps and step % every_steps == 0:
            return True
        return every_seconds is not None and last_time is not None and now - last_time >= every_seconds

    assert "just saved" in _fails(check_cadence, no_repeat_guard)


def test_cadence_fails_an_answer_that_returns_none_instead_of_false():
    def forgets_false(step, now, **kw):
        return True if should_save(step, now, **kw) else None

    assert "return True or False" in _fails(check_cadence, forgets_false)


# ---------------------------------------------------------------- verify_part wrong answers


def test_verify_part_fails_a_check_of_the_size_only():
    def size_only(path, *, size, sha256):
        path = Path(path)
        if not path.exists():
            return "missing"
        return None if path.stat().st_size == size else "wrong size"

    assert "bit flipped" in _fails(check_verify_part, size_only)


def test_verify_part_fails_raising_on_a_missing_file():
    def raises_when_missing(path, *, size, sha256):
        data = Path(path).read_bytes()
        ok = len(data) == size and hashlib.sha256(data).hexdigest() == sha256
        return None if ok else "mismatch"

    failure = _fails(check_verify_part, raises_when_missing)
    assert "raised FileNotFoundError" in failure
    assert "<tmp>/part-" in failure and "/tmp" not in failure


def test_verify_part_fails_hashing_only_the_first_kilobyte():
    def first_kib(path, *, size, sha256):
        path = Path(path)
        if not path.exists() or path.stat().st_size != size:
            return "missing or wrong size"
        data = path.read_bytes()
        ok = hashlib.sha256(data[:1024]).hexdigest() == hashlib.sha256(data).hexdigest() or sha256 == ""
        return None if ok or len(data) > 1024 else "mismatch"

    assert _fails(check_verify_part, first_kib)


def test_verify_part_passes_a_correct_answer_in_other_words():
    def mine(path, *, size, sha256):
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            return "gone"
        if len(data) != size:
            return f"has {len(data)} bytes"
        return None if hashlib.sha256(data).hexdigest() == sha256 else "hash differs"

    assert check_verify_part(mine, verbose=False).passed


def test_verify_part_grader_prints_no_temp_paths(capsys):
    def always_ok(path, *, size, sha256):
        return None

    check_verify_part(always_ok)
    out = capsys.readouterr().out
    assert out.startswith("FAIL check_verify_part")
    assert "/tmp" not in out and "ckpt-lesson-grader" not in out


# ---------------------------------------------------------------- migration wrong answers


def test_migration_fails_an_answer_that_mutates_its_input():
    def in_place(payload):
        if payload.get("schema") != "ckpt.v1":
            raise ValueError("not v1")
        payload["schema"] = "ckpt.v2"
        payload["env"] = {"recorded": False}
        payload["data"] = {"recorded": False, "fingerprint": None, "order_seed": None}
        payload.setdefault("extras", None)
        return payload

    assert "returned the input dict itself" in _fails(check_migration, in_place)


def test_migration_fails_an_answer_that_mutates_a_copy_shallowly_then_the_input():
    def pops_from_input(payload):
        if payload.get("schema") != "ckpt.v1":
            raise ValueError("not v1")
        out = migrate_v1_to_v2(payload)
        payload.pop("wall_saved_at")
        return out

    assert "modified its input" in _fails(check_migration, pops_from_input)


def test_migration_fails_an_answer_that_forgets_the_data_block():
    def no_data(payload):
        out = migrate_v1_to_v2(payload)
        del out["data"]
        return out

    assert "result['data'] is missing" in _fails(check_migration, no_data)


def test_migration_fails_an_answer_that_invents_an_environment():
    def invents_env(payload):
        out = migrate_v1_to_v2(payload)
        out["env"] = {"recorded": True, "torch": torch.__version__}
        return out

    assert "result['env']" in _fails(check_migration, invents_env)


def test_migration_fails_an_answer_that_accepts_a_v2_payload():
    def accepts_anything(payload):
        out = dict(payload)
        out.update(schema="ckpt.v2", env={"recorded": False})
        out["data"] = {"recorded": False, "fingerprint": None, "order_seed": None}
        out.setdefault("extras", None)
        return out

    assert "expected ValueError to be raised" in _fails(check_migration, accepts_anything)


def test_migration_fails_an_answer_that_forgets_missing_extras():
    def no_default_extras(payload):
        out = migrate_v1_to_v2(payload)
        if "extras" not in payload:
            del out["extras"]
        return out

    assert "without 'extras'" in _fails(check_migration, no_default_extras)


def test_grader_module_exports_the_four_graders_and_the_result():
    assert set(graders.__all__) == {
        "GradeResult",
        "check_cadence",
        "check_keep_k",
        "check_migration",
        "check_verify_part",
    }


# ---------------------------------------------------------------- the Exercise objects


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_every_registered_reference_solution_passes_its_grader(name, capsys):
    exercise = EXERCISES[name]
    result = exercise.check(*exercise.references)
    assert (result.passed, result.attempted, result.first_failure) == (True, True, None)
    assert capsys.readouterr().out == (
        f"PASS {name}: all {result.cases} cases agree with the reference and keep the invariants.\n"
    )


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_every_exercise_prints_one_stable_not_attempted_line_for_an_untouched_scaffold(name, capsys):
    exercise = EXERCISES[name]
    result = exercise.check(*[scaffold for _ in exercise.references])
    assert not result.attempted
    assert capsys.readouterr().out == (
        f"NOT ATTEMPTED {name}: {exercise.function_names} still raises NotImplementedError. Write your "
        f"version in the scaffold cell, then run this cell again. {name}.hint() gives a hint, "
        f"{name}.solution() shows one answer.\n"
    )


def test_registry_names_match_the_module_level_objects_a_notebook_imports():
    for name, exercise in EXERCISES.items():
        assert getattr(exercises, name) is exercise
        assert exercise.name == name
        assert len(exercise.hints) >= 3


def test_hint_without_a_number_shows_one_more_hint_per_call_then_says_there_are_no_more(capsys):
    exercise = Exercise("demo", check_keep_k, ("first", "second"), solutions.keep_last_k)
    exercise.hint()
    exercise.hint()
    exercise.hint()
    assert capsys.readouterr().out.splitlines() == [
        "Hint 1 of 2 (demo): first",
        "Hint 2 of 2 (demo): second",
        "No more hints for demo (all 2 shown). demo.solution() shows one.",
    ]


def test_hint_with_a_number_shows_that_hint_and_the_next_call_continues_after_it(capsys):
    exercise = Exercise("demo", check_keep_k, ("first", "second", "third"), solutions.keep_last_k)
    exercise.hint(2)
    exercise.hint()
    exercise.hint(7)
    assert capsys.readouterr().out.splitlines() == [
        "Hint 2 of 3 (demo): second",
        "Hint 3 of 3 (demo): third",
        "demo has hints 1 to 3; hint(7) does not exist.",
    ]


def test_hints_are_counted_per_exercise_object(capsys):
    one = Exercise("one", check_keep_k, ("a", "b"), solutions.keep_last_k)
    two = Exercise("two", check_keep_k, ("c", "d"), solutions.keep_last_k)
    one.hint()
    two.hint()
    assert capsys.readouterr().out.splitlines() == ["Hint 1 of 2 (one): a", "Hint 1 of 2 (two): c"]


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_solution_prints_the_source_of_every_reference_function(name, capsys):
    exercise = EXERCISES[name]
    exercise.solution()
    out = capsys.readouterr().out
    assert out.startswith(f"# One answer for {name}")
    for function in exercise.references:
        assert f"def {function.__name__}(" in out
    # The printed code runs: defining it in a fresh namespace with the solutions' imports works.
    namespace = dict(vars(solutions))
    exec(out, namespace)
    for function in exercise.references:
        assert callable(namespace[function.__name__])
