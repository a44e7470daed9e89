"""verify_on_save's two checks: "writer" (sizes; the digest came from the bytes written) and
"device" (evict the cached pages, then hash what the disk returns).

Parts verified in memory (a restore from a bucket) get every check a file gets, except a second
hash: ``load_verified_file`` takes a :class:`VerifiedBytes` as well as a path, and is held to the
file's rules: the same digest and footer verdict, and the same refusals of crafted archives and
pickles, before ``torch.load`` runs.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from test_hostile_inputs import compressed_copy, zero_linear

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from ckpt_lesson.files.checkpoint import TrainState, read_checkpoint, save_checkpoint
from ckpt_lesson.files.hashing import DEFAULT_ALGO, digest_bytes
from ckpt_lesson.files.integrity import FOOTER_MAGIC, verify_footer
from ckpt_lesson.files.loading import load_verified_file
from ckpt_lesson.files.verify import VerifiedBytes, check_written_part, drop_cached_pages, verify_mode
from ckpt_lesson.runs.manager import CheckpointManager


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def record_of(path: Path) -> dict:
    blob = path.read_bytes()
    return {
        "file": path.name,
        "bytes": len(blob),
        "algo": DEFAULT_ALGO,
        "digest": digest_bytes(blob, DEFAULT_ALGO),
    }


def staging_hook(tmp_path: Path, damage):
    def hook(name: str, info: dict) -> None:
        if name == "manifest_written":
            [staging] = [p for p in tmp_path.iterdir() if p.name.startswith(".staging-")]
            damage(staging / "checkpoint.pt")

    return hook


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1)


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_on_save_accepts_writer_device_true_and_false_and_refuses_anything_else(tmp_path):
    assert [verify_mode(v) for v in ("writer", "device", True, False)] == ["writer", "device", "device", None]
    with pytest.raises(CheckpointError, match="verify_on_save must be"):
        verify_mode("yes")
    with pytest.raises(CheckpointError, match="verify_on_save must be"):
        CheckpointManager(tmp_path, every_steps=1, verify_on_save="always")


@pytest.mark.parametrize("mode", ["writer", "device"])
def test_both_checks_catch_a_part_cut_short_before_publishing(tmp_path, mode):
    model, opt = tiny()
    mgr = CheckpointManager(
        tmp_path, every_steps=1, verify_on_save=mode, on_event=staging_hook(tmp_path, truncate)
    )
    with pytest.raises(CorruptCheckpointError, match="size"):
        mgr.save(model, opt, None, TrainState(step=1))
    assert list(tmp_path.iterdir()) == []


def test_the_writer_check_does_not_read_the_bytes_back_so_a_same_size_change_gets_through(tmp_path):
    # The documented limit of the cheap default: it checks our writer, not the disk; the retention
    # re-hash (runs/reverify.py) or a "device" check is what sees changed bytes.
    model, opt = tiny()
    mgr = CheckpointManager(tmp_path, every_steps=1, on_event=staging_hook(tmp_path, flip))
    mgr.save(model, opt, None, TrainState(step=1))
    assert not mgr.verify_step(1).ok


def test_the_device_check_rereads_after_dropping_the_cached_pages(tmp_path):
    path = tmp_path / "part.bin"
    path.write_bytes(b"x" * 100_000)
    part = record_of(path)
    drop_cached_pages(path)  # clean or not, the call must succeed on a regular file
    assert check_written_part(path, part, "device") is None
    flip(path)
    assert "!= recorded" in check_written_part(path, part, "device")
    assert check_written_part(path, part, "writer") is None  # same size: the writer check passes


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
