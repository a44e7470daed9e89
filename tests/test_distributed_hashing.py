"""Tagged hash records: one function picks the algorithm, every record names it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import xxhash

from ckpt_lesson import CorruptCheckpointError
from ckpt_lesson.files.hashing import DEFAULT_ALGO, check_hash_record, hash_bytes, hash_file, new_hasher


def test_the_default_algorithm_is_xxh3_128_and_matches_the_xxhash_package() -> None:
    assert DEFAULT_ALGO == "xxh3_128"
    assert hash_bytes(b"checkpoint") == {
        "algo": "xxh3_128",
        "digest": xxhash.xxh3_128(b"checkpoint").hexdigest(),
    }


def test_sha256_records_match_hashlib() -> None:
    assert hash_bytes(b"abc", "sha256")["digest"] == hashlib.sha256(b"abc").hexdigest()


def test_an_unknown_algorithm_is_refused_by_name() -> None:
    with pytest.raises(CorruptCheckpointError, match="unknown hash algorithm 'md5'"):
        new_hasher("md5")


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_hashing_a_file_in_chunks_equals_hashing_its_bytes(tmp_path: Path, algo: str) -> None:
    data = os.urandom((4 << 20) + 123)  # more than one chunk
    (tmp_path / "f").write_bytes(data)
    assert hash_file(tmp_path / "f", algo) == (len(data), hash_bytes(data, algo))


def test_hash_file_refuses_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        hash_file(tmp_path / "link")


def test_hash_file_refuses_a_fifo_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        hash_file(tmp_path / "pipe")


@pytest.mark.parametrize(
    "record",
    [
        "deadbeef",
        {"algo": "xxh3_128"},
        {"algo": "xxh3_128", "digest": "0" * 31},
        {"algo": "sha256", "digest": "0" * 32},
        {"algo": "xxh3_128", "digest": "0x" + "0" * 30},
        {"algo": "xxh3_128", "digest": "A" * 32},
        {"algo": "md5", "digest": "0" * 32},
        {"digest": "0" * 32},
    ],
)
def test_malformed_hash_records_are_refused(record: object) -> None:
    with pytest.raises(CorruptCheckpointError):
        check_hash_record(record, where="manifest.json")


def test_a_well_formed_record_passes_unchanged() -> None:
    record = hash_bytes(b"x")
    assert check_hash_record(record, where="m") == record


def test_without_the_xxhash_package_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from ckpt_lesson.errors import CheckpointError

    monkeypatch.setitem(sys.modules, "xxhash", None)  # makes `import xxhash` fail
    with pytest.raises(CheckpointError, match="pip install xxhash"):
        new_hasher("xxh3_128")
    assert len(new_hasher("sha256").hexdigest()) == 64
