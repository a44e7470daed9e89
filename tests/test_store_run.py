"""CheckpointManager on an object store: a real S3 API (moto server), s3fs over HTTP.

Also its staging space: no staged save outlives its process (real SIGKILLs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from _s3_server import options_for, read_only_options

from ckpt_lesson.errors import LoadEnvironmentError
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.files.storage_fsspec import FsspecStorage
from ckpt_lesson.runs.manager import CheckpointManager, StoreCheckpointManager
from ckpt_lesson.runs.store_commit import clean_uncommitted
from ckpt_lesson.runs.store_run import STAGING_PREFIX, StagingFolder, reclaim_dead_staging


def _save_steps(run, mgr, steps):
    for step in steps:
        run.train(until_step=step)
        mgr.save(run.model, run.optimizer, run.scheduler, run.state)


def test_a_url_builds_a_store_manager_that_saves_and_restores_bit_for_bit(tiny_run, s3_bucket):
    run = tiny_run(seed=1)
    with CheckpointManager(
        s3_bucket.url(), keep_last=2, every_steps=2, storage_options=s3_bucket.options
    ) as mgr:
        assert isinstance(mgr, StoreCheckpointManager)
        _save_steps(run, mgr, [2, 4, 6])
        assert mgr.all_steps() == [4, 6]
        assert mgr.latest_step() == 6
    fresh = tiny_run(seed=99)
    with CheckpointManager(s3_bucket.url(), storage_options=s3_bucket.options, every_steps=2) as mgr:
        state = mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler)
        assert mgr.last_restore["path"] == s3_bucket.url() + "/step-00000006"
    assert isinstance(state, TrainState) and state.step == 6
    for a, b in zip(run.model.state_dict().values(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_an_empty_prefix_restores_nothing_and_a_missing_bucket_names_the_bucket(tiny_run, s3_bucket):
    run = tiny_run(seed=1)
    with CheckpointManager(s3_bucket.url("empty"), storage_options=s3_bucket.options, every_steps=2) as mgr:
        assert mgr.restore_latest(run.model, run.optimizer, run.scheduler) is None
    with pytest.raises(LoadEnvironmentError, match="no-such-bucket-23"):
        CheckpointManager("s3://no-such-bucket-23/run", storage_options=s3_bucket.options, every_steps=2)


def _killed_writer(bucket, point):
    writer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_store_writer.py")
    env = {**os.environ, **bucket.env(), "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, writer, bucket.url(), point], env=env, timeout=300)
    assert done.returncode == -signal.SIGKILL


def test_a_writer_killed_mid_upload_leaves_no_committed_save_and_its_leftovers_go_after_the_lease(
    tiny_run, s3_bucket
):
    _killed_writer(s3_bucket, "part:2")
    store = FsspecStorage(s3_bucket.url(), s3_bucket.options)
    leftovers = [k for k in store.list_keys("step-00000004")]
    assert leftovers and "step-00000004/COMMIT" not in leftovers
    fresh = tiny_run(seed=7)
    with CheckpointManager(s3_bucket.url(), every_steps=2, storage_options=s3_bucket.options) as mgr:
        assert mgr.all_steps() == [2]
        assert mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler).step == 2
    assert store.list_keys("step-00000004") == leftovers  # the lease still runs: maybe a slow writer
    assert len(clean_uncommitted(store, now=time.time() + 3601)) == 1
    assert store.list_keys("step-00000004") == []


@pytest.mark.parametrize(("point", "expected"), [("manifest", 2), ("commit", 4)])
def test_kills_around_the_marker_restore_exactly_the_newest_committed_step_bit_for_bit(
    tiny_run, s3_bucket, point, expected
):
    _killed_writer(s3_bucket, point)
    twin = tiny_run(seed=4)  # the writer's run, replayed here to know the weights it saved
    twin.train(until_step=expected)
    fresh = tiny_run(seed=7)
    with CheckpointManager(s3_bucket.url(), every_steps=2, storage_options=s3_bucket.options) as mgr:
        assert mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler).step == expected
        assert mgr.last_restore["skipped"] == []  # no wrong choice, nothing corrupt on the way
    for a, b in zip(twin.model.state_dict().values(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_wrong_credentials_are_a_load_environment_error_naming_the_bucket(s3_bucket, monkeypatch):
    import moto.settings

    # moto checks signatures only when asked to; then an unknown access key is refused like on S3.
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    bad = options_for(s3_bucket.endpoint, key="AKIAWRONGWRONGWRONG0", secret="wrong")
    with pytest.raises(LoadEnvironmentError, match=f"bucket '{s3_bucket.name}'") as caught:
        CheckpointManager(s3_bucket.url(), every_steps=2, storage_options=bad)
    assert "damaged" not in str(caught.value)


def test_a_store_url_without_the_s3_extra_is_one_line_naming_the_extra(tmp_path):
    code = (
        "import sys; sys.modules['s3fs'] = None\n"
        "from ckpt_lesson.runs.manager import CheckpointManager\n"
        "CheckpointManager('s3://bucket/run', every_steps=1)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and "pip install ckpt_lesson[s3]" in last
    assert last.startswith("ckpt_lesson.errors.CheckpointError: s3://bucket/run:")


def test_the_state_api_and_async_saves_go_to_the_bucket_and_restore_bit_for_bit(s3_bucket):
    from ckpt_lesson import AsyncCheckpointer, capture_rng_state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    url = s3_bucket.url("state-api")
    with CheckpointManager(url, keep_last=2, every_steps=1, storage_options=s3_bucket.options) as mgr:
        mgr.save(1, {"model": model, "optimizer": opt, "hidden": torch.ones(2)})
        with AsyncCheckpointer(mgr) as ckpt:
            snap = capture_rng_state()
            expected = torch.rand(3)
            ckpt.save_async(2, {"model": model, "optimizer": opt, "hidden": torch.full((2,), 2.0)}, rng=snap)
        assert mgr.all_steps() == [1, 2]
    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with CheckpointManager(url, every_steps=1, storage_options=s3_bucket.options) as mgr:
        restored = mgr.restore_latest({"model": fresh, "optimizer": fresh_opt, "hidden": None})
    assert restored.step == 2 and restored.values["hidden"].tolist() == [2.0, 2.0]
    assert torch.equal(fresh.weight, model.weight) and torch.equal(torch.rand(3), expected)


def _files_under(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _watching_cache(cache, seen):
    """An event hook that lists the cache folder's files when the resume contract is checked:
    after the save was downloaded and verified, before any part is loaded."""

    def hook(name, info):
        if name == "resume_contract":
            seen.append(_files_under(cache))

    return hook


def _same_state(a, b):
    """Tensors and values of two state dicts are equal, bit for bit (nested dicts and lists too)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_restore_latest_from_a_bucket_loads_from_memory_bit_for_bit_and_writes_no_part_locally(
    tiny_run, s3_bucket, tmp_path
):
    run = tiny_run(seed=1)
    with CheckpointManager(s3_bucket.url(), every_steps=2, storage_options=s3_bucket.options) as mgr:
        _save_steps(run, mgr, [2, 4])
    fresh, cache, seen = tiny_run(seed=99), tmp_path / "cache", []
    with CheckpointManager(
        s3_bucket.url(),
        every_steps=2,
        storage_options=s3_bucket.options,
        cache_dir=cache,
        on_event=_watching_cache(cache, seen),
    ) as mgr:
        state = mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler)
        assert mgr.last_restore["path"] == s3_bucket.url() + "/step-00000004"
        assert mgr.last_restore["skipped"] == []
    assert seen == [[]]  # verified and about to load: still no file in the cache folder
    assert _files_under(cache) == []
    assert state.step == 4 and state.to_dict() == run.state.to_dict()
    assert _same_state(fresh.model.state_dict(), run.model.state_dict())
    assert _same_state(fresh.optimizer.state_dict(), run.optimizer.state_dict())
    assert _same_state(fresh.scheduler.state_dict(), run.scheduler.state_dict())


def test_restore_latest_from_a_bucket_through_the_state_api_loads_from_memory_bit_for_bit(
    s3_bucket, tmp_path
):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    url = s3_bucket.url("state-memory")
    with CheckpointManager(url, every_steps=1, storage_options=s3_bucket.options) as mgr:
        mgr.save(3, {"model": model, "optimizer": opt, "hidden": torch.arange(5.0), "best": 0.25})
    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    cache, seen = tmp_path / "cache", []
    with CheckpointManager(
        url,
        every_steps=1,
        storage_options=s3_bucket.options,
        cache_dir=cache,
        on_event=_watching_cache(cache, seen),
    ) as mgr:
        restored = mgr.restore_latest({"model": fresh, "optimizer": fresh_opt, "hidden": None, "best": None})
    assert seen == [[]] and _files_under(cache) == []
    assert restored.step == 3 and restored.path == url + "/step-00000003"
    assert restored.values["best"] == 0.25 and torch.equal(restored.values["hidden"], torch.arange(5.0))
    assert _same_state(fresh.state_dict(), model.state_dict())
    assert _same_state(fresh_opt.state_dict(), opt.state_dict())


def test_a_sharded_save_restores_from_a_bucket_bit_for_bit_and_leaves_the_cache_folder_empty(
    tiny_run, s3_bucket, tmp_path
):
    run = tiny_run(seed=2)
    url = s3_bucket.url("sharded")
    with CheckpointManager(url, every_steps=2, num_shards=2, storage_options=s3_bucket.options) as mgr:
        _save_steps(run, mgr, [2])
    fresh, cache = tiny_run(seed=98), tmp_path / "cache"
    with CheckpointManager(url, every_steps=2, storage_options=s3_bucket.options, cache_dir=cache) as mgr:
        state = mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler)
        assert mgr.last_restore["path"] == url + "/step-00000002" and mgr.last_restore["layout"] == "sharded"
    assert _files_under(cache) == []  # its parts went through the cache folder and were removed again
    assert state.step == 2 and _same_state(fresh.model.state_dict(), run.model.state_dict())
    assert _same_state(fresh.optimizer.state_dict(), run.optimizer.state_dict())


def test_wrong_credentials_during_a_restore_are_a_load_environment_error_not_damage(
    tiny_run, s3_bucket, monkeypatch
):
    import moto.settings

    run = tiny_run(seed=1)
    with CheckpointManager(s3_bucket.url(), every_steps=2, storage_options=s3_bucket.options) as mgr:
        _save_steps(run, mgr, [2])
        # From here on moto checks signatures, and the fixture's key is not one it knows: the same
        # as credentials that expired or were revoked while the run was down.
        monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
        with pytest.raises(LoadEnvironmentError, match=f"bucket '{s3_bucket.name}'") as caught:
            mgr.restore_latest(run.model, run.optimizer, run.scheduler)
    assert "damaged" not in str(caught.value) and "none is usable" not in str(caught.value)


def test_odd_keys_under_the_prefix_are_skipped_with_a_warning_and_never_touched(tiny_run, s3_bucket, caplog):
    # Anyone who can write to the bucket can leave any key there: a manager must still open, save,
    # clean and restore, and never read or delete a key it does not fully recognize.
    run = tiny_run(seed=5)
    fs = s3_bucket.fs()
    odd = [
        "run/step-00000005/junk/../x",  # leaves its folder: once refused every manager
        "run/step-00000002//x",
        "run/step-00000002/./LEASE",
        "run/step-00000002/not-a-save-id/checkpoint.pt",  # safe to name, but not ours: never deleted
        "run/step-000000002/" + "a" * 32 + "/LEASE",  # a step folder we never write (9 digits)
    ]
    for key in odd:
        fs.call_s3("put_object", Bucket=s3_bucket.name, Key=key, Body=b"not ours")
    with caplog.at_level("WARNING", logger="ckpt_lesson.files.storage"):
        with CheckpointManager(
            s3_bucket.url(), keep_last=1, every_steps=2, storage_options=s3_bucket.options
        ) as mgr:
            _save_steps(run, mgr, [2, 4])  # retention deletes step 2 on the store
            assert mgr.all_steps() == [4]
            assert mgr.clean_stale() == []
        fresh = tiny_run(seed=9)
        with CheckpointManager(s3_bucket.url(), storage_options=s3_bucket.options, every_steps=2) as mgr:
            assert mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler).step == 4
    assert any("step-00000005/junk/../x" in r.getMessage() for r in caplog.records)
    for a, b in zip(run.model.state_dict().values(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    left = {o["Key"] for o in fs.call_s3("list_objects_v2", Bucket=s3_bucket.name)["Contents"]}
    assert set(odd) <= left
    assert clean_uncommitted(FsspecStorage(s3_bucket.url(), s3_bucket.options), now=time.time() + 1e6) == []
    assert set(odd) <= {o["Key"] for o in fs.call_s3("list_objects_v2", Bucket=s3_bucket.name)["Contents"]}


def _objects(bucket):
    listed = bucket.fs().call_s3("list_objects_v2", Bucket=bucket.name).get("Contents", [])
    return {(o["Key"], o["ETag"]) for o in listed}


def test_read_only_credentials_restore_scan_and_report_and_write_nothing(tiny_run, s3_bucket, monkeypatch):
    import moto.settings

    from ckpt_lesson.errors import CheckpointError
    from ckpt_lesson.runs.report import read_recovery_log
    from ckpt_lesson.runs.scan import scan_checkpoints

    run = tiny_run(seed=4)
    with CheckpointManager(s3_bucket.url(), every_steps=2, storage_options=s3_bucket.options) as mgr:
        _save_steps(run, mgr, [2, 4])
    # A dead writer's upload (no LEASE): any cleanup would delete it, so it shows that none ran.
    dead = "run/step-00000006/" + "d" * 32 + "/checkpoint.pt"
    s3_bucket.fs().call_s3("put_object", Bucket=s3_bucket.name, Key=dead, Body=b"partial")
    reader = read_only_options(s3_bucket)
    before = _objects(s3_bucket)
    # moto enforces IAM policies once asked to; from here every request is checked against them.
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    fresh = tiny_run(seed=8)
    with CheckpointManager(s3_bucket.url(), every_steps=2, storage_options=reader) as mgr:
        assert mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler).step == 4
        assert mgr.all_steps() == [2, 4] and mgr.latest_step() == 4
    for a, b in zip(run.model.state_dict().values(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert [(r.step, r.status) for r in scan_checkpoints(s3_bucket.url(), reader)] == [
        (2, "ok"),
        (4, "ok"),
        (6, "incomplete"),
    ]
    assert read_recovery_log(s3_bucket.url(), reader) == []
    with CheckpointManager(s3_bucket.url(), every_steps=2, storage_options=reader, read_only=True) as mgr:
        assert mgr.restore_latest(fresh.model, fresh.optimizer, fresh.scheduler).step == 4
        fresh.train(until_step=8)
        with pytest.raises(CheckpointError, match="read_only=True") as refused:
            mgr.save(fresh.model, fresh.optimizer, fresh.scheduler, fresh.state)
        assert "\n" not in str(refused.value)
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))
    assert _objects(s3_bucket) == before


def test_a_read_only_manager_refuses_to_save_in_one_line_and_the_first_save_runs_the_probe(
    tiny_run, s3_bucket
):
    from ckpt_lesson.errors import CheckpointError

    run = tiny_run(seed=2)
    run.train(until_step=2)
    with CheckpointManager(
        s3_bucket.url(), every_steps=2, read_only=True, storage_options=s3_bucket.options
    ) as mgr:
        with pytest.raises(CheckpointError, match=r"read_only=True and never writes"):
            mgr.save(run.model, run.optimizer, run.scheduler, run.state)
        with pytest.raises(CheckpointError, match=r"read_only=True"):
            mgr.save(2, {"model": run.model})
    assert _objects(s3_bucket) == set()
    with CheckpointManager(s3_bucket.url(), every_steps=2, storage_options=s3_bucket.options) as mgr:
        assert _objects(s3_bucket) == set()  # opened: nothing written yet
        mgr.save(run.model, run.optimizer, run.scheduler, run.state)
    keys = {k for k, _ in _objects(s3_bucket)}
    assert "run/step-00000002/COMMIT" in keys and not any("probe" in k for k in keys)


# ---------------------------------------------------------------- staging space

_TESTS = os.path.dirname(os.path.abspath(__file__))


def _child(code, *, env=None, tmpdir=None):
    full = {**os.environ, **(env or {}), "PYTHONPATH": os.getcwd()}
    if tmpdir is not None:
        full["TMPDIR"] = str(tmpdir)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)


def _staging(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(STAGING_PREFIX))


_KILLED_HOLDER = """
import os, signal, sys
from ckpt_lesson.runs.store_run import StagingFolder
folder = StagingFolder(sys.argv[1] if len(sys.argv) > 1 else None)
(folder.path / "step-00000004").mkdir()
(folder.path / "step-00000004" / "checkpoint.pt").write_bytes(b"x" * 100_000)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_dead_owners_folder_is_reclaimed_and_one_in_use_never_is(tmp_path):
    alive = StagingFolder(tmp_path)
    (alive.path / "staged.pt").write_bytes(b"in use")
    killed = _child(_KILLED_HOLDER, tmpdir=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert len(_staging(tmp_path)) == 2
    older = tmp_path / f"{STAGING_PREFIX}older-version"  # no lock file: nothing proves its owner is gone
    older.mkdir()
    second = StagingFolder(tmp_path)  # reclaims on the way in
    assert set(_staging(tmp_path)) == {alive.path.name, second.path.name, older.name}
    assert (alive.path / "staged.pt").read_bytes() == b"in use"
    assert reclaim_dead_staging(tmp_path) == []  # both live folders are locked, even within one process
    second.remove()
    alive.remove()
    alive.remove()  # idempotent
    assert _staging(tmp_path) == [older.name]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt-lesson")] == []


def test_interpreter_exit_removes_the_current_folder(tmp_path):
    done = _child(
        "from ckpt_lesson.runs.store_run import StagingFolder\n"
        "f = StagingFolder(); (f.path / 'a.pt').write_bytes(b'x'); print(f.path)\n",
        tmpdir=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(tmp_path)) and _staging(tmp_path) == []


_SAVE_AND_EXIT = """
import sys
sys.path.insert(0, {tests!r})
from conftest import build_tiny_run
from ckpt_lesson.runs.manager import CheckpointManager
run = build_tiny_run(seed=1)
mgr = CheckpointManager(sys.argv[1], every_steps=2)
run.train(until_step=2)
mgr.save(run.model, run.optimizer, run.scheduler, run.state)
print(mgr.run_dir)
# no close(): interpreter exit must remove the staging folder
"""


def test_a_run_killed_mid_upload_leaves_nothing_in_tmpdir_once_any_later_run_has_started(s3_bucket, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    writer = os.path.join(_TESTS, "_store_writer.py")
    env = {**os.environ, **s3_bucket.env(), "PYTHONPATH": os.getcwd(), "TMPDIR": str(tmpdir)}
    killed = subprocess.run([sys.executable, writer, s3_bucket.url("a"), "part:1"], env=env, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    (left,) = _staging(tmpdir)  # the killed writer's staged save of step 4, whole
    assert [p.name for p in (tmpdir / left).iterdir() if p.name.startswith("step-")] == ["step-00000004"]
    # A run on another prefix, which exits without close(): afterwards TMPDIR holds nothing of either.
    code = _SAVE_AND_EXIT.format(tests=_TESTS)
    done = subprocess.run(
        [sys.executable, "-c", code, s3_bucket.url("b")], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(tmpdir / STAGING_PREFIX))
    assert _staging(tmpdir) == []
