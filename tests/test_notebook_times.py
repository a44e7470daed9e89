"""Every notebook's time comes from one stated method, and every place that quotes it agrees.

The method (notebooks/README.md, "Time"): reading at 200 words a minute, 1.25 minutes
to run and read each code cell, 10 minutes per graded exercise, rounded to the
nearest 5 minutes. It was calibrated once, against a careful learner's timed
walk-through of the whole course (issue 24: core 00-05 took 3-3.5 hours, everything
7-7.5 hours; the method, applied to those notebooks, gave 3 h 30 min and 7 h 10 min).

A markdown cell that starts with ``## Going further`` begins a notebook's optional part:
everything from it to the end. The method is applied to the core part (the cells before
it) and to the optional part separately. The core path is 00, 01, 02, 03 and 05, and
its core parts must fit 90 minutes. The tests recompute every estimate from the
committed notebooks, so a notebook that grows changes its time, and the header, notebook
00's map, the notebooks' README, the top-level README and the site's course page must
follow.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CORE_PATH = ("00", "01", "02", "03", "05")
CORE_BUDGET_MINUTES = 90
GOING_FURTHER = "## Going further"
WORDS_PER_MINUTE = 200
MINUTES_PER_CODE_CELL = 1.25
MINUTES_PER_EXERCISE = 10
TABLES = ("notebooks/README.md", "README.md", "docs/course.md")


def _cells(notebook: Path) -> list[dict]:
    return json.loads(notebook.read_text())["cells"]


def parts(notebook: Path) -> tuple[list[dict], list[dict]]:
    """The core cells and the optional ("Going further") cells of a notebook."""
    cells = _cells(notebook)
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "markdown" and "".join(cell["source"]).startswith(GOING_FURTHER):
            return cells[:i], cells[i:]
    return cells, []


def estimate_minutes(cells: list[dict]) -> int:
    """The stated method: words, code cells and graded exercises, rounded to 5 minutes."""
    words = sum(len("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    exercises = sum(1 for s in code if re.search(r"^(result = )?\w+\.check\(", s, re.M))
    minutes = words / WORDS_PER_MINUTE + MINUTES_PER_CODE_CELL * len(code) + MINUTES_PER_EXERCISE * exercises
    return 5 * max(1, round(minutes / 5))


def times(notebook: Path) -> tuple[int, int | None]:
    """(core minutes, going-further minutes or None when the notebook has no optional part)."""
    core, further = parts(notebook)
    return estimate_minutes(core), (estimate_minutes(further) if further else None)


def table_time(notebook: Path) -> str:
    """How a table's time column reads: ``20 min`` or ``20 min (+15 going further)``."""
    core, further = times(notebook)
    return f"{core} min" if further is None else f"{core} min (+{further} going further)"


def core_path_minutes() -> int:
    return sum(times(n)[0] for n in NOTEBOOKS if n.name[:2] in CORE_PATH)


def full_path_minutes() -> int:
    return sum(core + (further or 0) for core, further in map(times, NOTEBOOKS))


def _hours(minutes: int) -> str:
    return f"{minutes // 60} h {minutes % 60:02d} min"


def test_there_are_fourteen_or_more_notebooks_to_time():
    assert len(NOTEBOOKS) >= 14


def test_the_core_path_notebooks_exist():
    assert sorted(n.name[:2] for n in NOTEBOOKS if n.name[:2] in CORE_PATH) == list(CORE_PATH)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_has_at_most_one_going_further_part(notebook):
    starts = [c for c in _cells(notebook) if "".join(c["source"]).startswith(GOING_FURTHER)]
    assert len(starts) <= 1, f"{notebook.name}: {len(starts)} cells start with {GOING_FURTHER!r}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_header_states_the_times_the_method_gives(notebook):
    header = "".join(_cells(notebook)[0]["source"])
    core, further = times(notebook)
    found = re.findall(r"\*\*Time:\*\* about (\d+) minutes", header)
    assert found == [str(core)], f"{notebook.name}: header says {found}, the method gives {core}"
    optional = re.findall(r"\*\*Going further:\*\* about (\d+) minutes \(optional\)", header)
    expected = [] if further is None else [str(further)]
    assert optional == expected, f"{notebook.name}: header says going further {optional}, method {expected}"


def test_the_core_path_fits_ninety_minutes():
    per_notebook = {n.name[:2]: times(n)[0] for n in NOTEBOOKS if n.name[:2] in CORE_PATH}
    assert core_path_minutes() <= CORE_BUDGET_MINUTES, per_notebook


@pytest.mark.parametrize("table", TABLES)
def test_each_course_table_lists_every_notebook_with_the_same_time(table):
    text = (ROOT / table).read_text()
    for notebook in NOTEBOOKS:
        rows = [line for line in text.splitlines() if line.startswith(f"| [{notebook.stem}](")]
        assert len(rows) == 1, f"{table}: one row for {notebook.stem}, found {len(rows)}"
        assert f"| {table_time(notebook)} |" in rows[0], f"{table}: {rows[0]}"
        # notebooks/README.md's table of paths names each notebook without a link
        for quoted in re.findall(
            rf"^\| {notebook.stem} \| ([^|]+) \| (?:core|optional|extension) \|$", text, re.M
        ):
            assert quoted == table_time(notebook), f"{table}, table of paths: {notebook.stem} {quoted}"


def test_notebook_00s_course_map_quotes_each_lesson_with_the_same_time():
    by_number = {n.name[:2]: n for n in NOTEBOOKS}
    text = "".join("".join(c["source"]) for c in _cells(by_number["00"]) if c["cell_type"] == "markdown")
    rows = re.findall(r"^\| (\d\d) [^|]*\|[^|]*\| ([^|]+) \|", text, re.M)
    assert {number for number, _ in rows} >= set(CORE_PATH), rows
    for number, quoted in rows:
        assert quoted == table_time(by_number[number]), f"00's map, row {number}: {quoted}"


@pytest.mark.parametrize("where", TABLES)
def test_the_core_and_full_path_totals_are_quoted_as_computed(where):
    text = (ROOT / where).read_text()
    assert f"core path (00, 01, 02, 03, 05): {_hours(core_path_minutes())}" in text, where
    assert f"full path: {_hours(full_path_minutes())}" in text, where


def test_notebook_00_states_the_core_and_full_path_in_its_header():
    start = "".join(_cells(NOTEBOOKS[0])[0]["source"])
    assert f"core path (00, 01, 02, 03, 05): about {_hours(core_path_minutes())}" in start
    assert f"full path: about {_hours(full_path_minutes())}" in start
