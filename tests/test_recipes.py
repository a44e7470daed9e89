"""Each recipe on docs/your-loop.md changes at most 5 lines of the loop it starts from.

A recipe is an ``examples/`` script (which passes ``resume-test``: tests/test_examples_loops.py)
and the same loop before ckpt_lesson, kept in ``examples/before/``. A changed line is a ``+`` or
``-`` line of their unified diff, so a modified line counts 2. Left out of both sides: the module
docstring (it describes the file, not the loop) and, in the example, the lines marked
``# MISTAKE`` (the negative control's switch, which no user copies).
"""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PAGE = ROOT / "docs" / "your-loop.md"
MAX_CHANGED = 5
#: example -> the loop it starts from
LOOPS = ("loop_amp.py", "loop_ddp.py", "loop_epochs.py", "loop_gan.py", "loop_gpt.py", "loop_lstm.py",
         "resume_hf.py", "resume_lightning.py")  # fmt: skip
RECIPES = {name: f"before/{name}" for name in LOOPS}


def code_lines(source: str) -> list[str]:
    """The lines a recipe is measured on: no module docstring, no ``# MISTAKE`` lines."""
    tree = ast.parse(source)
    lines = source.splitlines()
    first = tree.body[0] if tree.body else None
    if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
        del lines[first.lineno - 1 : first.end_lineno]
    return [line for line in lines if "# MISTAKE" not in line]


def recipe_diff(before: str, after: str) -> list[str]:
    """The unified diff (one line of context), hunks separated by ``...``, without file headers."""
    out = []
    for line in difflib.unified_diff(code_lines(before), code_lines(after), lineterm="", n=1):
        if line.startswith(("---", "+++")):
            continue
        out.append("..." if line.startswith("@@") else line)
    return out


def changed_lines(diff: list[str]) -> int:
    return sum(1 for line in diff if line.startswith(("+", "-")))


def read(name: str) -> str:
    return (EXAMPLES / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("example", sorted(RECIPES))
def test_each_recipe_changes_at_most_five_lines_of_the_loop_it_starts_from(example):
    diff = recipe_diff(read(RECIPES[example]), read(example))
    assert 0 < changed_lines(diff) <= MAX_CHANGED, "\n".join(diff)


@pytest.mark.parametrize("example", sorted(RECIPES))
def test_the_docs_page_states_each_recipes_count_as_the_diff_has_it(example):
    count = changed_lines(recipe_diff(read(RECIPES[example]), read(example)))
    page = PAGE.read_text(encoding="utf-8")
    assert f"| `examples/{example}` | {count} |" in page, f"docs/your-loop.md: {example} changes {count}"


@pytest.mark.parametrize("example", sorted(RECIPES))
def test_the_docs_page_shows_each_recipes_diff_as_it_is_now(example):
    diff = "\n".join(recipe_diff(read(RECIPES[example]), read(example)))
    page = PAGE.read_text(encoding="utf-8")
    assert f"```diff\n{diff}\n```" in page, f"docs/your-loop.md: regenerate the diff of {example}:\n{diff}"
    assert f"`examples/{example}`" in page


@pytest.mark.parametrize("example", sorted(RECIPES))
def test_each_before_loop_uses_ckpt_lesson_only_to_log_its_steps(example):
    # The starting point is a loop without checkpointing: log_step is resume-test's reporting.
    uses = set(re.findall(r"\bcl\.(\w+)", "\n".join(code_lines(read(RECIPES[example])))))
    assert uses == {"log_step"}


def test_a_modified_line_counts_twice_and_mistake_lines_and_docstrings_are_left_out():
    before = '"""Before."""\nx = 1\ny = 2\nz = 3\n'
    after = '"""After, longer.\n\nTwo paragraphs."""\nx = 1\ny = 20\nz = 3\nw = 4  # MISTAKE: control\n'
    diff = recipe_diff(before, after)
    assert diff == ["...", " x = 1", "-y = 2", "+y = 20", " z = 3"]
    assert changed_lines(diff) == 2
    six = recipe_diff("a = 1\n", "a = 2\nb = 3\nc = 4\nd = 5\ne = 6\n")
    assert changed_lines(six) == 6 > MAX_CHANGED  # what the recipe test would refuse
