"""``ckpt_lesson`` serves the distributed names lazily, so a plain import stays cheap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import ckpt_lesson

ROOT = Path(__file__).resolve().parent.parent


def test_importing_ckpt_lesson_does_not_load_torch_distributed_checkpoint() -> None:
    # A fresh interpreter: this pytest process may have imported DCP already.
    code = (
        "import sys, ckpt_lesson\n"
        "print('torch.distributed.checkpoint' in sys.modules)\n"
        "ckpt_lesson.DistributedCheckpointManager\n"
        "print('torch.distributed.checkpoint' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    ).stdout.split()
    assert out == ["False", "True"]


def test_the_lazy_names_are_the_distributed_sub_packages_own() -> None:
    from ckpt_lesson import distributed

    assert ckpt_lesson.DistributedCheckpointManager is distributed.DistributedCheckpointManager
    assert ckpt_lesson.DistributedRestore is distributed.DistributedRestore


def test_an_unknown_attribute_still_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        ckpt_lesson.NoSuchThing  # noqa: B018
