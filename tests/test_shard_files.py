"""Lesson 04's shard format: write_shards commits with index.json last; read_shards trusts nothing."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from ckpt_lesson.course.shard_files import INDEX_NAME, read_shards, write_shards
from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)

SHARDS = {
    "model.shard-000.pt": {"0.weight": torch.arange(12.0).reshape(3, 4), "2.weight": torch.ones(2, 3)},
    "model.shard-001.pt": {"0.bias": torch.zeros(3, dtype=torch.float64)},
}


def _index(directory):
    return json.loads((directory / INDEX_NAME).read_text())


def _rewrite_index(directory, change):
    index = _index(directory)
    change(index)
    (directory / INDEX_NAME).write_text(json.dumps(index))


def test_write_then_read_returns_every_tensor_bit_for_bit_and_the_index_records_the_file_bytes(tmp_path):
    write_shards(SHARDS, tmp_path / "ckpt")
    loaded = read_shards(tmp_path / "ckpt")
    assert list(loaded) == list(SHARDS)
    for name, tensors in SHARDS.items():
        for key, tensor in tensors.items():
            assert loaded[name][key].dtype == tensor.dtype
            assert torch.equal(loaded[name][key], tensor)
    for entry in _index(tmp_path / "ckpt")["shards"]:
        data = (tmp_path / "ckpt" / entry["file"]).read_bytes()
        assert (entry["bytes"], entry["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted([*SHARDS, INDEX_NAME])


def test_a_failed_shard_write_leaves_no_index_and_reads_as_an_unfinished_save(tmp_path):
    (tmp_path / "ckpt" / "model.shard-001.pt").mkdir(parents=True)  # the disk refuses this name
    with pytest.raises(CheckpointError):
        write_shards(SHARDS, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / INDEX_NAME).exists()
    with pytest.raises(IncompleteCheckpointError, match="no index.json; the save never finished"):
        read_shards(tmp_path / "ckpt")


def test_write_refuses_a_directory_that_already_holds_a_finished_save(tmp_path):
    write_shards(SHARDS, tmp_path / "ckpt")
    before = (tmp_path / "ckpt" / INDEX_NAME).read_bytes()
    with pytest.raises(CheckpointError, match="already holds index.json"):
        write_shards({"model.shard-000.pt": {"w": torch.zeros(1)}}, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / INDEX_NAME).read_bytes() == before


@pytest.mark.parametrize("name", ["../outside.pt", "/etc/passwd", "sub/x.pt", ".hidden.pt", INDEX_NAME, ""])
def test_write_refuses_a_name_that_is_not_a_plain_file_name_before_writing_anything(tmp_path, name):
    with pytest.raises(UnsafeCheckpointError, match="not a plain file name"):
        write_shards(
            {"model.shard-000.pt": {"w": torch.zeros(1)}, name: {"w": torch.ones(1)}}, tmp_path / "c"
        )
    assert not (tmp_path / "c").exists()


def test_read_refuses_a_flipped_bit_as_damage(tmp_path):
    write_shards(SHARDS, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.shard-000.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="model.shard-000.pt: sha256 differs"):
        read_shards(tmp_path / "ckpt")


def test_read_refuses_a_shard_cut_short_or_grown(tmp_path):
    write_shards(SHARDS, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.shard-001.pt"
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CorruptCheckpointError, match="bytes, index.json records"):
        read_shards(tmp_path / "ckpt")
    path.write_bytes(data + b"x")
    with pytest.raises(CorruptCheckpointError, match="larger than the"):
        read_shards(tmp_path / "ckpt")


def test_read_refuses_a_missing_shard_and_a_symlinked_one(tmp_path):
    write_shards(SHARDS, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.shard-001.pt"
    moved = tmp_path / "elsewhere.pt"
    os.replace(path, moved)
    with pytest.raises(CorruptCheckpointError, match="listed in index.json but missing"):
        read_shards(tmp_path / "ckpt")
    path.symlink_to(moved)
    with pytest.raises(CorruptCheckpointError, match="a symlink, not a regular file"):
        read_shards(tmp_path / "ckpt")


@pytest.mark.parametrize("name", ["../outside.pt", "/etc/passwd", "sub/../model.shard-000.pt"])
def test_read_refuses_an_index_entry_that_leads_outside_the_directory(tmp_path, name):
    write_shards(SHARDS, tmp_path / "ckpt")
    _rewrite_index(tmp_path / "ckpt", lambda index: index["shards"][0].update(file=name))
    with pytest.raises(UnsafeCheckpointError, match="not a plain file name"):
        read_shards(tmp_path / "ckpt")


@pytest.mark.parametrize(
    "text", ["{", "[]", '{"shards": 3}', '{"shards": [{"file": "a.pt"}]}', "[" * 100_000, '{"shards": [NaN]}']
)
def test_read_refuses_a_damaged_index(tmp_path, text):
    write_shards(SHARDS, tmp_path / "ckpt")
    (tmp_path / "ckpt" / INDEX_NAME).write_text(text)
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        read_shards(tmp_path / "ckpt")


def test_read_unpickles_nothing_beyond_tensors_even_with_a_matching_digest(tmp_path):
    directory = tmp_path / "ckpt"
    write_shards(SHARDS, directory)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = directory / "model.shard-001.pt"
    torch.save({"w": Payload()}, path)
    data = path.read_bytes()
    _rewrite_index(
        directory,
        lambda index: index["shards"][1].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest()),
    )
    with pytest.raises(CorruptCheckpointError, match="does not load"):
        read_shards(directory)
    assert not marker.exists()


def test_read_refuses_a_shard_that_is_not_a_dict_of_tensors(tmp_path):
    directory = tmp_path / "ckpt"
    write_shards(SHARDS, directory)
    path = directory / "model.shard-000.pt"
    torch.save({"w": "not a tensor"}, path)
    data = path.read_bytes()
    _rewrite_index(
        directory,
        lambda index: index["shards"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest()),
    )
    with pytest.raises(CorruptCheckpointError, match="not a dict of named tensors"):
        read_shards(directory)
