"""Every notebook's time comes from one stated method, and every place that quotes it agrees.

The method (notebooks/README.md, "Time"): reading at 200 words a minute, 1.25 minutes
to run and read each code cell, 10 minutes per graded exercise, rounded to the
nearest 5 minutes. It was calibrated once, against a careful learner's timed
walk-through of the whole course (issue 24: core 00-05 took 3-3.5 hours, everything
7-7.5 hours; the method, applied to those notebooks, gave 3 h 30 min and 7 h 10 min). The tests
recompute the estimate from the committed notebooks, so a notebook that grows changes its
time, and the header, the notebooks' README and the top-level README must follow.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CORE = ("00", "01", "02", "03", "04", "05")
WORDS_PER_MINUTE = 200
MINUTES_PER_CODE_CELL = 1.25
MINUTES_PER_EXERCISE = 10


def estimate_minutes(notebook: Path) -> int:
    """The stated method: words, code cells and graded exercises, rounded to 5 minutes."""
    cells = json.loads(notebook.read_text())["cells"]
    words = sum(len("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    exercises = sum(1 for s in code if re.search(r"^(result = )?\w+\.check\(", s, re.M))
    minutes = words / WORDS_PER_MINUTE + MINUTES_PER_CODE_CELL * len(code) + MINUTES_PER_EXERCISE * exercises
    return 5 * max(1, round(minutes / 5))


def _hours(minutes: int) -> str:
    return f"{minutes // 60} h {minutes % 60:02d} min"


def test_there_are_fourteen_or_more_notebooks_to_time():
    assert len(NOTEBOOKS) >= 14


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_header_states_the_time_the_method_gives(notebook):
    header = "".join(json.loads(notebook.read_text())["cells"][0]["source"])
    found = re.findall(r"\*\*Time:\*\* about (\d+) minutes", header)
    assert found == [str(estimate_minutes(notebook))], f"{notebook.name}: header says {found}"


@pytest.mark.parametrize("readme", ["notebooks/README.md", "README.md"])
def test_each_course_table_lists_every_notebook_with_the_same_time(readme):
    text = (ROOT / readme).read_text()
    for notebook in NOTEBOOKS:
        rows = [line for line in text.splitlines() if line.startswith(f"| [{notebook.stem}](")]
        assert len(rows) == 1, f"{readme}: one row for {notebook.stem}, found {len(rows)}"
        assert f"| {estimate_minutes(notebook)} min |" in rows[0], f"{readme}: {rows[0]}"


def test_the_core_and_full_path_totals_are_quoted_as_computed():
    core = sum(estimate_minutes(n) for n in NOTEBOOKS if n.name[:2] in CORE)
    everything = sum(estimate_minutes(n) for n in NOTEBOOKS)
    start = "".join(json.loads(NOTEBOOKS[0].read_text())["cells"][0]["source"])
    for where, text in [
        ("notebooks/README.md", (ROOT / "notebooks/README.md").read_text()),
        ("README.md", (ROOT / "README.md").read_text()),
    ]:
        assert f"core path 00-05: {_hours(core)}" in text, where
        assert f"whole course: {_hours(everything)}" in text, where
    assert f"core path 00-05: about {_hours(core)}" in start
