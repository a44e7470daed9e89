"""``ckpt_lesson.__all__`` stays sorted, duplicate-free and importable (for every helper's names)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import ckpt_lesson


def test_all_is_sorted_the_way_python_sorts_strings():
    assert ckpt_lesson.__all__ == sorted(ckpt_lesson.__all__)


def test_all_has_no_duplicates():
    dupes = sorted({n for n in ckpt_lesson.__all__ if ckpt_lesson.__all__.count(n) > 1})
    assert dupes == []


@pytest.mark.parametrize("name", ckpt_lesson.__all__)
def test_every_exported_name_resolves(name):
    assert getattr(ckpt_lesson, name, None) is not None


def test_star_import_gives_exactly_the_exported_names():
    namespace: dict[str, object] = {}
    exec("from ckpt_lesson import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(ckpt_lesson.__all__)


PACKAGE = Path(ckpt_lesson.__file__).parent
MODULES = sorted(
    ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
    for p in PACKAGE.rglob("*.py")
    if p.name not in ("__init__.py", "__main__.py")
)


@pytest.mark.parametrize("module", MODULES)
def test_every_name_in_a_modules_all_exists(module):
    mod = importlib.import_module(f"ckpt_lesson.{module}")
    missing = [n for n in getattr(mod, "__all__", []) if not hasattr(mod, n)]
    assert missing == []


def test_the_data_position_for_a_plain_dataloader_is_exported():
    # issue 35: cl.resumable(DataLoader(...)) is the adoption path the README shows
    assert {"resumable", "ResumableLoader"} <= set(ckpt_lesson.__all__)
    assert ckpt_lesson.resumable.__module__ == "ckpt_lesson.runs.data_position"


@pytest.mark.parametrize("name", ckpt_lesson.__all__)
def test_every_exported_name_imports_by_name(name):
    namespace: dict[str, object] = {}
    exec(f"from ckpt_lesson import {name}", namespace)
    assert namespace[name] is getattr(ckpt_lesson, name)


def test_store_checkpoint_manager_stays_a_public_checkpoint_manager():
    # Code written against the bucket manager's own name keeps working whatever it becomes inside.
    from ckpt_lesson import CheckpointManager, StoreCheckpointManager

    assert "StoreCheckpointManager" in ckpt_lesson.__all__
    assert issubclass(StoreCheckpointManager, CheckpointManager)
