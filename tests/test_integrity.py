"""The in-file sha256 footer, flipped-byte detection, and files that must never load.

A checkpoint written by this package is a zip archive whose comment records the
sha256 of everything before it. These tests check that the archive is still an
ordinary zip that torch reads, that one changed byte *anywhere* is noticed, and
that damaged or hostile files raise :class:`CheckpointError` instead of loading
(also under ``python -O``, which strips ``assert``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import os
import pathlib
import pickle
import pickletools
import shlex
import struct
import subprocess
import sys
import zipfile
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from ckpt_lesson.files.atomic import atomic_save
from ckpt_lesson.files.checkpoint import load_checkpoint, load_verified_file
from ckpt_lesson.files.hashing import ALGORITHMS, DEFAULT_ALGO, digest_bytes
from ckpt_lesson.files.integrity import FOOTER_MAGIC, FooterWriter, file_digest, read_footer

FOOTER_LEN = len(FOOTER_MAGIC) + len(DEFAULT_ALGO) + 1 + ALGORITHMS[DEFAULT_ALGO]


@pytest.fixture
def saved(tmp_path, tiny_run):
    """A real checkpoint after three training steps: (path, digest, run)."""
    run = tiny_run(0)
    run.train(3)
    path = tmp_path / "ckpt.pt"
    return path, run.save(path), run


def flipped(data: bytes, pos: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[pos] ^= mask
    return bytes(out)


@contextlib.contextmanager
def byte_flipped_in_place(path: pathlib.Path, pos: int, mask: int) -> Iterator[None]:
    """Flip one byte of ``path`` for the duration of the block, then put it back.

    Patching in place is ~15x faster here than re-writing a copy per position,
    which is what lets the test below afford well over a thousand positions.
    """
    fd = os.open(path, os.O_RDWR)
    try:
        (old,) = os.pread(fd, 1, pos)
        os.pwrite(fd, bytes([old ^ mask]), pos)
        try:
            yield
        finally:
            os.pwrite(fd, bytes([old]), pos)
    finally:
        os.close(fd)


def zip_regions(data: bytes) -> dict[str, tuple[int, int]]:
    """Byte ranges [start, end) of the parts of a torch.save archive."""
    regions: dict[str, tuple[int, int]] = {}
    eocd = len(data) - FOOTER_LEN - 22
    cd_size, cd_offset = struct.unpack("<II", data[eocd + 12 : eocd + 20])
    if cd_offset == 0xFFFFFFFF:  # zip64: the real offset is in the zip64 end record
        z64 = data.rindex(b"PK\x06\x06", 0, eocd)
        cd_size, cd_offset = struct.unpack("<QQ", data[z64 + 40 : z64 + 56])
        regions["zip64 end records"] = (z64, eocd)
    regions["central directory"] = (cd_offset, cd_offset + cd_size)
    regions["end record"] = (eocd, eocd + 22)
    regions["footer"] = (eocd + 22, len(data))
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            head = info.header_offset
            name_len, extra_len = struct.unpack("<HH", data[head + 26 : head + 30])
            start = head + 30 + name_len + extra_len
            regions[f"local header of {info.filename}"] = (info.header_offset, start)
            regions[f"data of {info.filename}"] = (start, start + info.compress_size)
    return regions


def sample_positions(data: bytes) -> list[int]:
    """First, middle and last byte of every region, a stride across the file, and the whole tail."""
    positions: set[int] = set(range(0, len(data), 31))
    for start, end in zip_regions(data).values():
        if end > start:
            positions |= {start, (start + end) // 2, end - 1}
    positions |= set(range(max(0, len(data) - 400), len(data)))
    return sorted(positions)


def test_footer_is_the_zip_comment_and_names_its_algorithm_and_the_content_hash(saved):
    path, digest, _ = saved
    data = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        assert z.comment == FOOTER_MAGIC + f"{DEFAULT_ALGO}:{digest.content_digest}".encode()
    assert digest.algo == DEFAULT_ALGO
    assert digest.content_digest == digest_bytes(data[:-FOOTER_LEN], DEFAULT_ALGO)


def test_digest_is_the_whole_files_hash_in_the_recorded_algorithm(saved):
    path, digest, _ = saved
    data = path.read_bytes()
    assert digest.size == len(data)
    assert digest.digest == digest_bytes(data, digest.algo)
    assert file_digest(path) == digest
    # Asked for another algorithm, a reader computes it in the same pass and still checks the footer.
    as_sha = file_digest(path, algo="sha256")
    assert as_sha.digest == hashlib.sha256(data).hexdigest()
    assert as_sha.content_digest == digest.content_digest


@pytest.mark.parametrize("mmap", [False, True], ids=["plain", "mmap"])
def test_torch_load_still_reads_a_file_with_a_footer(saved, mmap):
    path, _, run = saved
    payload = torch.load(path, weights_only=True, mmap=mmap)
    for key, tensor in run.model.state_dict().items():
        assert torch.equal(payload["model"][key], tensor)


def test_footer_writer_output_does_not_depend_on_how_torch_save_splits_its_writes():
    class Dribble:
        """Passes every write on in pieces of 1 to 7 bytes, to exercise the held-back tail."""

        def __init__(self, inner):
            self.inner = inner

        def write(self, data):
            view = memoryview(data).cast("B")
            i = 0
            while i < len(view):
                step = 1 + i % 7
                self.inner.write(view[i : i + step])
                i += step
            return len(view)

        def flush(self):
            self.inner.flush()

    payload = {"w": torch.arange(300, dtype=torch.float32), "name": "x"}
    whole, dribbled = io.BytesIO(), io.BytesIO()
    a, b = FooterWriter(whole), FooterWriter(dribbled)
    torch.save(payload, a)
    torch.save(payload, Dribble(b))
    assert a.finish() == b.finish()
    assert whole.getvalue() == dribbled.getvalue()
    assert zipfile.ZipFile(dribbled).comment.startswith(FOOTER_MAGIC)


_ONE_ARCHIVE = io.BytesIO()
torch.save({"w": torch.arange(40, dtype=torch.float32)}, _ONE_ARCHIVE)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(_ONE_ARCHIVE.getvalue())), max_size=12))
def test_footer_writer_gives_the_same_bytes_for_any_split_of_the_stream(cuts):
    data = _ONE_ARCHIVE.getvalue()
    edges = [0, *sorted(cuts), len(data)]
    reference, split = io.BytesIO(), io.BytesIO()
    whole = FooterWriter(reference)
    whole.write(data)
    pieces = FooterWriter(split)
    for start, end in zip(edges, edges[1:], strict=False):
        pieces.write(data[start:end])  # empty pieces included
    assert pieces.finish() == whole.finish()
    assert split.getvalue() == reference.getvalue()


def test_footer_writer_refuses_output_that_is_not_a_zip():
    writer = FooterWriter(io.BytesIO())
    writer.write(b"plain text, not torch.save output" * 3)
    with pytest.raises(CorruptCheckpointError, match="zip end record"):
        writer.finish()


def test_a_flipped_byte_anywhere_in_the_file_is_always_detected(tmp_path, saved, tiny_run):
    path, _, _ = saved
    data = path.read_bytes()
    positions = sample_positions(data)
    assert len(positions) > 1500
    target = tmp_path / "damaged.pt"
    target.write_bytes(data)
    fresh = tiny_run(1)
    undetected = []
    for pos in positions:
        with byte_flipped_in_place(target, pos, 1 << (pos % 8)):
            try:
                load_checkpoint(target, fresh.model, fresh.optimizer, fresh.scheduler)
            except CheckpointError:
                continue
            undetected.append(pos)
    assert undetected == []
    assert target.read_bytes() == data  # the harness really restored every byte


def test_every_region_of_the_archive_was_sampled(saved):
    path, _, _ = saved
    data = path.read_bytes()
    positions = sample_positions(data)
    regions = zip_regions(data)
    assert {"central directory", "end record", "footer", "data of archive/data.pkl"} <= set(regions)
    for name, (start, end) in regions.items():
        assert end == start or any(start <= p < end for p in positions), name


@pytest.mark.parametrize("region", ["end record", "footer"])
def test_a_damaged_footer_is_reported_by_the_file_check_itself(tmp_path, saved, region):
    # Without the footer a file looks like a footer-less legacy file; a byte
    # flipped in the footer's own markers must not turn it into one.
    path, _, _ = saved
    data = path.read_bytes()
    start, end = zip_regions(data)[region]
    target = tmp_path / "damaged.pt"
    target.write_bytes(data)
    for pos in range(start, end):
        for mask in (0x01, 0x80, 0xFF):
            with byte_flipped_in_place(target, pos, mask), pytest.raises(CorruptCheckpointError):
                file_digest(target)


@pytest.mark.parametrize("cut", [1, 40, FOOTER_LEN])
def test_a_cut_off_footer_is_reported_as_corrupt(tmp_path, saved, cut):
    path, _, _ = saved
    target = tmp_path / "cut.pt"
    target.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(CorruptCheckpointError, match="cut.pt"):
        load_verified_file(target)


def test_bytes_appended_after_the_footer_are_reported_as_corrupt(tmp_path, saved):
    path, _, _ = saved
    target = tmp_path / "appended.pt"
    target.write_bytes(path.read_bytes() + b"\x00" * 10)
    with pytest.raises(CorruptCheckpointError):
        load_verified_file(target)


def test_a_plain_torch_save_file_has_no_footer_and_is_not_called_damaged(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(4)}, path)
    with open(path, "rb") as f:
        assert read_footer(f, path.stat().st_size, name=path) is None
    digest = file_digest(path)
    assert not digest.has_footer and digest.content_digest is None
    assert digest.digest == digest_bytes(path.read_bytes(), DEFAULT_ALGO)


def test_expected_sha256_is_checked_and_may_be_upper_case(saved):
    path, digest, _ = saved
    load_verified_file(path, expected_sha256=hashlib.sha256(path.read_bytes()).hexdigest().upper())
    load_verified_file(path, expected_digest=digest.digest.upper(), algo=digest.algo)
    with pytest.raises(CorruptCheckpointError, match="does not match"):
        load_verified_file(path, expected_sha256="0" * 64)
    with pytest.raises(CorruptCheckpointError, match="bytes on disk"):
        load_verified_file(path, expected_size=digest.size + 1)


# Algorithms and files from earlier versions -----------------------------------------------


def old_version_file(path: pathlib.Path, payload: object) -> str:
    """Write ``payload`` the way versions before the algorithm was named did; returns its sha256.

    Built by hand (not with FooterWriter): a plain torch.save archive whose end record
    announces an 83-byte comment, then ``ckpt-lesson-sha256:`` and the sha256 of what precedes it.
    """
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = bytearray(buf.getvalue())
    assert data[-22:-18] == b"PK\x05\x06" and data[-2:] == b"\x00\x00"
    data[-2:] = struct.pack("<H", 19 + 64)
    content = hashlib.sha256(data).hexdigest()
    path.write_bytes(bytes(data) + b"ckpt-lesson-sha256:" + content.encode())
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_file_from_an_earlier_version_with_a_sha256_footer_still_loads_and_verifies(tmp_path):
    path = tmp_path / "old.pt"
    whole = old_version_file(path, {"w": torch.arange(5.0)})
    obj, digest = load_verified_file(path, expected_sha256=whole)
    assert torch.equal(obj["w"], torch.arange(5.0))
    assert digest.algo == "sha256" and digest.sha256 == whole and digest.has_footer
    flipped_copy = tmp_path / "old_flipped.pt"
    flipped_copy.write_bytes(flipped(path.read_bytes(), 100))
    with pytest.raises(CorruptCheckpointError):
        load_verified_file(flipped_copy)


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_every_algorithm_detects_a_flipped_byte_in_tensor_data(tmp_path, algo):
    if algo == "blake3":
        pytest.importorskip("blake3")
    path = tmp_path / "c.pt"
    written = atomic_save({"w": torch.arange(1000.0)}, path, algo=algo)
    assert written.algo == algo and len(written.digest) == ALGORITHMS[algo]
    data = path.read_bytes()
    assert data.endswith(FOOTER_MAGIC + algo.encode() + b":" + written.content_digest.encode())
    assert load_verified_file(path, expected_digest=written.digest, algo=algo)[1] == written
    start, end = zip_regions(data)["data of archive/data/0"]
    for pos in (start, (start + end) // 2, end - 1):
        path.write_bytes(flipped(data, pos))
        with pytest.raises(CorruptCheckpointError, match="c.pt"):
            load_verified_file(path)


def test_a_save_never_reopens_its_file_to_hash_it(tmp_path, monkeypatch):
    opened: list[str] = []
    real_open, real_os_open = open, os.open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k))
    monkeypatch.setattr(
        os, "open", lambda p, flags, *a, **k: opened.append(f"{p}:{flags}") or real_os_open(p, flags, *a, **k)
    )
    digest = atomic_save({"w": torch.ones(100)}, tmp_path / "w.pt")
    monkeypatch.undo()
    # One exclusive create of the temp file (write-only) and directory opens for fsync: no read of a file.
    files = [o for o in opened if ".tmp-" in o or o.endswith("w.pt")]
    assert len(files) == 1 and int(files[0].rsplit(":", 1)[1]) & os.O_WRONLY
    assert digest == file_digest(tmp_path / "w.pt")


def test_our_saves_skip_torchs_zip_crc32_and_put_the_setting_back(tmp_path):
    from torch.utils.serialization import config

    assert config.save.compute_crc32 is True
    atomic_save({"w": torch.arange(10.0)}, tmp_path / "fast.pt")
    assert config.save.compute_crc32 is True  # restored after the save
    with zipfile.ZipFile(tmp_path / "fast.pt") as z:
        assert z.testzip() is not None  # the cost: zip tools see CRCs that were never computed
    assert torch.equal(torch.load(tmp_path / "fast.pt", weights_only=True)["w"], torch.arange(10.0))
    atomic_save({"w": torch.arange(10.0)}, tmp_path / "crc.pt", zip_crc32=True)
    with zipfile.ZipFile(tmp_path / "crc.pt") as z:
        assert z.testzip() is None
    with pytest.raises(Exception):  # noqa: B017 - any failure inside torch.save must restore it too
        atomic_save({"f": lambda: 0}, tmp_path / "bad.pt")
    assert config.save.compute_crc32 is True


def test_saves_on_other_threads_skip_the_crc32_too_and_each_thread_keeps_its_setting(tmp_path):
    # torch 2.13 keeps config overrides per thread: a flag flipped on one thread is invisible to another,
    # so shard writers and the async writer must each switch it off for themselves.
    import threading

    from torch.utils.serialization import config

    from ckpt_lesson.files.hashing import zip_crc32_off

    seen: list[bool] = []

    def save() -> None:
        atomic_save({"w": torch.arange(1000.0)}, tmp_path / "other.pt")
        seen.append(config.save.compute_crc32)

    with zip_crc32_off():  # this thread is mid-save while the other thread saves
        worker = threading.Thread(target=save)
        worker.start()
        worker.join()
    assert seen == [True] and config.save.compute_crc32 is True
    with zipfile.ZipFile(tmp_path / "other.pt") as z:
        assert z.testzip() is not None  # written without CRC32s, like a save on the main thread


# Hostile and damaged files ------------------------------------------------------------------


class CallsRebuildWithoutArguments:
    """An allowed function called with the wrong arguments, as a flipped opcode can do."""

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, ())


class BuildsADictWithADictKey:
    """An allowed constructor fed an unhashable key."""

    def __reduce__(self):
        return (collections.OrderedDict, ([({}, 1)],))


@pytest.mark.parametrize(
    "thing", [CallsRebuildWithoutArguments(), BuildsADictWithADictKey()], ids=lambda t: type(t).__name__
)
def test_allowed_calls_that_fail_inside_torch_load_become_corrupt_checkpoint_errors(tmp_path, thing):
    # torch.load raises a bare TypeError for these; callers catching CheckpointError must see them.
    path = tmp_path / "odd.pt"
    torch.save({"schema": "ckpt.v1", "model": thing}, path)
    with pytest.raises(CorruptCheckpointError, match="odd.pt"):
        load_verified_file(path)


class RunsShellOnUnpickle:
    """Unpickling this calls ``os.system("touch MARKER")``: a stand-in for any attack."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


class TouchesOnUnpickle(RunsShellOnUnpickle):
    """Same attack through ``pathlib.Path.touch``: no shell needed."""

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def make_bad_files(directory: pathlib.Path, good: pathlib.Path) -> dict[str, pathlib.Path]:
    """Damaged and hostile variants of the checkpoint ``good``; returns case -> path."""
    data = good.read_bytes()
    regions = zip_regions(data)
    cd_start, _ = regions["central directory"]
    tensors = [r for n, r in regions.items() if n.startswith("data of archive/data/")]
    big = max(tensors, key=lambda r: r[1] - r[0])
    raw = pickle.dumps(RunsShellOnUnpickle(directory / "PWNED_raw"), protocol=2)
    hostile_zip = io.BytesIO()
    torch.save({"schema": "ckpt.v2", "model": TouchesOnUnpickle(directory / "PWNED_zip")}, hostile_zip)
    contents = {
        "truncated": data[: len(data) // 2],
        "zero_length": b"",
        "flipped_central_directory": flipped(data, cd_start + 20),
        "flipped_tensor_data": flipped(data, (big[0] + big[1]) // 2),
        "junk_text": b"this is a text file, not a checkpoint\n" * 20,
        "hostile_raw_pickle": raw,
        "hostile_torch_zip": hostile_zip.getvalue(),
    }
    paths = {}
    for case, content in contents.items():
        paths[case] = directory / f"{case}.pt"
        paths[case].write_bytes(content)
    paths["directory"] = directory / "a_directory.pt"
    paths["directory"].mkdir()
    return paths


EXPECTED = {
    "truncated": CheckpointError,
    "zero_length": CheckpointError,
    "flipped_central_directory": CorruptCheckpointError,
    "flipped_tensor_data": CorruptCheckpointError,
    "junk_text": CorruptCheckpointError,
    "hostile_raw_pickle": UnsafeCheckpointError,
    "hostile_torch_zip": UnsafeCheckpointError,
    "directory": CheckpointError,
}


@pytest.fixture
def bad_files(tmp_path, saved):
    bad = tmp_path / "bad"
    bad.mkdir()
    return make_bad_files(bad, saved[0])


def test_the_hostile_files_really_ask_the_unpickler_to_run_code(bad_files):
    # Inspect the opcode stream without executing it: it names the functions to call.
    raw = bad_files["hostile_raw_pickle"].read_bytes()
    assert any(arg == "posix system" or arg == "nt system" for _, arg, _ in pickletools.genops(raw))
    with zipfile.ZipFile(bad_files["hostile_torch_zip"]) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert b"touch" in pkl and b"pathlib" in pkl


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_damaged_and_hostile_files_raise_checkpoint_error_naming_the_file(bad_files, tiny_run, case):
    run = tiny_run(0)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    with pytest.raises(EXPECTED[case]) as info:
        load_checkpoint(bad_files[case], run.model, run.optimizer, run.scheduler)
    assert str(bad_files[case]) in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in run.model.state_dict().items())
    assert not (bad_files[case].parent / "PWNED_raw").exists()
    assert not (bad_files[case].parent / "PWNED_zip").exists()


CHILD = """
import json, sys
from ckpt_lesson.files.checkpoint import load_checkpoint
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.course.training import make_model, make_optimizer_and_scheduler

out = {"optimize": sys.flags.optimize}
for path in sys.argv[1:]:
    model = make_model(in_dim=8, hidden=32)
    opt, sched = make_optimizer_and_scheduler(model, total_steps=50)
    try:
        load_checkpoint(path, model, opt, sched)
        out[path] = "loaded"
    except Exception as exc:
        out[path] = [type(exc).__name__, isinstance(exc, CheckpointError)]
print(json.dumps(out))
"""


def test_hostile_and_damaged_files_are_refused_under_python_dash_o(bad_files, saved):
    # -O strips asserts: validation that relied on them would silently stop here.
    good = saved[0]
    args = [str(good)] + [str(p) for p in bad_files.values()]
    proc = subprocess.run(
        [sys.executable, "-O", "-c", CHILD, *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("optimize") == 1
    assert out.pop(str(good)) == "loaded"  # the control: -O did not break loading itself
    for case, path in bad_files.items():
        name, is_checkpoint_error = out[str(path)]
        assert is_checkpoint_error, (case, name)
        assert issubclass(getattr(sys.modules["ckpt_lesson.errors"], name), EXPECTED[case]), (case, name)
    assert not (good.parent / "bad" / "PWNED_raw").exists()
    assert not (good.parent / "bad" / "PWNED_zip").exists()
