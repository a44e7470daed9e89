"""Every notebook's time comes from one stated method, and every place that quotes it agrees.

The method (notebooks/README.md, "Time: how it is estimated") counts what a learner must read and
write, with rates that are stated here and nowhere else:

* prose: the words of every markdown cell at 200 words a minute (the *Check yourself* answers too);
* code: every non-blank line of every code cell at 20 lines a minute (the learner reads the cell
  before running it), plus 1 minute per code cell to run it and read what it printed;
* a graded exercise (a ``.check(...)`` cell): the non-blank, non-comment lines of the body of its
  reference solution in ``ckpt_lesson/course/solutions.py`` at 0.5 minutes a line (to think and
  type), plus 5 minutes for one typical mistake (read the FAIL, fix, run again).

The rates were set against the careful learner of issue 36, who timed the core path by solving
every exercise by hand: about 1 h 45 min without the code to read and about 2 h with it. A human
cannot be timed by a test, so the test recomputes the method from the committed notebooks and the
reference solutions, and checks that every place that quotes a time says what it gives.

Each part is rounded *up* to a whole minute; the path totals are sums of the published parts, so a
table adds up and nothing is rounded down. A markdown cell that starts with ``## Going further``
begins a notebook's optional part (everything from it to the end); the method is applied to the
core part and to the optional part separately. The core path is 00, 01, 02, 03 and 05, core parts
only. There is deliberately no budget test: the time is a measurement, not a target.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import re
import textwrap
from pathlib import Path

import pytest

from ckpt_lesson.course import exercises

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CORE_PATH = ("00", "01", "02", "03", "05")
GOING_FURTHER = "## Going further"
WORDS_PER_MINUTE = 200
CODE_LINES_PER_MINUTE = 20
MINUTES_PER_CODE_CELL = 1
MINUTES_PER_SOLUTION_LINE = 0.5
MINUTES_PER_MISTAKE = 5
TABLES = ("notebooks/README.md", "README.md", "docs/course.md")
CHECK = re.compile(r"^(?:result = )?(\w+)\.check\(", re.M)


def _cells(notebook: Path) -> list[dict]:
    return json.loads(notebook.read_text())["cells"]


def parts(notebook: Path) -> tuple[list[dict], list[dict]]:
    """The core cells and the optional ("Going further") cells of a notebook."""
    cells = _cells(notebook)
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "markdown" and "".join(cell["source"]).startswith(GOING_FURTHER):
            return cells[:i], cells[i:]
    return cells, []


def solution_lines(function) -> int:
    """Non-blank, non-comment lines of a reference solution's body (no def line, no docstring)."""
    source = textwrap.dedent(inspect.getsource(function))
    body = ast.parse(source).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    lines = source.splitlines()[body[0].lineno - 1 :]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def exercise_minutes(name: str) -> float:
    """One graded exercise: its reference solution's lines, plus one typical mistake."""
    lines = sum(solution_lines(f) for f in getattr(exercises, name).references)
    return MINUTES_PER_SOLUTION_LINE * lines + MINUTES_PER_MISTAKE


def method_minutes(cells: list[dict]) -> float:
    """The stated method, unrounded."""
    words = sum(len("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    code_lines = sum(1 for s in code for line in s.splitlines() if line.strip())
    graded = [m.group(1) for s in code for m in CHECK.finditer(s)]
    return (
        words / WORDS_PER_MINUTE
        + code_lines / CODE_LINES_PER_MINUTE
        + MINUTES_PER_CODE_CELL * len(code)
        + sum(map(exercise_minutes, graded))
    )


def times(notebook: Path) -> tuple[int, int | None]:
    """(core minutes, going-further minutes or None), each rounded up to a whole minute."""
    core, further = parts(notebook)
    return math.ceil(method_minutes(core)), (math.ceil(method_minutes(further)) if further else None)


def table_time(notebook: Path) -> str:
    """How a table's time column reads: ``20 min`` or ``20 min (+15 going further)``."""
    core, further = times(notebook)
    return f"{core} min" if further is None else f"{core} min (+{further} going further)"


def core_path_minutes() -> int:
    return sum(times(n)[0] for n in NOTEBOOKS if n.name[:2] in CORE_PATH)


def full_path_minutes() -> int:
    return sum(core + (further or 0) for core, further in map(times, NOTEBOOKS))


def group_minutes(first: int, last: int) -> int:
    """Notebooks first..last, everything included (00's map groups the extensions)."""
    return sum(
        core + (further or 0)
        for n in NOTEBOOKS
        if first <= int(n.name[:2]) <= last
        for core, further in [times(n)]
    )


def hours(minutes: int) -> str:
    return f"{minutes // 60} h {minutes % 60:02d} min"


def test_there_are_fourteen_or_more_notebooks_to_time():
    assert len(NOTEBOOKS) >= 14


def test_the_core_path_notebooks_exist():
    assert sorted(n.name[:2] for n in NOTEBOOKS if n.name[:2] in CORE_PATH) == list(CORE_PATH)


def test_every_graded_exercise_cell_names_an_exercise_with_a_reference_solution():
    for notebook in NOTEBOOKS:
        for cell in _cells(notebook):
            for name in CHECK.findall("".join(cell["source"])) if cell["cell_type"] == "code" else ():
                assert exercise_minutes(name) > MINUTES_PER_MISTAKE, f"{notebook.name}: {name}"


def test_solution_lines_skip_the_def_line_the_docstring_comments_and_blanks():
    def sample(x):
        """A docstring
        of two lines."""
        # a comment
        y = x + 1

        return y

    assert solution_lines(sample) == 2


def test_the_method_counts_prose_code_lines_cells_and_exercises():
    cells = [
        {"cell_type": "markdown", "source": ["word " * 400]},
        {"cell_type": "code", "source": ["a = 1\n", "\n", "b = 2\n"]},
        {"cell_type": "code", "source": ["result = batch_position.check(next_batch_ids)"]},
    ]
    expected = 2 + 3 / CODE_LINES_PER_MINUTE + 2 * MINUTES_PER_CODE_CELL + exercise_minutes("batch_position")
    assert method_minutes(cells) == pytest.approx(expected)


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


def _map_text() -> str:
    by_number = {n.name[:2]: n for n in NOTEBOOKS}
    return "".join("".join(c["source"]) for c in _cells(by_number["00"]) if c["cell_type"] == "markdown")


def test_notebook_00s_course_map_quotes_each_lesson_with_the_same_time():
    by_number = {n.name[:2]: n for n in NOTEBOOKS}
    rows = re.findall(r"^\| (\d\d) [^|]*\|[^|]*\| ([^|]+) \|", _map_text(), re.M)
    assert {number for number, _ in rows} >= set(CORE_PATH), rows
    for number, quoted in rows:
        assert quoted == table_time(by_number[number]), f"00's map, row {number}: {quoted}"


def test_notebook_00s_course_map_quotes_each_group_of_notebooks_as_the_sum_of_its_times():
    groups = re.findall(r"^\| (\d\d)-(\d\d) [^|]*\|[^|]*\| (\d+) min \|", _map_text(), re.M)
    assert len(groups) == 2, groups
    for first, last, quoted in groups:
        assert int(quoted) == group_minutes(int(first), int(last)), f"00's map, {first}-{last}"


@pytest.mark.parametrize("where", TABLES)
def test_the_core_and_full_path_totals_are_quoted_as_computed(where):
    text = (ROOT / where).read_text()
    assert f"core path (00, 01, 02, 03, 05): {hours(core_path_minutes())}" in text, where
    assert f"full path: {hours(full_path_minutes())}" in text, where


def test_notebook_00_states_the_core_and_full_path_in_its_header_and_its_map():
    start = "".join(_cells(NOTEBOOKS[0])[0]["source"])
    assert f"core path (00, 01, 02, 03, 05): about {hours(core_path_minutes())}" in start
    assert f"full path: about {hours(full_path_minutes())}" in start
    assert f"The core path is 00, 01, 02, 03 and 05, about\n{hours(core_path_minutes())}" in _map_text()
