"""Parts verified in memory (a restore from a bucket) get every check a file gets, except a second hash.

``load_verified_file`` takes a :class:`VerifiedBytes` as well as a path. These
tests hold it to the file's rules: the same digest and footer verdict, and the
same refusals of crafted archives and pickles, before ``torch.load`` runs.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
from test_hostile_inputs import compressed_copy, zero_linear

from ckpt_lesson.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckpt_lesson.files.checkpoint import TrainState, read_checkpoint, save_checkpoint
from ckpt_lesson.files.hashing import digest_bytes
from ckpt_lesson.files.integrity import FOOTER_MAGIC, verify_footer
from ckpt_lesson.files.loading import load_verified_file
from ckpt_lesson.files.verified_bytes import VerifiedBytes


def _saved(tmp_path, n=8):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(
        zero_linear(n), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]), None, TrainState(step=5), path
    )
    return path


def _in_memory(data: bytes, algo: str = "xxh3_128") -> VerifiedBytes:
    """What the store restore builds once the streamed bytes matched their record."""
    return VerifiedBytes(
        data, "s3://bucket/run/step-00000005/x/checkpoint.pt", algo, digest_bytes(data, algo)
    )


def test_bytes_in_memory_give_the_same_digest_verdict_and_payload_as_the_file(tmp_path):
    path = _saved(tmp_path)
    with open(path, "rb") as f:
        on_disk = verify_footer(f, name=path, algo="sha256")
    part = _in_memory(path.read_bytes(), algo="sha256")
    loaded, digest = load_verified_file(part, expected_size=on_disk.size, expected_digest=on_disk.digest)
    assert digest == on_disk and digest.has_footer
    from_file = read_checkpoint(path)
    from_memory = read_checkpoint(part, expected_digest=on_disk.digest, algo="sha256", mmap_model=True)
    assert from_memory["state"] == from_file["state"] == loaded["state"]
    assert torch.equal(from_memory["model"]["weight"], from_file["model"]["weight"])


def test_bytes_in_memory_that_differ_from_the_record_are_damage_without_loading(tmp_path):
    part = _in_memory(_saved(tmp_path).read_bytes())
    with pytest.raises(CorruptCheckpointError, match="recorded"):
        load_verified_file(part, expected_size=part.size + 1)
    with pytest.raises(CorruptCheckpointError, match="does not match the recorded"):
        load_verified_file(part, expected_digest="0" * len(part.digest), algo="xxh3_128")
    # A record in another algorithm than the stream's is compared by hashing once in that algorithm.
    with pytest.raises(CorruptCheckpointError, match="does not match the recorded"):
        load_verified_file(part, expected_sha256="0" * 64)


def test_a_damaged_footer_in_memory_is_damage(tmp_path):
    data = bytearray(_saved(tmp_path).read_bytes())
    data[data.rfind(FOOTER_MAGIC)] ^= 0xFF  # the footer's magic: two of its three marks left, so "damaged"
    with pytest.raises(CorruptCheckpointError, match="footer"):
        load_verified_file(_in_memory(bytes(data)))


def test_a_compressed_archive_in_memory_is_refused_before_loading_even_with_a_matching_digest(tmp_path):
    bomb = tmp_path / "bomb.pt"
    compressed_copy(_saved(tmp_path, n=256), bomb)
    with pytest.raises(CorruptCheckpointError, match="compressed"):
        load_verified_file(_in_memory(bomb.read_bytes()))


def test_a_hostile_pickle_in_memory_is_refused_by_the_weights_only_load(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    with pytest.raises(UnsafeCheckpointError, match=r"(posix|nt)\.system"):
        load_verified_file(_in_memory(buf.getvalue()))
