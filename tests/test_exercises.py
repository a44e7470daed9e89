"""Tests for the exercise graders: each passes the reference, fails plausible wrong answers,
and reports an untouched scaffold as not attempted without raising."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_lesson.course import exercises, graders_files, graders_runs, solutions
from ckpt_lesson.course.exercise import SOLVE_FIRST
from ckpt_lesson.course.exercises import EXERCISES, Exercise
from ckpt_lesson.course.graders_disk import check_atomic_save, check_round_trip
from ckpt_lesson.course.graders_files import check_migration, check_verify_part
from ckpt_lesson.course.graders_lessons import check_next_batch, check_plan_param_group
from ckpt_lesson.course.graders_rng import check_rng
from ckpt_lesson.course.graders_runs import check_cadence, check_keep_k
from ckpt_lesson.course.grading import FAIL_MARK, PASS_MARK
from ckpt_lesson.course.training import next_batch_ids
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.files.schema import migrate_v1_to_v2
from ckpt_lesson.files.shard_plan import plan_shards
from ckpt_lesson.files.verify import verify_part
from ckpt_lesson.runs.cost import should_save
from ckpt_lesson.runs.retention import keep_last_k


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
    assert out.startswith(f"{PASS_MARK} ")
    assert f"({grader.__name__}): all {result.cases} cases" in out
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


def test_a_failure_prints_a_short_block_function_first_then_the_case_then_what_went_wrong(capsys):
    def deletes_nothing(steps, verified, k):
        return []

    result = check_keep_k(deletes_nothing)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{FAIL_MARK} keep_last_k (check_keep_k, case 1)"
    assert lines[1].startswith("  case:  [k=1, every step verified] keep_last_k(")
    assert lines[2] == "  wrong: expected [100, 200], got []"
    assert result.cases == 1 and len(lines) == 3


def test_a_failure_block_wraps_between_words_and_names_the_hint_last(capsys):
    def deletes_nothing(steps, verified, k):
        return []

    EXERCISES["keep_k"].check(deletes_nothing)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "  next:  keep_k.hint() gives a hint, keep_k.solution() shows one answer."
    assert all(len(line) <= 130 for line in lines)


def test_torchs_weights_only_refusal_is_trimmed_to_its_reason_without_ansi_bold(capsys):
    def capture():
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}

    def restore(state):
        pass

    check_rng(capture, restore)
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the block wraps between words
    assert "(UnpicklingError: Unsupported global: GLOBAL numpy" in flat
    assert "Please use" not in flat and "trust the source" not in flat
    assert "\x1b[1m" not in out  # torch's bold; only the verdict word is coloured
    assert out.count("\x1b[") == 2 and out.startswith(FAIL_MARK)
    assert all(len(line) <= 100 for line in out.splitlines()[2:])


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
        if Path(path).stat().st_size != size:
            return "size differs"
        return None if hashlib.sha256(Path(path).read_bytes()).hexdigest() == sha256 else "mismatch"

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
            actual = os.stat(path).st_size
        except FileNotFoundError:
            return "gone"
        if actual != size:
            return f"has {actual} bytes"
        with open(path, "rb") as f:
            return None if hashlib.file_digest(f, "sha256").hexdigest() == sha256 else "hash differs"

    assert check_verify_part(mine, verbose=False).passed


def test_verify_part_fails_an_answer_that_hashes_before_comparing_the_size():
    def hash_first(path, *, size, sha256):
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            return "gone"
        if hashlib.sha256(data).hexdigest() != sha256:
            return "hash differs"
        return None if len(data) == size else f"has {len(data)} bytes"

    failure = _fails(check_verify_part, hash_first)
    assert "yet verify_part opened it" in failure
    assert "compare the size first" in failure


def test_verify_part_fails_reading_through_os_open_before_the_size_check():
    def low_level(path, *, size, sha256):
        if not Path(path).exists():
            return "gone"
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.read(fd, size + 1)
        finally:
            os.close(fd)
        if len(data) != size:
            return "size differs"
        return None if hashlib.sha256(data).hexdigest() == sha256 else "hash differs"

    assert "yet verify_part opened it" in _fails(check_verify_part, low_level)


def test_verify_part_grader_prints_no_temp_paths(capsys):
    def always_ok(path, *, size, sha256):
        return None

    check_verify_part(always_ok)
    out = capsys.readouterr().out
    assert out.startswith(f"{FAIL_MARK} verify_part (check_verify_part, case ")
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


def test_grader_modules_for_06_to_09_export_one_grader_per_exercise():
    assert graders_runs.__all__ == ["check_cadence", "check_keep_k"]
    assert graders_files.__all__ == ["check_migration", "check_verify_part"]


# ---------------------------------------------------------------- the Exercise objects


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_every_registered_reference_solution_passes_its_grader(name, capsys):
    exercise = EXERCISES[name]
    result = exercise.check(*exercise.references)
    assert (result.passed, result.attempted, result.first_failure) == (True, True, None)
    names = exercise.function_names.replace(" or ", ", ")
    assert capsys.readouterr().out == (
        f"{PASS_MARK} {names} ({name}): all {result.cases} cases agree with the reference and keep the "
        "invariants.\n"
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


LESSON_EXERCISES = ["atomic", "batch_position", "param_group", "rng_capture", "round_trip", "shard_index"]


def test_the_six_lesson_exercises_are_the_ones_that_name_the_package_version():
    assert sorted(n for n, e in EXERCISES.items() if e.package) == LESSON_EXERCISES


@pytest.mark.parametrize("name", LESSON_EXERCISES)
def test_compare_prints_the_solve_first_line_until_a_check_passes(name, capsys):
    exercise = dataclasses.replace(EXERCISES[name])  # a fresh object: nothing earned yet
    exercise.compare()
    exercise.check(*[scaffold for _ in exercise.references])
    exercise.compare()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{SOLVE_FIRST}: the package's version appears here once {name}.check(...)")
    assert out[2] == out[0]
    assert not any(line.startswith("def ") for line in out)


@pytest.mark.parametrize("name", LESSON_EXERCISES)
def test_compare_shows_the_package_source_once_a_check_passed(name, capsys):
    exercise = dataclasses.replace(EXERCISES[name])
    exercise.check(*exercise.references)
    capsys.readouterr()
    exercise.compare()
    out = capsys.readouterr().out
    assert out.startswith("# ckpt_lesson/")
    for spec in exercise.package:
        assert f"def {spec.partition(':')[2]}(" in out


def test_compare_shows_the_package_source_after_the_solution_was_asked_for(capsys):
    exercise = dataclasses.replace(exercises.atomic)
    exercise.solution()
    capsys.readouterr()
    exercise.compare()
    assert "def _atomic_write(" in capsys.readouterr().out


def test_a_failing_check_does_not_earn_the_package_version(capsys):
    exercise = dataclasses.replace(exercises.param_group)

    def one_shard_for_all(state_dict, num_shards):
        return [list(state_dict)] + [[] for _ in range(num_shards - 1)]

    assert not exercise.check(one_shard_for_all).passed
    capsys.readouterr()
    exercise.compare()
    assert capsys.readouterr().out.startswith(SOLVE_FIRST)


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


# ---------------------------------------------------------------- 01 rng_capture wrong answers


def _fails_pair(grader, *fns) -> str:
    result = grader(*fns, verbose=False)
    assert result.attempted
    assert not result.passed
    assert result.first_failure
    return result.first_failure


def test_rng_fails_a_snapshot_holding_numpys_raw_state():
    def capture():
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}

    def restore(state):
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])

    assert "weights_only=True) refused the snapshot" in _fails_pair(check_rng, capture, restore)


def test_rng_fails_forgetting_numpy():
    def capture():
        return {"python": random.getstate(), "torch": torch.get_rng_state()}

    def restore(state):
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])

    assert "numpy np.random.rand()" in _fails_pair(check_rng, capture, restore)


def test_rng_fails_dropping_numpys_cached_gaussian():
    def capture():
        name, keys, pos, _, _ = np.random.get_state()
        return {"python": random.getstate(), "np": [name, keys.tolist(), pos], "torch": torch.get_rng_state()}

    def restore(state):
        random.setstate(state["python"])
        name, keys, pos = state["np"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos))
        torch.set_rng_state(state["torch"])

    assert "np.random.normal()" in _fails_pair(check_rng, capture, restore)


def test_rng_fails_reseeding_instead_of_restoring():
    def capture():
        return {"seed": 0}

    def restore(state):
        random.seed(state["seed"])
        np.random.seed(state["seed"])
        torch.manual_seed(state["seed"])

    assert "before" in _fails_pair(check_rng, capture, restore)


def test_rng_grader_leaves_the_global_generators_alone():
    torch.manual_seed(5)
    np.random.seed(5)
    check_rng(solutions.capture_rng_state, solutions.restore_rng_state, verbose=False)
    after = (torch.rand(1).item(), np.random.rand())
    torch.manual_seed(5)
    np.random.seed(5)
    assert after == (torch.rand(1).item(), np.random.rand())


# ---------------------------------------------------------------- 02 atomic wrong answers


def naive_torch_save(payload, path):
    torch.save(payload, path)  # naive: truncates the old file first


def no_fsync_save(payload, path):
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    torch.save(payload, tmp)
    os.replace(tmp, path)


def fixed_temp_name_save(payload, path):
    path = Path(path)
    tmp = path.parent / (path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def leaves_temp_on_error_save(payload, path):
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def test_atomic_fails_plain_torch_save_already_without_the_kill():
    assert "never renamed a temp file" in _fails_pair(check_atomic_save, naive_torch_save)


def test_atomic_fails_a_rename_without_fsync():
    assert "did not os.fsync the temp file" in _fails_pair(check_atomic_save, no_fsync_save)


def test_atomic_fails_a_fixed_temp_name():
    assert "both saves used the temp name" in _fails_pair(check_atomic_save, fixed_temp_name_save)


def test_atomic_fails_leaving_the_temp_file_after_an_error():
    assert "remove the temp file when the save fails" in _fails_pair(
        check_atomic_save, leaves_temp_on_error_save
    )


def catches_only_exception_save(payload, path):
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception:  # misses KeyboardInterrupt (Ctrl-C), a BaseException
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def test_atomic_fails_a_cleanup_that_catches_only_exception_so_ctrl_c_leaves_the_temp_file():
    problem = _fails_pair(check_atomic_save, catches_only_exception_save)
    assert problem.startswith("[torch.save Ctrl-C arrives]")
    assert "except Exception misses it" in problem


def test_atomic_reference_passes_the_ctrl_c_case():
    assert check_atomic_save(solutions.atomic_save, verbose=False, kill=False).passed


def test_atomic_kill_case_catches_plain_torch_save_in_a_child_process():
    from ckpt_lesson.course.kill_child import kill_case

    with tempfile.TemporaryDirectory() as tmp:
        case = kill_case(Path(tmp) / "kill")
        problem = case.judge(case.call(naive_torch_save))
    assert "no longer loads" in problem


def test_atomic_kill_case_runs_a_function_that_uses_a_helper_defined_beside_it():
    with tempfile.TemporaryDirectory() as tmp:
        from ckpt_lesson.course.kill_child import kill_case

        case = kill_case(Path(tmp) / "kill")
        assert case.judge(case.call(uses_a_helper_save)) is None


def _fsync_directory(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def uses_a_helper_save(payload, path):
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_directory(path.parent)


def test_function_source_collects_helpers_modules_and_constants():
    from ckpt_lesson.course.kept_source import function_source

    source = function_source(uses_a_helper_save)
    assert "import os as os" in source and "import uuid as uuid" in source
    assert "def _fsync_directory(" in source and "def uses_a_helper_save(" in source
    assert "from pathlib import Path as Path" in source


# ---------------------------------------------------------------- 03 round_trip wrong answers


def _payload(model, optimizer, scheduler, state, *, rng=True):
    out = {
        "schema": "lesson.v1",
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "state": {
            "step": state.step,
            "epoch": state.epoch,
            "batch_in_epoch": state.batch_in_epoch,
            "losses": list(state.losses),
        },  # fmt: skip
    }
    out["rng"] = solutions.capture_rng_state() if rng else {}
    return out


def test_round_trip_fails_a_checkpoint_without_the_rng():
    def save(model, optimizer, scheduler, state, path):
        torch.save(_payload(model, optimizer, scheduler, state, rng=False), path)

    def load(path, model, optimizer, scheduler):
        p = torch.load(path, weights_only=True)
        model.load_state_dict(p["model"])
        optimizer.load_state_dict(p["optimizer"])
        scheduler.load_state_dict(p["scheduler"])
        return TrainState(**p["state"])

    assert "restore all five buckets" in _fails_pair(check_round_trip, save, load)


def test_round_trip_fails_a_save_written_in_place_with_plain_torch_save():
    def save(model, optimizer, scheduler, state, path):
        torch.save(_payload(model, optimizer, scheduler, state), path)  # all five buckets, not atomic

    failure = _fails_pair(check_round_trip, save, solutions.load_checkpoint)
    assert "writes a temp file, fsyncs it, renames it]" in failure
    assert "never renaming a temp file onto it" in failure
    assert check_round_trip(solutions.save_checkpoint, solutions.load_checkpoint, verbose=False).passed


def test_round_trip_fails_a_loader_that_applies_before_validating():
    def load(path, model, optimizer, scheduler):
        try:
            p = torch.load(path, weights_only=True)
        except Exception as exc:
            raise ValueError("damaged") from exc
        if "model" not in p:
            raise ValueError("missing model")
        model.load_state_dict(p["model"])  # applied before the other checks
        for key in ("schema", "optimizer", "scheduler", "state", "rng"):
            if key not in p:
                raise ValueError(f"missing {key}")
        if p["schema"] != "lesson.v1":
            raise ValueError("unknown schema")
        optimizer.load_state_dict(p["optimizer"])
        scheduler.load_state_dict(p["scheduler"])
        solutions.restore_rng_state(p["rng"])
        return TrainState(**p["state"])

    failure = _fails_pair(check_round_trip, solutions.save_checkpoint, load)
    assert "validate everything first" in failure


def test_round_trip_fails_a_loader_that_lets_a_key_error_escape():
    def load(path, model, optimizer, scheduler):
        try:
            p = torch.load(path, weights_only=True)
        except Exception as exc:
            raise ValueError("damaged") from exc
        if p.get("schema") != "lesson.v1":
            raise ValueError("unknown schema")
        state = TrainState(**p["state"])
        optimizer.load_state_dict(p["optimizer"])
        scheduler.load_state_dict(p["scheduler"])
        solutions.restore_rng_state(p["rng"])
        model.load_state_dict(p["model"])
        return state

    assert "raised KeyError" in _fails_pair(check_round_trip, solutions.save_checkpoint, load)


def test_round_trip_fails_a_loader_without_weights_only():
    def load(path, model, optimizer, scheduler):
        try:
            p = torch.load(path, weights_only=False)
        except Exception as exc:
            raise ValueError("damaged") from exc
        missing = [k for k in ("model", "optimizer", "scheduler", "state", "rng") if k not in p]
        if missing or p.get("schema") != "lesson.v1":
            raise ValueError("bad file")
        if "extras" in p:
            raise ValueError("unexpected extras")
        return solutions.load_checkpoint(path, model, optimizer, scheduler)

    assert "ran code from the file" in _fails_pair(check_round_trip, solutions.save_checkpoint, load)


def test_round_trip_fails_a_loader_that_lets_the_truncated_file_crash():
    def load(path, model, optimizer, scheduler):
        torch.load(path, weights_only=True)  # a RuntimeError on a cut-short zip escapes
        return solutions.load_checkpoint(path, model, optimizer, scheduler)

    assert "cut in half" in _fails_pair(check_round_trip, solutions.save_checkpoint, load)


# ---------------------------------------------------------------- 04 param_group wrong answers


def test_param_group_fails_plain_round_robin():
    def round_robin(state_dict, num_shards):
        keys = list(state_dict)
        return [keys[i::num_shards] for i in range(num_shards)]

    assert "holds" in _fails(check_plan_param_group, round_robin)


def test_param_group_fails_groups_without_balancing():
    def unbalanced(state_dict, num_shards):
        if num_shards < 2:
            raise ValueError("need 2")
        n_w = (num_shards + 1) // 2
        w = [k for k in state_dict if k.endswith("weight")]
        o = [k for k in state_dict if not k.endswith("weight")]
        return [w[i::n_w] for i in range(n_w)] + [o[i :: num_shards - n_w] for i in range(num_shards - n_w)]

    assert "largest-first into the lightest shard" in _fails(check_plan_param_group, unbalanced)


def test_param_group_fails_balancing_by_element_count_instead_of_bytes():
    def by_numel(state_dict, num_shards):
        if num_shards < 2:
            raise ValueError("need 2")
        n_w = (num_shards + 1) // 2

        def balance(keys, n):
            shards, load = [[] for _ in range(n)], [0] * n
            for k in sorted(keys, key=lambda k: state_dict[k].numel(), reverse=True):  # elements, not bytes
                i = load.index(min(load))
                shards[i].append(k)
                load[i] += state_dict[k].numel()
            return shards

        w = [k for k in state_dict if k.endswith("weight")]
        o = [k for k in state_dict if not k.endswith("weight")]
        return balance(w, n_w) + balance(o, num_shards - n_w)

    problem = _fails(check_plan_param_group, by_numel)
    assert problem.startswith("[float64 and float16 weights: balance bytes, not elements, 3 shards]")
    assert check_plan_param_group(solutions.plan_param_group, verbose=False).passed


def test_param_group_fails_accepting_a_single_shard():
    def no_check(state_dict, num_shards):
        return solutions.plan_param_group(state_dict, max(num_shards, 2))[:num_shards] if num_shards else []

    assert "expected ValueError" in _fails(check_plan_param_group, no_check)


def test_param_group_passes_the_package_plan():
    assert check_plan_param_group(lambda sd, n: plan_shards(sd, n, "param_group"), verbose=False).passed


# ---------------------------------------------------------------- 05 batch_position wrong answers


def test_batch_position_fails_the_global_generator():
    def global_rng(state, data, *, seed, batch_size):
        if state.batch_in_epoch >= len(data) // batch_size:
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
        order = torch.randperm(len(data))
        start = state.batch_in_epoch * batch_size
        return order[start : start + batch_size].tolist()

    assert "expected" in _fails(check_next_batch, global_rng)


def test_batch_position_fails_reseeding_the_global_generator_although_the_ids_are_right():
    def reseeds_global(state, data, *, seed, batch_size):
        if state.batch_in_epoch >= len(data) // batch_size:
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
        torch.manual_seed(seed * 1_000_003 + state.epoch)  # same order, but every step's dropout repeats
        order = torch.randperm(len(data))
        start = state.batch_in_epoch * batch_size
        return order[start : start + batch_size].tolist()

    problem = _fails(check_next_batch, reseeds_global)
    assert "the right ids, but torch's global generator changed" in problem
    assert check_next_batch(next_batch_ids, verbose=False).passed  # the reference leaves it alone


def test_batch_position_fails_without_the_epoch_rollover():
    def no_rollover(state, data, *, seed, batch_size):
        g = torch.Generator().manual_seed(seed * 1_000_003 + state.epoch)
        start = state.batch_in_epoch * batch_size
        return torch.randperm(len(data), generator=g)[start : start + batch_size].tolist()

    assert "roll into epoch 1" in _fails(check_next_batch, no_rollover)


def test_batch_position_fails_a_replay_of_every_epoch():
    def replays(state, data, *, seed, batch_size):
        for e in range(state.epoch):  # draws every earlier epoch's order for nothing
            torch.randperm(len(data), generator=torch.Generator().manual_seed(seed * 1_000_003 + e))
        return next_batch_ids(state, data, seed=seed, batch_size=batch_size)

    assert "permutations for one batch" in _fails(check_next_batch, replays)


def test_batch_position_fails_advancing_the_batch_counter_itself():
    def advances(state, data, *, seed, batch_size):
        ids = next_batch_ids(state, data, seed=seed, batch_size=batch_size)
        state.batch_in_epoch += 1
        return ids

    assert "only roll over" in _fails(check_next_batch, advances)


def test_show_source_prints_the_module_path_and_the_code_without_the_docstring(capsys):
    from ckpt_lesson.course.exercise import show_source
    from ckpt_lesson.files.atomic import fsync_dir

    show_source(fsync_dir)
    out = capsys.readouterr().out
    assert out.startswith("# ckpt_lesson/files/atomic.py\ndef fsync_dir(")
    assert "os.fsync(fd)" in out
    assert '"""' not in out
