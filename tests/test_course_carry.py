"""What the learner writes is kept when its check passes, and later lessons use it.

The learner's functions are written the way a notebook cell defines them: in a
namespace named ``__main__``, compiled from a file ``inspect`` can read (IPython
does the same with each cell). One test runs two real Python processes, as two
notebooks' kernels would be.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import ckpt_lesson as cl
from ckpt_lesson.course import solutions
from ckpt_lesson.course.carry import yours
from ckpt_lesson.course.exercises import EXERCISES
from ckpt_lesson.course.grading import FAIL_MARK, PASS_MARK
from ckpt_lesson.course.keeping import YOURS_DIR, Kept, keep

RNG_CELL = "import random\n\nimport numpy as np\nimport torch\n\n\n" + "\n\n".join(
    inspect.getsource(f) for f in (solutions.capture_rng_state, solutions.restore_rng_state)
)


def learner_cell(tmp_path: Path, source: str, name: str = "cell") -> dict[str, Any]:
    """Run ``source`` as a notebook cell runs: in ``__main__``, from a file ``inspect`` can read."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, str(path), "exec"), namespace)
    return namespace


def test_yours_says_the_package_version_is_used_until_the_exercise_is_solved(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    capture, restore = yours("capture_rng_state", "restore_rng_state")
    assert (capture, restore) == (cl.capture_rng_state, cl.restore_rng_state)
    assert yours("atomic_save") is cl.atomic_save
    assert capsys.readouterr().out.splitlines() == [
        "using the package's capture_rng_state, restore_rng_state: exercise 01 not solved yet",
        "using the package's atomic_save: exercise 02 not solved yet",
    ]


def test_a_passing_check_keeps_the_learners_functions_and_a_fresh_process_uses_them(tmp_path):
    check = RNG_CELL + "\n\nfrom ckpt_lesson.course.exercises import rng_capture\n"
    check += "rng_capture.check(capture_rng_state, restore_rng_state)\n"
    (tmp_path / "lesson01.py").write_text(check)
    first = subprocess.run(
        [sys.executable, "lesson01.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert first.returncode == 0, first.stderr
    out = first.stdout.splitlines()
    assert out[0].startswith(f"{PASS_MARK} capture_rng_state, restore_rng_state (rng_capture)")
    assert out[1] == (
        "Kept your capture_rng_state, restore_rng_state in ckpt_work/yours/: later cells and notebooks use "
        "them (yours(...))."
    )
    use = textwrap.dedent("""
        import random
        from ckpt_lesson.course.carry import yours
        capture, restore = yours("capture_rng_state", "restore_rng_state")
        snapshot = capture()
        before = random.random()
        restore(snapshot)
        print("module:", capture.__module__, "| replays:", random.random() == before)
    """)
    second = subprocess.run(
        [sys.executable, "-c", use], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines() == [
        "using your capture_rng_state, restore_rng_state from 01",
        "module: __main__ | replays: True",
    ]


def test_the_package_reference_solutions_passed_to_a_check_are_never_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exercise = EXERCISES["rng_capture"]
    assert exercise.check(*exercise.references).passed
    assert capsys.readouterr().out.startswith(
        f"{PASS_MARK} capture_rng_state, restore_rng_state (rng_capture)"
    )
    assert not (tmp_path / "ckpt_work").exists()


def test_a_kept_function_carries_its_modules_and_helpers_and_a_new_name_is_aliased(tmp_path, capsys):
    cell = learner_cell(
        tmp_path,
        textwrap.dedent("""
            import os
            from pathlib import Path

            SUFFIX = ".tmp"

            def temp_name(path):
                return Path(path).with_name("." + Path(path).name + SUFFIX + str(os.getpid()))

            def my_save(payload, path):
                return temp_name(path)
        """),
    )
    folder = tmp_path / "kept"
    line = keep({"atomic_save": cell["my_save"]}, exercise="atomic", folder=folder).line
    assert (
        line
        == f"Kept your atomic_save in {folder.as_posix()}/: later cells and notebooks use it (yours(...))."
    )
    text = (folder / "atomic_save.py").read_text()
    assert "def temp_name(path):" in text and text.rstrip().endswith("atomic_save = my_save")
    (tmp_path / "cell.py").unlink()  # the notebook cell is gone; the kept file stands alone
    saved = yours("atomic_save", folder=folder)
    assert saved({}, "a/ckpt.pt").name.startswith(".ckpt.pt.tmp")
    assert capsys.readouterr().out == "using your atomic_save from 02\n"


def test_a_function_kept_later_carries_the_earlier_kept_function_it_calls(tmp_path, capsys):
    folder = tmp_path / "kept"
    cell = learner_cell(tmp_path, RNG_CELL, name="lesson01")
    keep({"capture_rng_state": cell["capture_rng_state"]}, exercise="rng_capture", folder=folder)
    capture = yours("capture_rng_state", folder=folder)
    lesson03 = learner_cell(
        tmp_path, "def save_checkpoint(path):\n    return sorted(capture())\n", "lesson03"
    )
    lesson03["capture"] = capture  # the name 03's cell uses for the function yours() returned
    keep({"save_checkpoint": lesson03["save_checkpoint"]}, exercise="round_trip", folder=folder)
    (folder / "capture_rng_state.py").unlink()
    save = yours("save_checkpoint", folder=folder)
    assert save("ignored") == ["numpy", "python", "torch_cpu", "torch_cuda"]
    assert capsys.readouterr().out.splitlines()[-1] == "using your save_checkpoint from 03"


def test_a_kept_file_that_does_not_load_is_reported_and_the_package_version_used(tmp_path, capsys):
    folder = tmp_path / "kept"
    folder.mkdir()
    (folder / "atomic_save.py").write_text("def atomic_save(payload, path)\n    pass\n")
    assert yours("atomic_save", folder=folder) is cl.atomic_save
    line = capsys.readouterr().out
    assert line.startswith(f"using the package's atomic_save: your kept {folder.as_posix()}/atomic_save.py")
    assert "does not load (SyntaxError" in line and line.rstrip().endswith("solve exercise 02 again")


def test_a_kept_file_reached_through_a_symlink_is_not_followed(tmp_path, capsys):
    folder = tmp_path / "kept"
    folder.mkdir()
    elsewhere = tmp_path / "elsewhere.py"
    elsewhere.write_text("def atomic_save(payload, path):\n    return 'from elsewhere'\n")
    (folder / "atomic_save.py").symlink_to(elsewhere)
    assert yours("atomic_save", folder=folder) is cl.atomic_save
    assert capsys.readouterr().out == (
        f"using the package's atomic_save: {folder.as_posix()}/atomic_save.py is not a plain file keep() "
        "wrote; delete it, solve exercise 02 again\n"
    )


def test_a_pair_is_used_together_or_not_at_all(tmp_path, capsys):
    folder = tmp_path / "kept"
    cell = learner_cell(tmp_path, RNG_CELL)
    keep({"capture_rng_state": cell["capture_rng_state"]}, exercise="rng_capture", folder=folder)
    assert yours("capture_rng_state", "restore_rng_state", folder=folder) == (
        cl.capture_rng_state,
        cl.restore_rng_state,
    )
    assert capsys.readouterr().out == (
        "using the package's capture_rng_state, restore_rng_state: exercise 01 not solved yet\n"
    )


def test_keeping_into_a_folder_reached_through_a_symlink_is_refused(tmp_path):
    cell = learner_cell(tmp_path, RNG_CELL)
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "kept").symlink_to(target, target_is_directory=True)
    line = keep(
        {"capture_rng_state": cell["capture_rng_state"]}, exercise="rng_capture", folder=tmp_path / "kept"
    ).line
    assert line is not None and line.startswith("Could not keep your capture_rng_state")
    assert "is a symbolic link" in line
    assert list(target.iterdir()) == []


def test_yours_refuses_a_name_no_exercise_asks_for():
    with pytest.raises(cl.CheckpointError, match="no exercise asks for a function named fast_forwrd"):
        yours("fast_forwrd")


def test_the_kept_files_live_under_the_notebooks_work_folder():
    assert YOURS_DIR.as_posix() == "ckpt_work/yours"


CONSTANTS_CELL = textwrap.dedent("""
    import random
    import re

    import numpy as np
    import torch

    SOURCES = ("python", "numpy", "torch_cpu", "torch_cuda")  # a tuple
    NUMPY_FIELDS = ["name", "keys", "pos", "has_gauss", "cached"]  # a list
    EMPTY_CUDA = {"torch_cuda": []}  # a dict
    LISTED = {"keys"}  # a set
    SOURCE_NAME = re.compile(r"[a-z_]+")  # a compiled regex


    def capture_rng_state():
        numpy_state = dict(zip(NUMPY_FIELDS, np.random.get_state()))
        numpy_state = {k: (v.tolist() if k in LISTED else v) for k, v in numpy_state.items()}
        state = {"python": random.getstate(), "numpy": numpy_state, "torch_cpu": torch.get_rng_state()}
        state.update(EMPTY_CUDA)
        assert all(SOURCE_NAME.fullmatch(name) for name in SOURCES)
        return {name: state[name] for name in SOURCES}


    def restore_rng_state(state):
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
        n = state["numpy"]
        parts = (np.array(n[k], dtype=np.uint32) if k in LISTED else n[k] for k in NUMPY_FIELDS)
        np.random.set_state(tuple(parts))
        torch.set_rng_state(state["torch_cpu"])
""")


def test_a_kept_function_using_tuple_list_dict_set_and_regex_constants_works_in_the_next_notebook(tmp_path):
    check = CONSTANTS_CELL + "\nfrom ckpt_lesson.course.exercises import rng_capture\n"
    check += "rng_capture.check(capture_rng_state, restore_rng_state)\n"
    (tmp_path / "lesson01.py").write_text(check)
    first = subprocess.run(
        [sys.executable, "lesson01.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[0].startswith(PASS_MARK), first.stdout
    kept = (tmp_path / YOURS_DIR / "capture_rng_state.py").read_text()
    assert "SOURCES = ('python'," in kept and "LISTED = {'keys'}" in kept and "re').compile(" in kept
    use = textwrap.dedent("""
        import numpy as np
        from ckpt_lesson.course.carry import yours
        capture, restore = yours("capture_rng_state", "restore_rng_state")
        snapshot = capture()
        before = np.random.normal()
        restore(snapshot)
        print("replays:", np.random.normal() == before, sorted(snapshot))
    """)
    second = subprocess.run(
        [sys.executable, "-c", use], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines() == [
        "using your capture_rng_state, restore_rng_state from 01",
        "replays: True ['numpy', 'python', 'torch_cpu', 'torch_cuda']",
    ]


def test_a_pass_whose_kept_copy_misses_a_name_is_a_fail_naming_it_and_nothing_is_kept(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    cell = learner_cell(
        tmp_path,
        textwrap.dedent("""
            import threading
            globals()["GUARD"] = threading.Lock()  # no statement binds GUARD: it cannot be written out

            def keep_last_k(steps, verified, k):
                with GUARD:
                    good = sorted(s for s in steps if s in verified)
                    if len(good) < k:
                        return []
                    return [s for s in sorted(steps) if s < good[-k]]
        """),
    )
    exercise = dataclasses.replace(EXERCISES["keep_k"])  # a fresh object: nothing earned yet
    result = exercise.check(cell["keep_last_k"])
    out = capsys.readouterr().out
    assert not result.passed and result.attempted
    lines = out.splitlines()
    assert lines[0] == f"{FAIL_MARK} keep_last_k (keep_k): passed here, but not loaded on its own as the " + (
        "next notebook loads it"
    )
    assert lines[1] == "  wrong: your keep_last_k reads GUARD (a lock), which cannot be written out as source"
    assert "PASS" not in out and lines[2].startswith("  fix:   define every name it uses")
    assert not (tmp_path / YOURS_DIR / "keep_last_k.py").exists()
    assert exercise._earned == [False]  # the package's version stays hidden


def test_keep_checks_the_copies_loaded_on_their_own_and_writes_nothing_when_they_fail(tmp_path):
    cell = learner_cell(tmp_path, "LAST = 2\n\ndef last_two(steps):\n    return sorted(steps)[-LAST:]\n")
    seen = []

    def recheck(copies):
        seen.append(copies[0])
        return None if copies[0]([3, 1, 2]) == [2, 3] else "the copy answers differently"

    folder = tmp_path / "kept"
    kept = keep({"keep_last_k": cell["last_two"]}, exercise="keep_k", folder=folder, recheck=recheck)
    assert kept.broken is None and (folder / "keep_last_k.py").exists()
    assert seen[0] is not cell["last_two"] and seen[0].__globals__ is not cell  # a fresh namespace
    refused = keep(
        {"keep_last_k": cell["last_two"]}, exercise="keep_k", folder=tmp_path / "b", recheck=lambda c: "no"
    )
    assert refused == Kept(None, "loaded on its own, as the next notebook loads it: no")
    assert not (tmp_path / "b" / "keep_last_k.py").exists()
