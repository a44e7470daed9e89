"""Every public result type prints as one short line, whatever its fields hold.

A ``Restored`` used to print the whole saved RNG state (about 15,000
characters); a ``TrainState`` every loss of the run.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import ckpt_lesson
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.short_repr import MAX_CHARS, short_repr

PUBLIC_DATACLASSES = sorted(
    (name, obj)
    for name in ckpt_lesson.__all__
    if inspect.isclass(obj := getattr(ckpt_lesson, name)) and dataclasses.is_dataclass(obj)
)

#: What a field may hold at its largest: RNG blocks, whole runs of losses, messages, long paths.
HOSTILE = {
    "an rng block": {"python": list(range(625)), "torch_cpu": torch.zeros(5056, dtype=torch.uint8),
                     "numpy": {"keys": list(range(624))}, "torch_cuda": []},
    "a tensor": torch.zeros(100, 100),
    "a long list": [0.5] * 10_000,
    "a message with newlines": "first line\nsecond line\n" * 500,
    "a deep path": Path("/tmp") / ("deep/" * 100) / "step-00000012",
    "many dicts": [{"step": i, "reason": "x" * 300} for i in range(50)],
}  # fmt: skip


def filled(cls: type, value) -> object:
    """An instance of ``cls`` with every field set to ``value`` (no constructor checks)."""
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        object.__setattr__(obj, f.name, value)
    return obj


def test_the_public_result_types_are_found():
    names = [name for name, _ in PUBLIC_DATACLASSES]
    assert {"Restored", "TrainState", "ScanResult", "FileDigest", "DistributedRestore"} <= set(names)


@pytest.mark.parametrize("name,cls", PUBLIC_DATACLASSES, ids=[n for n, _ in PUBLIC_DATACLASSES])
@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_every_public_result_type_reprs_on_one_short_line_whatever_its_fields_hold(name, cls, kind):
    text = repr(filled(cls, HOSTILE[kind]))
    assert "\n" not in text and len(text) <= MAX_CHARS < 200, text
    assert text.startswith(f"{name}(") and text.endswith(")")


def test_a_restored_from_a_real_restore_names_its_step_and_save_on_one_short_line(tmp_path):
    model = torch.nn.Linear(4, 4)
    mgr = CheckpointManager(tmp_path / "run", every_steps=1)
    mgr.save(3, {"model": model, "best": 0.25})
    restored = mgr.restore_latest({"model": model, "best": None})
    text = repr(restored)
    assert len(text) < 200 and "\n" not in text
    assert text.startswith("Restored(step=3, values={'best': 0.25}, rng=<dict of ")
    assert f"save_id='{restored.save_id}'" in text and "step-00000003'" in text
    assert len(str(restored.rng)) > 10_000  # the state is all there; only its repr is short
    mgr.close()


def test_small_values_print_as_they_are_and_defaults_are_left_out():
    assert repr(ckpt_lesson.KeepLastK(3)) == "KeepLastK(k=3)"
    assert repr(ckpt_lesson.ManagerConfig(every_steps=5)) == "ManagerConfig(every_steps=5)"
    assert repr(ckpt_lesson.TrainState()) == "TrainState()"
    state = ckpt_lesson.TrainState
    assert repr(state(step=300, losses=[0.5] * 300)) == "TrainState(step=300, losses=<list of 300>)"
    assert repr(state(step=2, losses=[0.5, 0.25])) == "TrainState(step=2, losses=[0.5, 0.25])"


def test_a_long_string_keeps_its_head_and_tail_and_fields_that_do_not_fit_become_an_ellipsis():
    @dataclasses.dataclass
    class Wide:
        a: str
        b: str
        c: str
        d: str
        e: str
        __repr__ = short_repr

    text = repr(Wide(*["/runs/" + "x" * 100 + f"/step-0000001{i}" for i in range(5)]))
    assert text.startswith("Wide(a='/runs/xxxxxxxxxxxxxx...xxxxxx/step-00000010', b=")
    assert text.endswith(", ...)") and len(text) <= MAX_CHARS
