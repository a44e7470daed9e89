"""Predictions stay hidden until run: every "predict, then run" cell opens with its output collapsed.

The notebooks are committed executed (nbval compares their outputs), so without this the answer
to every prediction would be on screen when a notebook opens. A cell that asks for a prediction
starts with the marker comment below and carries ``"jupyter": {"outputs_hidden": true}`` (read
by JupyterLab, which shows the output again once the cell runs) and ``"collapsed": true`` (the
same for the classic notebook). nbval ignores both, which the last test checks on a real kernel.
JupyterLab 4 still previews the first non-empty line of a hidden output, so that line is a
neutral one, printed first by the cell, never part of the answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
MARKER = "# Predict, then run"
FIRST_LINE = "(the answer; compare it with your prediction)"
# 10's cells are being reworked on another branch (ci32); its predictions get the marker there.
NOT_YET = {"10_test_resume_before_spot.ipynb"}


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def marked(cell: dict) -> bool:
    return cell["cell_type"] == "code" and any(line.startswith(MARKER) for line in cell["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_predict_then_run_cell_opens_with_its_output_hidden(path):
    for index, cell in enumerate(cells(path)):
        if marked(cell):
            where = f"{path.name} cell {index}"
            assert cell["metadata"].get("jupyter", {}).get("outputs_hidden") is True, where
            assert cell["metadata"].get("collapsed") is True, where
            assert cell["outputs"], f"{where}: nbval needs the stored output it compares"
            first = cell["outputs"][0]
            text = "".join(first.get("text", "")) or "".join(first.get("data", {}).get("text/plain", ""))
            preview = next((line for line in text.split("\n") if line), None)
            assert preview == FIRST_LINE, f"{where}: JupyterLab would preview {preview!r}"


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name not in NOT_YET], ids=lambda p: p.stem)
def test_every_prediction_asked_in_prose_is_answered_by_a_marked_cell(path):
    notebook = cells(path)
    for index, cell in enumerate(notebook):
        text = "".join(cell["source"])
        if cell["cell_type"] != "markdown" or "**Predict" not in text:
            continue
        following = next((c for c in notebook[index + 1 :] if c["cell_type"] == "code"), None)
        assert following is not None and marked(following), f"{path.name}: the cell after markdown {index}"


def test_the_core_path_predictions_named_in_issue_36_are_hidden():
    by_name = {p.stem: cells(p) for p in NOTEBOOKS}
    # The issue named 01 c3, 02 c3 and c10, 03 c8, 05 c9; the same predictions sit here since the
    # core parts were cut to fit 90 minutes (the package's versions moved to "Going further").
    for stem, index in [
        ("01_rng_capture", 3),
        ("02_atomic_saves", 3),
        ("02_atomic_saves", 7),
        ("03_full_round_trip", 5),
        ("05_mid_epoch_resume", 7),
    ]:
        assert marked(by_name[stem][index]), (stem, index)


def _notebook(stored: str) -> dict:
    cell = {
        "cell_type": "code",
        "execution_count": 1,
        "id": "c1",
        "metadata": {"collapsed": True, "jupyter": {"outputs_hidden": True}},
        "outputs": [{"name": "stdout", "output_type": "stream", "text": [stored]}],
        "source": [f"{MARKER}: hidden.\n", "print(6 * 7)\n"],
    }
    kernel = {"display_name": "Python 3", "language": "python", "name": "python3"}
    return {"cells": [cell], "metadata": {"kernelspec": kernel}, "nbformat": 4, "nbformat_minor": 5}


def test_nbval_still_compares_a_cell_whose_output_is_hidden(tmp_path):
    outcomes = {}
    for label, stored in (("right", "42\n"), ("wrong", "41\n")):
        path = tmp_path / f"{label}.ipynb"
        path.write_text(json.dumps(_notebook(stored)))
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
             "--nbval", "--nbval-current-env", "--nbval-cell-timeout=120", path.name],
            cwd=tmp_path, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        outcomes[label] = run.returncode
    assert outcomes == {"right": 0, "wrong": 1}
