"""Top-level keys of a checkpoint's pickle: last assignment wins, as in torch.load; the walk is bounded."""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from pathlib import Path

import torch

from ckpt_lesson.runs.lightning_files import inspect_lightning_file, read_epoch_and_step
from ckpt_lesson.runs.pickle_keys import WALK_BUDGET_BYTES, read_top_level_ints

KEYS = ("epoch", "global_step")
STEP_KEY = b"X\x0b\x00\x00\x00global_stepq\x02K\x05"  # torch.save's spelling of "global_step": 5, memo slot 2


def ckpt_with_pickle(path: Path, edit) -> Path:
    """A real torch.save archive of a Lightning-like dict, its data.pkl rewritten by ``edit``."""
    buf = io.BytesIO()
    torch.save({"epoch": 3, "global_step": 5, "state_dict": {"w": torch.arange(4.0)}}, buf)
    buf.seek(0)
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("/data.pkl"):
                assert STEP_KEY in data
                data = edit(data)
            dst.writestr(info.filename, data)
    return path


def loaded_step(path: Path) -> int:
    return torch.load(path, weights_only=True)["global_step"]


def test_a_key_repeated_in_one_setitems_batch_resolves_to_the_last_value_like_torch_load(tmp_path):
    # ("global_step", 999999) then the same key again (a memo fetch) with 5: torch.load keeps 5.
    dup = STEP_KEY.replace(b"K\x05", b"J" + struct.pack("<i", 999999) + b"h\x02K\x05")
    path = ckpt_with_pickle(tmp_path / "dup.ckpt", lambda d: d.replace(STEP_KEY, dup))
    with open(path, "rb") as f:
        assert read_epoch_and_step(f) == (3, loaded_step(path)) == (3, 5)
    assert inspect_lightning_file(path).step == 5


def test_a_key_set_again_after_the_batch_is_seen_although_the_walk_could_stop_early(tmp_path):
    # A SETITEM just before STOP: global_step becomes 999999 in what torch.load returns.
    late = b"h\x02J" + struct.pack("<i", 999999) + b"s."
    path = ckpt_with_pickle(tmp_path / "late.ckpt", lambda d: d[:-1] + late)
    with open(path, "rb") as f:
        assert read_epoch_and_step(f) == (3, loaded_step(path)) == (3, 999999)


def test_a_repeated_key_whose_last_value_is_not_an_int_is_unknown():
    data = pickle.dumps({"epoch": 1}, protocol=2)[:-1] + b"X\x05\x00\x00\x00epochX\x01\x00\x00\x00xs."
    assert pickle.loads(data) == {"epoch": "x"}
    assert read_top_level_ints(data, KEYS) == {"epoch": None}


def test_the_walk_stops_at_the_keys_it_needs_when_the_rest_cannot_change_them():
    head = pickle.dumps({"epoch": 3, "global_step": 12, "state": [0]}, protocol=2)
    # Bytes after the keys that are not even valid opcodes: only an early stop can give an answer.
    data = head[: head.index(b"X\x05\x00\x00\x00state")] + b"\xff" * 1000
    assert read_top_level_ints(data, KEYS) == {"epoch": 3, "global_step": 12}


def test_keys_beyond_the_walk_budget_are_unknown_instead_of_an_unbounded_walk():
    filler = list(range(WALK_BUDGET_BYTES // 4))
    data = pickle.dumps({"filler": filler, "epoch": 3, "global_step": 12}, protocol=2)
    assert len(data) > WALK_BUDGET_BYTES
    assert read_top_level_ints(data, KEYS) == {}
    small = pickle.dumps({"filler": filler[:1000], "epoch": 3, "global_step": 12}, protocol=2)
    assert read_top_level_ints(small, KEYS) == {"epoch": 3, "global_step": 12}


def test_opcodes_outside_the_weights_only_set_give_unknown_never_a_guess():
    data = pickle.dumps({"epoch": 3, "global_step": 12}, protocol=2)
    data = data[:-1] + b"X\x0b\x00\x00\x00global_step2" + b"0s."  # DUP / POP: not weights-only opcodes
    assert read_top_level_ints(data, KEYS) == {}
