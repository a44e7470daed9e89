"""docs/guarantees.md shows the contract suite as it is: every guarantee, every path, counts and skips."""

from __future__ import annotations

import inspect
from pathlib import Path

import test_guarantees
from table import GUARANTEES, render

DOCS = Path(__file__).resolve().parents[2] / "docs" / "guarantees.md"
START, END = "<!-- contract-table:start -->\n", "<!-- contract-table:end -->"


def test_the_table_in_the_docs_is_the_one_the_suite_gives():
    text = DOCS.read_text()
    committed = text[text.index(START) + len(START) : text.index(END)]
    assert committed == render(), "run: PYTHONPATH=$PWD python tests/contract/table.py, paste into docs"


def test_every_guarantee_test_is_a_row_of_the_table_and_every_row_a_test():
    tests = {n for n, f in inspect.getmembers(test_guarantees, inspect.isfunction) if n.startswith("test_")}
    assert tests == {name for _, _, name in GUARANTEES}
