"""The notebooks use only public names: what a learner sees is what they will use.

A notebook that imports ``ckpt_lesson.faults.harness`` or a ``_private`` helper teaches
an API that may change without notice. These tests read the committed
``.ipynb`` files as JSON and look at every code cell; they execute nothing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def _code(notebook: Path) -> list[tuple[int, str]]:
    cells = json.loads(notebook.read_text())["cells"]
    return [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]


def test_there_are_notebooks_to_check():
    assert len(NOTEBOOKS) >= 14


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_notebook_reaches_into_the_command_line_modules(notebook):
    for i, source in _code(notebook):
        assert not re.search(r"\bckpt_lesson\.cli\b|from ckpt_lesson import cli\b|\bcli\.\w", source), (
            f"{notebook.name} cell {i}: use the public name (cl.run_command, cl.run_kill_sequence, ...)"
        )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_notebook_imports_or_calls_a_private_package_name(notebook):
    for i, source in _code(notebook):
        imported = re.findall(r"from ckpt_lesson[\w.]* import \(?([^)\n]*)", source)
        names = [n.strip().split(" as ")[0] for line in imported for n in line.split(",")]
        assert not [n for n in names if n.startswith("_")], f"{notebook.name} cell {i}: {names}"
        assert not re.search(r"\bcl\._(?!_)\w", source), f"{notebook.name} cell {i}: a private cl._ name"
