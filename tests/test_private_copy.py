"""A restore loads exactly the bytes it verified, even when the file is rewritten in between.

The attack (issue 33, item 7): the restore hashes a ``.pt`` file, then ``torch.load``
reads it again; another process rewrites it in place between the two, and the
restore loaded 7.0 where the verified file said 1.0, mapped or not.

The seam is the real code path's own call of ``torch.load``, seen by a profiling
hook (``sys.setprofile``, as a debugger would see it), with Python's audit hook
naming the last ``.pt`` file the restore opened: at the moment the load starts,
that file, already hashed, is rewritten in place (same inode, same size). Nothing
of the library is replaced. The restore must give the verified 1.0 or refuse.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from pathlib import Path

import pytest
import torch

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import save_checkpoint
from ckpt_lesson.files.integrity import file_digest, verify_footer
from ckpt_lesson.files.mapped_restore import FreshMemory
from ckpt_lesson.files.private_copy import PrivateCopy, private_buffer
from ckpt_lesson.runs.manager import CheckpointManager

ONE, SEVEN = struct.pack("<f", 1.0) * 16, struct.pack("<f", 7.0) * 16
_opened: list[str] = []  # .pt files opened, in order (the audit hook cannot be removed: it checks a flag)
_watching = threading.Event()


def _audit(event: str, args: tuple) -> None:
    if _watching.is_set() and event == "open" and isinstance(args[0], (str, os.PathLike)):
        if str(args[0]).endswith(".pt"):
            _opened.append(str(args[0]))


sys.addaudithook(_audit)


class RewriteAtLoad:
    """Rewrites the last opened ``.pt`` file in place whenever ``torch.load`` is entered."""

    def __init__(self) -> None:
        self.rewritten: list[str] = []

    def _hook(self, frame, event, arg) -> None:
        if event == "call" and frame.f_code is torch.serialization.load.__code__ and _opened:
            path = Path(_opened[-1])
            data = path.read_bytes()
            if ONE in data:
                with open(path, "r+b") as f:  # in place: the same inode, the same size
                    f.write(data.replace(ONE, SEVEN))
                    f.flush()
                    os.fsync(f.fileno())
                self.rewritten.append(path.name)

    def __enter__(self) -> RewriteAtLoad:
        _opened.clear()
        _watching.set()
        sys.setprofile(self._hook)
        threading.setprofile(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        threading.setprofile(None)
        _watching.clear()


def ones_model(width: int = 16) -> torch.nn.Module:
    model = torch.nn.Linear(width, width)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    return model


@pytest.mark.parametrize("mmap", [True, False], ids=["mapped", "read"])
@pytest.mark.parametrize("shards", [None, 2], ids=["single-file", "sharded"])
@pytest.mark.parametrize("form", ["state", "positional"])
@pytest.mark.parametrize("width", [16, 1024], ids=["small", "4MiB-records"])  # large: straight to buffers
def test_a_file_rewritten_between_its_hash_and_its_load_restores_the_verified_value_or_is_refused(
    tmp_path, mmap, shards, form, width
):
    mgr = CheckpointManager(tmp_path / "run", every_steps=1, num_shards=shards)
    if form == "state":
        mgr.save(1, {"model": ones_model(width)})
    else:
        model = ones_model(width)
        mgr.save(model, torch.optim.SGD(model.parameters(), lr=0.1), None, ckpt_state(1))
    fresh = torch.nn.Linear(width, width)
    with RewriteAtLoad() as rewrite:
        try:
            if form == "state":
                mgr.restore_latest({"model": fresh}, mmap=mmap)
            else:
                mgr.restore_latest(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), None, mmap=mmap)
        except CheckpointError:
            pass  # a refusal is allowed: nothing unverified was loaded
        else:
            assert torch.all(fresh.weight == 1.0) and torch.all(fresh.bias == 1.0)
    assert rewrite.rewritten  # the attack happened: some file held 7.0 when the load started
    assert not torch.any(fresh.weight == 7.0) and not torch.any(fresh.bias == 7.0)
    mgr.close()


def ckpt_state(step: int):
    from ckpt_lesson.files.train_state import TrainState

    return TrainState(step=step)


def test_the_copy_holds_exactly_the_bytes_read_through_it_and_is_sealed(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 64)
    with open(path, "rb") as f, PrivateCopy(path.stat().st_size) as copy:
        reader = copy.reader(f)
        reader.seek(16_000)
        assert reader.read() == path.read_bytes()[16_000:]  # the tail first, as the footer check does
        reader.seek(0)
        while len(reader.read_view(1000)):  # the hash pass's reads
            pass
        path.write_bytes(b"\x07" * 16_384)  # the file changes after it was read: the copy does not
        copy.seal()
        with copy.open() as private:
            assert private.read() == bytes(range(256)) * 64
        if copy.fd is not None:  # Linux: nobody can write, shrink or grow the sealed memfd
            with pytest.raises(PermissionError):
                os.pwrite(copy.fd, b"x", 0)
            with pytest.raises(PermissionError):
                os.ftruncate(copy.fd, 1)


def test_a_file_that_grows_while_it_is_hashed_copies_no_more_than_its_first_size(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"a" * 100)
    with open(path, "rb") as f, PrivateCopy(100) as copy:
        with open(path, "ab") as grow:
            grow.write(b"b" * 50)
        assert copy.reader(f).read() == b"a" * 100 + b"b" * 50  # what the hash sees, and refuses
        copy.seal()
        with copy.open() as private:
            assert private.read() == b"a" * 100


def test_without_memfd_the_copy_is_a_bytearray_and_the_rewrite_still_loads_the_verified_value(
    tmp_path, monkeypatch
):
    def no_memfd(*args, **kwargs):
        raise OSError(38, "Function not implemented")  # a sandbox that forbids memfd_create

    monkeypatch.setattr(os, "memfd_create", no_memfd)
    mgr = CheckpointManager(tmp_path / "run", every_steps=1)
    mgr.save(1, {"model": ones_model(1024)})
    fresh = torch.nn.Linear(1024, 1024)
    with RewriteAtLoad() as rewrite:
        mgr.restore_latest({"model": fresh}, mmap=True)
    assert rewrite.rewritten and torch.all(fresh.weight == 1.0) and torch.all(fresh.bias == 1.0)
    with PrivateCopy(4) as copy:
        assert copy.fd is None and copy.map_path is None
    mgr.close()


def test_a_large_record_is_read_straight_into_its_buffer_and_hashed_there_with_no_second_copy(tmp_path):
    model = ones_model(1024)  # a 4 MiB weight record: above the size that gets a buffer
    path = tmp_path / "c.pt"
    save_checkpoint(model, torch.optim.SGD(model.parameters(), lr=0.1), None, ckpt_state(1), path)
    data, size = path.read_bytes(), path.stat().st_size
    with FreshMemory() as fresh, open(path, "rb") as f:
        fresh.start(f, size)  # the record spans, from the archive's directory (as load_verified_file)
        copy = PrivateCopy(size, fresh=fresh)
        if copy.fd is None:
            pytest.skip("records go to buffers only beside a memfd copy (Linux)")
        reader = copy.reader(f)
        pieces = []  # (file offset, address of the bytes handed to the hash, the bytes)
        while len(view := reader.read_view(1 << 20)):
            at = reader.tell() - len(view)
            pieces.append((at, torch.frombuffer(view, dtype=torch.uint8).data_ptr(), bytes(view)))
        assert b"".join(p[2] for p in pieces) == data  # every byte once, in order
        assert fresh.spans, "the 4 MiB record must get a buffer"
        for start, n in fresh.spans:
            buf = copy._taken[start][0]
            assert bytes(buf.numpy()) == data[start : start + n]
            inside = [(at, ptr) for at, ptr, _ in pieces if start <= at < start + n]
            assert inside and all(ptr == buf.data_ptr() + at - start for at, ptr in inside)
        f.seek(0)
        digest = verify_footer(copy.reader(f), name=path)  # the footer check reads through the same path
        copy.close()
    assert digest == file_digest(path)


@pytest.mark.parametrize("nbytes", [1 << 20, (6 << 20) + 3], ids=["below-2MiB", "huge-page-sized"])
def test_a_private_buffer_is_exactly_the_size_asked_writable_and_freed_with_its_tensor(nbytes):
    buf = private_buffer(nbytes)
    assert buf.dtype == torch.uint8 and buf.shape == (nbytes,) and buf.is_contiguous()
    buf.fill_(7)
    assert int(buf[-1]) == 7 and int(buf.sum()) == 7 * nbytes
    start = buf.data_ptr()
    moments = buf[: nbytes - nbytes % 4].view(torch.float32)  # what an optimizer keeps: a view
    del buf
    assert moments.data_ptr() == start and float(moments[0]) != 0.0
    if Path("/proc/self/maps").exists():
        del moments

        def mapped() -> bool:
            with open("/proc/self/maps") as maps:
                return any(
                    int(line.split("-")[0], 16) <= start < int(line.split()[0].split("-")[1], 16)
                    for line in maps
                )

        if nbytes >= 2 << 20:  # a mapping of its own: gone as soon as the last tensor on it is
            assert not mapped()
