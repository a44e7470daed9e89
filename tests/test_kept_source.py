"""A learner's function written out as source keeps every global it reads, or says which it cannot.

Each learner function here is defined the way a notebook cell defines it: in a
namespace named ``__main__``, compiled from a file that ``inspect`` (through
``linecache``) can read, as IPython does with every cell.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import torch

from ckpt_lesson.course.kept_source import function_source, kept_source


def learner_cell(tmp_path: Path, source: str) -> dict[str, Any]:
    path = tmp_path / "cell.py"
    path.write_text(textwrap.dedent(source))
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace


def run_alone(text: str) -> dict[str, Any]:
    """Run kept source in a fresh namespace, as the next notebook does."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(text, "kept.py", "exec"), namespace)
    return namespace


def test_tuple_list_dict_set_and_regex_constants_are_kept_and_work_alone(tmp_path):
    cell = learner_cell(
        tmp_path,
        """
        import re
        BUCKET_NAMES = ("model", "optimizer", "scheduler", "state", "rng")
        ORDER = ["model", "optimizer"]
        RENAMES = {"opt": "optimizer", "sched": ("scheduler", 1)}
        REQUIRED = {"model", "state"}
        NOTHING = set()
        STEP = re.compile(r"step-(\\d+)\\.pt", re.IGNORECASE)

        def describe(name):
            step = int(STEP.fullmatch(name).group(1))
            return BUCKET_NAMES[:2], ORDER[-1], RENAMES["sched"], sorted(REQUIRED | NOTHING), step
        """,
    )
    kept = kept_source(cell["describe"])
    assert kept.missing == ()
    for line in ("BUCKET_NAMES = (", "ORDER = [", "RENAMES = {", "REQUIRED = {", "NOTHING = set()"):
        assert line in kept.text
    (tmp_path / "cell.py").unlink()  # the cell is gone; the kept text stands alone
    alone = run_alone(kept.text)["describe"]
    assert alone("STEP-7.pt") == cell["describe"]("step-7.pt")
    assert alone("STEP-7.pt") == (
        ("model", "optimizer"),
        "optimizer",
        ("scheduler", 1),
        ["model", "state"],
        7,
    )


def test_an_attribute_named_like_a_dunder_global_copies_nothing(tmp_path):
    cell = learner_cell(
        tmp_path,
        """
        def name_of(exc):
            return type(exc).__name__
        """,
    )
    text = function_source(cell["name_of"])
    assert "__name__ =" not in text and "__main__" not in text
    assert run_alone(text)["name_of"](KeyError()) == "KeyError"


def test_globals_in_the_def_line_defaults_and_annotations_are_kept(tmp_path):
    cell = learner_cell(
        tmp_path,
        """
        from pathlib import Path
        LIMIT = 3

        def first(items, n=LIMIT) -> Path:
            return Path(items[0]).with_suffix(".pt"), n
        """,
    )
    text = function_source(cell["first"])
    assert run_alone(text)["first"](["a"]) == (Path("a.pt"), 3)


def test_values_that_print_as_python_are_rebuilt_and_others_come_as_the_learners_statement(tmp_path):
    cell = learner_cell(
        tmp_path,
        """
        from pathlib import Path
        import torch
        HOME = Path("runs") / "a"
        DTYPE = torch.float64
        SCALE = torch.full((3,), 2.0)

        class Config:
            def __init__(self, k):
                self.k = k

        CONFIG = Config(k=4)

        def scaled(x):
            return (x.to(DTYPE) * SCALE).tolist(), CONFIG.k, HOME.as_posix()
        """,
    )
    kept = kept_source(cell["scaled"])
    assert kept.missing == ()
    assert "SCALE = torch.full((3,), 2.0)" in kept.text and "class Config:" in kept.text
    (tmp_path / "cell.py").unlink()
    assert run_alone(kept.text)["scaled"](torch.ones(3)) == ([2.0, 2.0, 2.0], 4, "runs/a")


def test_a_global_with_no_statement_and_no_python_form_is_reported_missing(tmp_path):
    cell = learner_cell(
        tmp_path,
        """
        import threading
        globals()["GUARD"] = threading.Lock()

        def guarded():
            with GUARD:
                return 1
        """,
    )
    assert kept_source(cell["guarded"]).missing == ("GUARD (a lock)",)


def test_a_statement_from_ipythons_input_history_is_found_when_the_cell_is_another(tmp_path):
    cell = learner_cell(tmp_path, "def total():\n    return float(WEIGHTS.sum())\n")
    cell["WEIGHTS"] = torch.ones(4)  # defined in an earlier cell
    cell["_ih"] = ["", "import torch\nWEIGHTS = torch.ones(4)\n", "def total(): ..."]
    cell["torch"] = torch
    text = function_source(cell["total"])
    assert "WEIGHTS = torch.ones(4)" in text and "import torch as torch" in text
    assert run_alone(text)["total"]() == 4.0
