"""The committed notebooks show no answer above an unsolved exercise.

Run All on a fresh clone must not print the package's version of a piece before
the learner's own check has passed. Each lesson's "compare with the package"
cell calls ``<exercise>.compare()``, and in the committed (unsolved) notebook its
output must be the stable "solve the exercise first" line. These tests read the
``.ipynb`` files as JSON; they execute nothing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ckpt_lesson.course.exercise import SOLVE_FIRST
from ckpt_lesson.course.exercises import EXERCISES

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
# (notebook, exercise): 04 has two, the index in its core part and the layout in "Going further".
LESSONS = [
    ("01_rng_capture", "rng_capture"),
    ("02_atomic_saves", "atomic"),
    ("03_full_round_trip", "round_trip"),
    ("04_sharding", "shard_index"),
    ("04_sharding", "param_group"),
    ("05_mid_epoch_resume", "batch_position"),
]


def _code_cells(notebook: str) -> list[dict]:
    cells = json.loads((NOTEBOOKS / f"{notebook}.ipynb").read_text())["cells"]
    return [c for c in cells if c["cell_type"] == "code"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _text(cell: dict) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append("".join(output.get("text", "")))
        parts.append("".join(output.get("data", {}).get("text/plain", "")))
    return "".join(parts)


def test_every_lesson_exercise_with_a_package_version_has_a_notebook_here():
    assert sorted(name for _, name in LESSONS) == sorted(n for n, e in EXERCISES.items() if e.package)


@pytest.mark.parametrize(("notebook", "name"), LESSONS)
def test_each_lesson_prints_solve_it_first_in_its_committed_compare_cell(notebook, name):
    cells = _code_cells(notebook)
    compare = [i for i, c in enumerate(cells) if re.search(rf"^{name}\.compare\(\)", _source(c), re.M)]
    check = [i for i, c in enumerate(cells) if re.search(rf"\b{name}\.check\(", _source(c))]
    assert len(compare) == 1, f"{notebook}: expected one {name}.compare() cell, found {len(compare)}"
    assert check and check[0] < compare[0], f"{notebook}: the compare cell must follow the check cell"
    cell = cells[compare[0]]
    assert not _source(cell).startswith("# NBVAL_IGNORE_OUTPUT"), "nbval must compare this cell's output"
    assert _text(cell).startswith(f"{SOLVE_FIRST}: "), f"{notebook}: the compare cell shows an answer"
    assert "NOT ATTEMPTED" in _text(cells[check[0]]), f"{notebook}: committed solved"


@pytest.mark.parametrize(("notebook", "name"), LESSONS)
def test_no_lesson_prints_the_package_source_anywhere_above_its_exercise(notebook, name):
    cells = _code_cells(notebook)
    check = next(i for i, c in enumerate(cells) if re.search(rf"\b{name}\.check\(", _source(c)))
    shown = [spec.partition(":")[2] for spec in EXERCISES[name].package]
    for cell in cells[:check]:
        source = _source(cell)
        assert not re.search(rf"^{name}\.(solution|compare)\(", source, re.M)
        for call in re.findall(r"show_source\(([^)]*)\)", source):
            assert not any(re.search(rf"\b{fn}\b", call) for fn in shown), f"{notebook}: {call}"


# The package's names for the piece each exercise asks for: none may run above the exercise.
PIECES = {
    "rng_capture": ("capture_rng_state", "restore_rng_state"),
    "atomic": ("atomic_save",),
    "round_trip": ("save_checkpoint", "load_checkpoint"),
    "shard_index": ("write_shards", "save_sharded_checkpoint"),
    "param_group": ("plan_shards",),
    "batch_position": ("next_batch_ids", "batch_sample_ids", "epoch_order"),
}


@pytest.mark.parametrize(("notebook", "name"), LESSONS)
def test_no_cell_above_the_exercise_uses_the_package_version_of_its_piece(notebook, name):
    cells = _code_cells(notebook)
    check = next(i for i, c in enumerate(cells) if re.search(rf"\b{name}\.check\(", _source(c)))
    for i, cell in enumerate(cells[:check]):
        for piece in PIECES[name]:
            pattern = rf"(\bcl\.{piece}\b|from ckpt_lesson[\w.]* import [^\n]*\b{piece}\b)"
            used = re.search(pattern, _source(cell))
            assert not used, f"{notebook} code cell {i} uses the package's {piece} before the exercise"
