"""Lesson 04's grader: the reference and the package pass; each plausible mistake fails with its reason."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path

import torch

import ckpt_lesson as cl
from ckpt_lesson.course import solutions
from ckpt_lesson.course.graders_index import check_write_shards
from ckpt_lesson.course.grading import PASS_MARK
from ckpt_lesson.course.shard_files import write_shards


def _fails(fn) -> str:
    result = check_write_shards(fn, verbose=False)
    assert result.attempted
    assert not result.passed
    assert result.first_failure
    return result.first_failure


def _shard_bytes(tensors) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def _durable_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(directory: Path, entries: list[dict]) -> None:
    tmp = directory / ".index.json.tmp"
    _durable_write(tmp, json.dumps({"shards": entries}).encode())
    os.replace(tmp, directory / "index.json")
    _fsync_dir(directory)


def _entry(name: str, data: bytes) -> dict:
    return {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_the_reference_solution_and_the_package_version_pass(capsys):
    assert check_write_shards(solutions.write_shards).passed
    assert capsys.readouterr().out.startswith(f"{PASS_MARK} write_shards (check_write_shards): all 4 cases")
    assert check_write_shards(write_shards, verbose=False).passed


def test_hashing_the_file_read_back_passes_too():
    def read_back(shards, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        entries = []
        for name, tensors in shards.items():
            torch.save(tensors, directory / name)
            with open(directory / name, "rb+") as f:
                os.fsync(f.fileno())
            entries.append(_entry(name, (directory / name).read_bytes()))
        _publish(directory, entries)

    assert check_write_shards(read_back, verbose=False).passed


def test_an_index_written_before_the_shards_fails():
    def index_first(shards, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        blobs = {name: _shard_bytes(t) for name, t in shards.items()}
        _publish(directory, [_entry(n, b) for n, b in blobs.items()])
        for name, data in blobs.items():
            _durable_write(directory / name, data)

    assert "appeared before model.shard-000.pt was complete" in _fails(index_first)


def test_an_index_written_in_place_fails():
    def in_place(shards, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        entries = []
        for name, tensors in shards.items():
            data = _shard_bytes(tensors)
            _durable_write(directory / name, data)
            entries.append(_entry(name, data))
        _durable_write(directory / "index.json", json.dumps({"shards": entries}).encode())

    assert "never renamed a temp file onto index.json" in _fails(in_place)


def test_shards_left_in_the_page_cache_fail():
    def no_shard_fsync(shards, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        entries = []
        for name, tensors in shards.items():
            data = _shard_bytes(tensors)
            (directory / name).write_bytes(data)
            entries.append(_entry(name, data))
        _publish(directory, entries)

    assert "was not fsynced before index.json" in _fails(no_shard_fsync)


def test_a_missing_directory_fsync_fails():
    def no_dir_fsync(shards, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        entries = []
        for name, tensors in shards.items():
            data = _shard_bytes(tensors)
            _durable_write(directory / name, data)
            entries.append(_entry(name, data))
        _durable_write(directory / ".tmp", json.dumps({"shards": entries}).encode())
        os.replace(directory / ".tmp", directory / "index.json")

    assert "did not fsync the directory" in _fails(no_dir_fsync)


def test_an_index_temp_file_in_another_directory_fails():
    def elsewhere(shards, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        entries = []
        for name, tensors in shards.items():
            data = _shard_bytes(tensors)
            _durable_write(directory / name, data)
            entries.append(_entry(name, data))
        fd, tmp = tempfile.mkstemp(dir=directory.parent)
        os.close(fd)
        _durable_write(Path(tmp), json.dumps({"shards": entries}).encode())
        os.replace(tmp, directory / "index.json")
        _fsync_dir(directory)

    assert "write the temp file in the same directory" in _fails(elsewhere)


def test_digests_of_the_tensors_instead_of_the_file_bytes_fail():
    def tensor_digest(shards, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        entries = []
        for name, tensors in shards.items():
            data = _shard_bytes(tensors)
            _durable_write(directory / name, data)
            raw = b"".join(t.numpy().tobytes() for t in tensors.values())
            entries.append({**_entry(name, data), "sha256": hashlib.sha256(raw).hexdigest()})
        _publish(directory, entries)

    assert "sha256 differs" in _fails(tensor_digest)


def test_swallowing_a_failed_shard_write_fails():
    def keeps_going(shards, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        entries = []
        for name, tensors in shards.items():
            data = _shard_bytes(tensors)
            try:
                _durable_write(directory / name, data)
            except OSError:
                continue  # "best effort": the index is written anyway
            entries.append(_entry(name, data))
        _publish(directory, entries)

    assert "index.json exists although model.shard-002.pt was never written" in _fails(keeps_going)


def test_a_failure_message_names_no_temp_path():
    def in_place(shards, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "index.json").write_text("{}")

    message = _fails(in_place)
    assert tempfile.gettempdir() not in message


def test_building_on_the_packages_public_atomic_writers_passes_too():
    def with_package_writers(shards, directory):
        directory = Path(directory)
        entries = []
        for name, tensors in shards.items():
            cl.atomic_save(tensors, directory / name)  # with its integrity footer: torch.load ignores it
            entries.append(_entry(name, (directory / name).read_bytes()))
        cl.atomic_write_json({"shards": entries}, directory / "index.json")

    assert check_write_shards(with_package_writers, verbose=False).passed


def test_an_index_temp_file_renamed_before_its_fsync_fails():
    def unsynced_index(shards, directory):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        entries = []
        for name, tensors in shards.items():
            data = _shard_bytes(tensors)
            _durable_write(directory / name, data)
            entries.append(_entry(name, data))
        (directory / ".index.tmp").write_text(json.dumps({"shards": entries}))
        os.replace(directory / ".index.tmp", directory / "index.json")
        _fsync_dir(directory)

    assert "the temp file of index.json was not fsynced before the rename" in _fails(unsynced_index)
