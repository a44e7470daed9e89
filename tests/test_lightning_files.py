"""Lightning ``.ckpt`` files go through the one bounded reader: hostile files are corrupt, never a hang."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_lesson.files.atomic import atomic_save
from ckpt_lesson.files.safe_read import MAX_RECORD_BYTES
from ckpt_lesson.runs.lightning_files import inspect_lightning_file
from ckpt_lesson.runs.scan import scan_checkpoints

ROOT = Path(__file__).resolve().parents[1]
#: 300,000 nested lists under "state", then the two keys: a valid 600 kB pickle (the C unpickler
#: does not recurse). A walk that copied the stack at each closing opcode took about 54 s for
#: 200,000 here (quadratic); a walk with its own stack of marks takes well under a second.
DEPTH = 300_000
DEEP_PICKLE = (
    b"\x80\x02}q\x00(X\x05\x00\x00\x00state"
    + b"(" * DEPTH
    + b"l" * DEPTH
    + b"X\x05\x00\x00\x00epochK\x03X\x0b\x00\x00\x00global_stepK\x0cu."
)


def good_ckpt(path: Path) -> Path:
    """A Lightning-like checkpoint with our integrity footer, as VerifiedCheckpointIO writes it."""
    atomic_save({"epoch": 3, "global_step": 12, "state_dict": {"w": torch.arange(4.0)}}, path)
    return path


def archive_with_pickle(path: Path, data: bytes) -> Path:
    """A real torch.save archive whose data.pkl is replaced by ``data`` (stored, no footer)."""
    buf = io.BytesIO()
    torch.save({"epoch": 0, "global_step": 0}, buf)
    buf.seek(0)
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, data if info.filename.endswith("/data.pkl") else src.read(info))
    return path


def make_hostile(folder: Path, kind: str) -> Path:
    """One hostile ``.ckpt`` in ``folder``, built on the fly."""
    path = folder / f"{kind}.ckpt"
    if kind == "symlink_out":  # a good file outside the folder: our reader never follows a link
        outside = folder.parent / f"outside-{folder.name}"
        outside.mkdir(exist_ok=True)
        path.symlink_to(good_ckpt(outside / "real.ckpt"))
    elif kind == "symlink_zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "oversize":  # a data.pkl one byte over the cap of every record
        archive_with_pickle(path, b"\x80\x02N" + b"N" * (MAX_RECORD_BYTES - 2) + b".")
    elif kind == "truncated":
        data = good_ckpt(folder / "whole.tmp").read_bytes()
        (folder / "whole.tmp").unlink()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "cut_member":  # the data.pkl local header claims a huge extra field: reads past the end
        archive_with_pickle(path, pickle.dumps({"epoch": 1, "global_step": 2}, protocol=2))
        raw = bytearray(path.read_bytes())
        with zipfile.ZipFile(path) as archive:
            offset = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl")).header_offset
        raw[offset + 28 : offset + 30] = (0xFFFF).to_bytes(2, "little")
        path.write_bytes(bytes(raw))
    else:
        raise ValueError(kind)
    return path


HOSTILE = {
    "symlink_out": "symlink",
    "symlink_zero": "symlink",
    "fifo": "FIFO",
    "directory": "directory",
    "oversize": "cap",
    "truncated": "not",
    "cut_member": "cut short",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_ckpt_is_corrupt_with_the_reason_named_and_nothing_followed_or_blocked(tmp_path, kind):
    folder = tmp_path / "ck"
    folder.mkdir()
    found = inspect_lightning_file(make_hostile(folder, kind))
    assert found.status == "corrupt", found
    assert HOSTILE[kind] in found.reason, found.reason
    assert found.step is None and str(tmp_path) not in found.reason  # the listing names the file only


def test_a_good_ckpt_still_verifies_through_the_bounded_reader(tmp_path):
    found = inspect_lightning_file(good_ckpt(tmp_path / "epoch=3-step=12.ckpt"))
    assert (found.status, found.epoch, found.step) == ("ok", 3, 12)


def test_deeply_nested_lists_in_data_pkl_are_walked_and_give_the_step_torch_would_load(tmp_path):
    assert pickle.loads(DEEP_PICKLE)["global_step"] == 12  # the C unpickler agrees: it is valid
    found = inspect_lightning_file(archive_with_pickle(tmp_path / "deep.ckpt", DEEP_PICKLE))
    assert (found.status, found.epoch, found.step) == ("unverified", 3, 12)


def test_marks_never_closed_give_an_unknown_step_not_a_guess(tmp_path):
    data = b"\x80\x02}q\x00(" + b"(" * DEPTH + b"X\x0b\x00\x00\x00global_stepK\x0c."
    found = inspect_lightning_file(archive_with_pickle(tmp_path / "open.ckpt", data))
    assert (found.status, found.step) == ("unverified", None)


def test_scan_and_report_on_a_folder_of_hostile_ckpt_files_print_no_traceback(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    good_ckpt(folder / "epoch=3-step=12.ckpt")
    for kind in ("fifo", "oversize", "truncated", "cut_member"):
        make_hostile(folder, kind)
    archive_with_pickle(folder / "deep.ckpt", DEEP_PICKLE)
    listed = {r.path.name: r.status for r in scan_checkpoints(folder)}
    assert listed == {
        "epoch=3-step=12.ckpt": "ok",
        "deep.ckpt": "unverified",
        **{f"{kind}.ckpt": "corrupt" for kind in ("fifo", "oversize", "truncated", "cut_member")},
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for command, codes in (("scan", (1,)), ("report", (0, 2))):
        done = subprocess.run(
            [sys.executable, "-m", "ckpt_lesson", command, str(folder)],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert "Traceback" not in done.stdout + done.stderr, command
        assert done.returncode in codes, (command, done.returncode, done.stderr)
        assert len(done.stderr.strip().splitlines()) <= 1, (command, done.stderr)
