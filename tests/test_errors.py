"""The exception hierarchy: one base class, every subclass a ValueError too."""

from __future__ import annotations

import pytest

from ckpt_lesson import errors
from ckpt_lesson.errors import CheckpointError

SUBCLASSES = [getattr(errors, name) for name in errors.__all__ if name != "CheckpointError"]


def test_checkpoint_error_is_a_value_error_so_existing_handlers_still_catch_it():
    assert issubclass(CheckpointError, ValueError)


@pytest.mark.parametrize("cls", SUBCLASSES, ids=lambda c: c.__name__)
def test_every_specific_error_is_caught_by_except_checkpoint_error(cls):
    with pytest.raises(CheckpointError, match="names the file"):
        raise cls("ckpt.pt: names the file")


def test_the_module_exports_seven_distinct_subclasses():
    assert len(set(SUBCLASSES)) == 7
    assert all(cls is not CheckpointError and issubclass(cls, CheckpointError) for cls in SUBCLASSES)
