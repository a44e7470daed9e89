"""Hostile and careless inputs: nothing unloadable is published, hostile files stay bounded.

Each class of input is tried with several members, and every test checks the
thing that matters afterwards: the previous good save (or file) is still there
and still restores.
"""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import signal
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    LoadEnvironmentError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from ckpt_lesson.files.checkpoint import TrainState, load_checkpoint, save_checkpoint
from ckpt_lesson.files.integrity import FooterWriter
from ckpt_lesson.files.migrate import migrate_file
from ckpt_lesson.files.record_seal import SEAL_KEY, seal_record
from ckpt_lesson.files.safe_read import read_json_file
from ckpt_lesson.runs.layout import read_manifest
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.retention import KeepBest
from ckpt_lesson.runs.scan import scan_checkpoints

# ---------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def no_hang():
    """A FIFO or an endless device must not hang a test: fail it after 60 s instead."""

    def fail(signum, frame):
        raise TimeoutError("hung for 60 s reading a hostile file")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def good_run(tmp_path: Path, tiny_run, steps=(2,), **kwargs):
    run = tiny_run(0)
    kwargs.setdefault("every_steps", 1)
    mgr = CheckpointManager(tmp_path / "run", keep_last=kwargs.pop("keep_last", 1), **kwargs)
    for step in steps:
        run.train(step)
        mgr.save(run.model, run.optimizer, run.scheduler, run.state)
    mgr.wait_retention()  # retention runs behind the saves
    return run, mgr


def restored_step(mgr: CheckpointManager, tiny_run) -> int:
    fresh = tiny_run(1)
    state = mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler)
    assert state is not None
    return state.step


class Odd:
    """A plain Python object: torch.save pickles it, a weights-only load refuses it."""


class OddExtraState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def get_extra_state(self):
        return Odd()

    def set_extra_state(self, state) -> None:
        pass


# ---------------------------------------------------------------- 1. nothing unloadable is published

UNLOADABLE_EXTRAS = {
    "numpy_array": np.ones(3),
    "numpy_scalar": np.float32(1.0),
    "path": pathlib.Path("data/train.csv"),
    "object": Odd(),
    "frozenset": frozenset({1}),
    "nested_in_list": [1, {"deep": np.zeros(2)}],
    "range": range(3),
}


@pytest.mark.parametrize("case", sorted(UNLOADABLE_EXTRAS))
def test_a_save_with_unloadable_extras_is_refused_and_the_older_save_survives(tmp_path, tiny_run, case):
    run, mgr = good_run(tmp_path, tiny_run)
    run.train(4)
    with pytest.raises(CheckpointError, match=r"extras.*weights-only loader refuses") as info:
        mgr.save(run.model, run.optimizer, run.scheduler, run.state, extras={"w": UNLOADABLE_EXTRAS[case]})
    assert "'w'" in str(info.value) and "nothing was written" in str(info.value)
    assert [r.step for r in scan_checkpoints(mgr.run_dir)] == [2]  # nothing published, nothing purged
    assert restored_step(mgr, tiny_run) == 2


def test_a_module_whose_extra_state_is_an_object_is_refused_naming_the_key(tmp_path):
    model = OddExtraState()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match=r"_extra_state.*Odd"):
        save_checkpoint(model, opt, None, TrainState(), tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()


def test_a_model_on_the_meta_device_is_refused_by_save_and_by_save_async(tmp_path):
    from ckpt_lesson.runs.async_save import AsyncCheckpointer

    with torch.device("meta"):
        model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(tmp_path / "run", every_steps=1) as mgr:
        with pytest.raises(CheckpointError, match="meta device"):
            mgr.save(model, opt, None, TrainState(step=1))
        with pytest.raises(CheckpointError, match="meta device"):
            AsyncCheckpointer(mgr).save_async(model, opt, None, TrainState(step=1))
    assert scan_checkpoints(tmp_path / "run") == []


def test_save_async_after_close_is_refused_at_once(tmp_path, tiny_run):
    from ckpt_lesson.runs.async_save import AsyncCheckpointer

    run = tiny_run(0)
    mgr = CheckpointManager(tmp_path / "run", every_steps=1)
    mgr.close()
    with pytest.raises(CheckpointError, match="closed"):
        AsyncCheckpointer(mgr).save_async(run.model, run.optimizer, run.scheduler, run.state)


BAD_STEPS = {"negative": -1, "float": 5.0, "bool": True, "numpy": np.int64(5), "tensor": torch.tensor(5)}


@pytest.mark.parametrize("case", sorted(BAD_STEPS))
def test_save_checkpoint_refuses_a_state_its_own_loader_would_refuse_and_keeps_the_old_file(
    tmp_path, tiny_run, case
):
    run = tiny_run(0)
    run.train(2)
    path = tmp_path / "last.pt"
    run.save(path)
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=r"step.*Nothing was written"):
        save_checkpoint(run.model, run.optimizer, run.scheduler, TrainState(step=BAD_STEPS[case]), path)
    assert path.read_bytes() == before
    assert load_checkpoint(path, run.model, run.optimizer, run.scheduler).step == 2


def test_a_payload_that_contains_itself_is_refused(tmp_path, tiny_run):
    run = tiny_run(0)
    loop: list = []
    loop.append(loop)
    with pytest.raises(CheckpointError, match="contains itself"):
        save_checkpoint(
            run.model, run.optimizer, run.scheduler, run.state, tmp_path / "x.pt", extras={"l": loop}
        )


# ---------------------------------------------------------------- 2. retention and ranking


@pytest.mark.parametrize("bad", [math.nan, None, "0.1", [0.1]], ids=["nan", "none", "str", "list"])
def test_keep_best_treats_nan_none_and_non_numbers_as_no_metric(bad):
    policy = KeepBest({10: 0.5, 20: bad, 30: 0.9, 40: 0.8}, k_best=1, keep_last=1)
    assert policy.best_steps({10, 20, 30, 40}) == [10]
    assert 10 not in policy.to_delete([10, 20, 30, 40], {10, 20, 30, 40})


def test_keep_best_with_a_nan_metric_keeps_the_true_best_save_in_a_real_run(tmp_path, tiny_run):
    metrics = {2: 0.1, 4: math.nan, 6: None}
    run, mgr = good_run(
        tmp_path, tiny_run, steps=(2, 4, 6), retention=KeepBest(metrics, k_best=1, keep_last=1)
    )
    assert [r.step for r in scan_checkpoints(mgr.run_dir)] == [2, 6]


@pytest.mark.parametrize("victim", ["newest_kept", "older_kept"])
def test_retention_rehashes_kept_saves_so_a_same_size_bit_flip_keeps_an_older_good_save(
    tmp_path, tiny_run, victim
):
    run, mgr = good_run(tmp_path, tiny_run, steps=(2, 4), keep_last=2)
    flipped = mgr.step_dir(4 if victim == "newest_kept" else 2) / "checkpoint.pt"
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # same size: a stat-only check would not notice
    flipped.write_bytes(bytes(raw))
    run.train(6)
    mgr.save(run.model, run.optimizer, run.scheduler, run.state)
    good = [r.step for r in scan_checkpoints(mgr.run_dir) if r.ok]
    assert len(good) >= 2, good  # keep_last=2 still means two saves that verify


# ---------------------------------------------------------------- 3. bounded reads of hostile files


def compressed_copy(src: Path, dst: Path) -> None:
    """The same records DEFLATE-compressed, with a valid (recomputed) footer: small file, big tensors."""
    # Member bytes are read straight from their offsets: our saves skip torch's (never checked)
    # zip CRC32s, so zipfile's own reader would refuse them.
    with zipfile.ZipFile(src) as zin, open(src, "rb") as raw:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                raw.seek(info.header_offset)
                name_len, extra_len = struct.unpack("<HH", raw.read(30)[26:30])
                raw.seek(info.header_offset + 30 + name_len + extra_len)
                data = raw.read(info.compress_size)
                zout.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED)
    out = io.BytesIO()
    writer = FooterWriter(out)
    writer.write(buf.getvalue())
    writer.finish()
    dst.write_bytes(out.getvalue())


def zero_linear(n: int) -> torch.nn.Linear:
    model = torch.nn.Linear(n, n)
    torch.nn.init.zeros_(model.weight)
    return model


def test_a_compressed_archive_with_a_valid_footer_is_refused_before_loading(tmp_path):
    src = tmp_path / "big.pt"
    save_checkpoint(zero_linear(256), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), None,
                    TrainState(), src)  # fmt: skip
    bomb = tmp_path / "bomb.pt"
    compressed_copy(src, bomb)
    assert bomb.stat().st_size < src.stat().st_size / 4  # zeros compress: the file is much smaller
    with pytest.raises(CorruptCheckpointError, match="compressed"):
        load_checkpoint(
            bomb, torch.nn.Linear(256, 256), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), None
        )


def test_an_archive_whose_declared_sizes_exceed_the_file_is_refused(tmp_path, tiny_run):
    run = tiny_run(0)
    path = tmp_path / "x.pt"
    run.save(path)
    raw = bytearray(path.read_bytes())
    cd = raw.rfind(b"PK\x01\x02")  # last central directory entry: claim 1 GB compressed and plain
    raw[cd + 20 : cd + 28] = (1 << 30).to_bytes(4, "little") * 2
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        load_checkpoint(path, run.model, run.optimizer, run.scheduler)


def make_special(kind: str, path: Path) -> None:
    if kind == "symlink_to_zero_device":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "deep_nesting":
        path.write_text("[" * 200_000 + "]" * 200_000)
    elif kind == "not_utf8":
        path.write_bytes(b"\xff\xfe{not json")
    elif kind == "nan_constant":
        path.write_text('{"step": NaN}')
    elif kind == "oversized":
        with open(path, "wb") as f:
            f.truncate((64 << 20) + 1)  # sparse: costs no disk


SPECIALS = [
    "symlink_to_zero_device",
    "fifo",
    "directory",
    "deep_nesting",
    "not_utf8",
    "nan_constant",
    "oversized",
]


@pytest.mark.parametrize("kind", SPECIALS)
def test_a_hostile_manifest_marks_the_save_damaged_and_restore_falls_back(tmp_path, tiny_run, kind):
    run, mgr = good_run(tmp_path, tiny_run, steps=(2, 4), keep_last=2)
    manifest = mgr.step_dir(4) / "manifest.json"
    manifest.unlink()
    make_special(kind, manifest)
    [older, newest] = scan_checkpoints(mgr.run_dir)
    assert older.ok and newest.status == "corrupt", newest
    assert restored_step(mgr, tiny_run) == 2
    assert mgr.last_restore["skipped"][0]["step"] == 4


@pytest.mark.parametrize("kind", SPECIALS)
def test_every_record_reader_refuses_special_files_as_damage(tmp_path, kind):
    path = tmp_path / "record.json"
    make_special(kind, path)
    with pytest.raises(CorruptCheckpointError):
        read_json_file(path)


@pytest.mark.parametrize("kind", ["symlink_to_zero_device", "fifo", "deep_nesting", "not_utf8"])
def test_a_hostile_index_json_in_a_sharded_save_falls_back(tmp_path, tiny_run, kind):
    run, mgr = good_run(tmp_path, tiny_run, steps=(2, 4), keep_last=2, num_shards=2)
    index = mgr.step_dir(4) / "index.json"
    index.unlink()
    make_special(kind, index)
    assert restored_step(mgr, tiny_run) == 2


@pytest.mark.parametrize("kind", ["char_device", "fifo", "symlink_to_device"])
def test_migrate_refuses_devices_and_pipes_at_once(tmp_path, kind):
    if kind == "char_device":
        target = Path("/dev/zero")
    elif kind == "fifo":
        target = tmp_path / "pipe.pt"
        os.mkfifo(target)
    else:
        target = tmp_path / "link.pt"
        target.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError):
        migrate_file(target)


# ---------------------------------------------------------------- 5. the commit record is verified


MANIFEST_FLIPS = {
    "covers_rng": ('"rng"', '"rnf"'),
    "env_version": ('"torch": "', '"torch": "9'),
    "schema": ("ckpt.manifest.v1", "ckpt.manifest.v2"),
    "seal_key_name": (f'"{SEAL_KEY}"', '"record_digesu"'),
    "seal_digest": ('"digest": "', '"digest": "0'),
    "save_id": ('"save_id": "', '"save_id": "f'),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_FLIPS))
def test_a_changed_manifest_is_damage_and_restore_uses_the_older_save(tmp_path, tiny_run, case):
    run, mgr = good_run(tmp_path, tiny_run, steps=(2, 4), keep_last=2)
    path = mgr.step_dir(4) / "manifest.json"
    old, new = MANIFEST_FLIPS[case]
    text = path.read_text()
    assert old in text, case
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(CorruptCheckpointError):
        read_manifest(mgr.step_dir(4))
    assert restored_step(mgr, tiny_run) == 2


def test_a_legacy_manifest_without_a_checksum_still_loads(tmp_path, tiny_run):
    run, mgr = good_run(tmp_path, tiny_run, steps=(2,))
    path = mgr.step_dir(2) / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest[SEAL_KEY]
    path.write_text(json.dumps(manifest))
    assert read_manifest(mgr.step_dir(2))["step"] == 2
    assert restored_step(mgr, tiny_run) == 2


def test_a_verified_manifest_from_another_environment_is_still_a_contract_refusal(tmp_path, tiny_run):
    from ckpt_lesson.errors import ContractMismatchError

    run, mgr = good_run(tmp_path, tiny_run, steps=(2,))
    path = mgr.step_dir(2) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["env"]["torch"] = "0.1.0"
    path.write_text(json.dumps(seal_record(manifest)))
    with pytest.raises(ContractMismatchError):
        restored_step(mgr, tiny_run)


# ---------------------------------------------------------------- 4. mismatched objects are refused


def test_an_optimizer_over_the_same_parameters_in_another_order_is_refused(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    save_checkpoint(model, opt, None, TrainState(step=1), tmp_path / "x.pt")
    params = list(model.parameters())
    swapped = torch.optim.AdamW([params[2], params[3], params[0], params[1]], lr=0.1)  # equal shapes
    with pytest.raises(StateMismatchError, match="another order"):
        load_checkpoint(tmp_path / "x.pt", model, swapped, None)


@pytest.mark.parametrize("other", ["SGD", "Adam", "RMSprop"])
def test_a_checkpoint_of_one_optimizer_class_is_refused_by_another(tmp_path, tiny_run, other):
    run = tiny_run(0)
    run.train(2)
    run.save(tmp_path / "x.pt")
    live = getattr(torch.optim, other)(run.model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    with pytest.raises(StateMismatchError, match="optimizer"):
        load_checkpoint(tmp_path / "x.pt", run.model, live, None)
    assert all(torch.equal(v, run.model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("record", ["recorded", "an older save without the record"])
def test_optimizer_state_whose_shapes_do_not_fit_the_parameters_is_refused(tmp_path, record):
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    save_checkpoint(model, opt, None, TrainState(), tmp_path / "x.pt")
    payload = torch.load(tmp_path / "x.pt", weights_only=True)
    payload["optimizer"]["state"][0]["exp_avg"] = torch.zeros(9)  # the weight's moment, flattened
    if record != "recorded":  # then the bias's exp_avg, in its parameter's shape, marks the key
        del payload["optimizer"]["param_groups"][0]["ckpt_lesson_binding"]["param_shaped"]
    other = tmp_path / "y.pt"
    from ckpt_lesson.files.atomic import atomic_save

    atomic_save(payload, other)
    with pytest.raises(StateMismatchError, match="exp_avg"):
        load_checkpoint(other, model, torch.optim.Adam(model.parameters(), lr=0.1), None)


@pytest.mark.parametrize("saved,live", [(torch.float64, torch.float16), (torch.float32, torch.bfloat16)])
def test_a_dtype_change_is_refused_unless_the_cast_is_asked_for(tmp_path, saved, live):
    model = torch.nn.Linear(2, 2).to(saved)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(model, opt, None, TrainState(), tmp_path / "x.pt")
    target = torch.nn.Linear(2, 2).to(live)
    with pytest.raises(StateMismatchError, match="allow_dtype_cast"):
        load_checkpoint(tmp_path / "x.pt", target, torch.optim.SGD(target.parameters(), lr=0.1), None)
    load_checkpoint(tmp_path / "x.pt", target, torch.optim.SGD(target.parameters(), lr=0.1), None,
                    allow_dtype_cast=True)  # fmt: skip
    assert target.weight.dtype == live


# ---------------------------------------------------------------- 6. environment errors vs damage


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_is_an_environment_error_not_damage(tmp_path, tiny_run):
    run, mgr = good_run(tmp_path, tiny_run, steps=(2, 4), keep_last=2)
    fresh = tiny_run(1)
    with pytest.raises(LoadEnvironmentError, match="cannot load"):
        mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler, map_location="cuda")
    assert mgr.last_restore["skipped"] == []  # no good save was logged as damaged
    assert all(r.ok for r in scan_checkpoints(mgr.run_dir))


def test_running_out_of_memory_while_loading_is_an_environment_error(tmp_path, tiny_run, monkeypatch):
    run, mgr = good_run(tmp_path, tiny_run, steps=(2, 4), keep_last=2)

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(torch, "load", no_memory)
    fresh = tiny_run(1)
    with pytest.raises(LoadEnvironmentError):
        mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler)
    assert mgr.last_restore["skipped"] == []


def test_an_io_error_reading_a_part_is_damage_and_restore_falls_back(tmp_path, tiny_run, monkeypatch):
    import errno

    from ckpt_lesson.files import loading

    run, mgr = good_run(tmp_path, tiny_run, steps=(2, 4), keep_last=2)
    real = loading.verify_footer
    newest = str(mgr.step_dir(4))

    def flaky(f, *, name="<file>", **kwargs):
        if str(name).startswith(newest):
            raise OSError(errno.EIO, "Input/output error")
        return real(f, name=name, **kwargs)

    monkeypatch.setattr(loading, "verify_footer", flaky)
    assert restored_step(mgr, tiny_run) == 2
    assert "I/O error" in mgr.last_restore["skipped"][0]["reason"]


def test_the_unsafe_pickle_message_names_the_blocked_global(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    path = tmp_path / "evil.pt"
    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    path.write_bytes(buf.getvalue())
    with pytest.raises(UnsafeCheckpointError, match=r"(posix|nt)\.system"):
        load_checkpoint(
            path, torch.nn.Linear(1, 1), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), None
        )


# ---------------------------------------------------------------- 7. files keep their owner and mode


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o604])
def test_overwriting_a_checkpoint_keeps_its_mode(tmp_path, tiny_run, mode):
    run = tiny_run(0)
    path = tmp_path / "last.pt"
    run.save(path)
    os.chmod(path, mode)
    run.train(1)
    run.save(path)
    assert (path.stat().st_mode & 0o777) == mode


def test_migrate_keeps_a_private_files_mode_on_the_file_and_its_backup(tmp_path, tiny_run):
    from ckpt_lesson.files.migrate import write_legacy_v1_checkpoint

    run = tiny_run(0)
    path = tmp_path / "old.pt"
    write_legacy_v1_checkpoint(run.model, run.optimizer, run.scheduler, run.state, path)
    os.chmod(path, 0o600)
    result = migrate_file(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert (Path(result.backup).stat().st_mode & 0o777) == 0o600


def test_a_new_file_follows_the_umask(tmp_path, tiny_run):
    old = os.umask(0o077)
    try:
        tiny_run(0).save(tmp_path / "new.pt")
    finally:
        os.umask(old)
    assert (tmp_path / "new.pt").stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------- 9. smaller ones


@pytest.mark.parametrize("name", ["step-٣٣٣٣٣٣٣٣", "step-１２３４５６７８", "step-۱۲۳۴۵۶۷۸"])
def test_step_folders_with_non_ascii_digits_are_not_saves(tmp_path, name):
    from ckpt_lesson.runs.layout import step_of

    (tmp_path / name).mkdir()
    assert step_of(name) is None
    assert scan_checkpoints(tmp_path) == []


@pytest.mark.parametrize("jump", [-3600.0, -60.0, -1e6])
def test_a_clock_stepped_back_delays_a_timed_save_by_at_most_one_interval(jump):
    from ckpt_lesson.runs.cost import SaveCadence

    now = [1000.0]
    cadence = SaveCadence(every_seconds=60, clock=lambda: now[0])
    now[0] += 30
    assert not cadence.should_save(1)
    now[0] += jump  # the wall clock is corrected backwards
    assert not cadence.should_save(2)
    now[0] += 61
    assert cadence.should_save(3)


def test_warm_start_refuses_a_v2_file_whose_footer_was_stripped_like_read_checkpoint(tmp_path, tiny_run):
    from ckpt_lesson.runs.warm_start import warm_start_from

    run = tiny_run(0)
    path = tmp_path / "x.pt"
    run.save(path)
    payload = torch.load(path, weights_only=True)
    buf = io.BytesIO()
    torch.save(payload, buf)  # the same v2 payload, written by plain torch.save: no footer
    path.write_bytes(buf.getvalue())
    with pytest.raises(CorruptCheckpointError, match="footer"):
        load_checkpoint(path, run.model, run.optimizer, run.scheduler)
    with pytest.raises(CorruptCheckpointError, match="footer"):
        warm_start_from(path, run.model)


@pytest.mark.parametrize("error", [28, 30, 5], ids=["ENOSPC", "EROFS", "EIO"])
def test_the_heartbeat_never_stops_training_and_leaves_no_temp_file(tmp_path, monkeypatch, error):
    from ckpt_lesson.runs import report

    def failing_replace(src, dst):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(report.os, "replace", failing_replace)
    assert report.record_progress(tmp_path, 3) is False
    assert list(tmp_path.iterdir()) == []
