"""CheckpointManager: commit protocol, retention, stale staging, restore with fallback."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_lesson.course.training import (
    SyntheticRegression,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
    train,
)
from ckpt_lesson.errors import CheckpointError, CorruptCheckpointError
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.files.hashing import DEFAULT_ALGO, digest_bytes
from ckpt_lesson.runs.layout import read_manifest
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.manager_config import ManagerConfig
from ckpt_lesson.runs.retention import KeepBest
from ckpt_lesson.runs.scan import scan_checkpoints

SEED = 3


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def build(seed: int = SEED):
    """Seed everything, then build data, model, optimizer, scheduler (the resume recipe)."""
    seed_everything(seed)
    data = SyntheticRegression(n=64, seed=seed)
    model = make_model(hidden=16)
    opt, sched = make_optimizer_and_scheduler(model, total_steps=40)
    return data, model, opt, sched


def run_with_manager(mgr, until_step, state=None, stop_after=None, built=None):
    data, model, opt, sched = built or build()
    state = state or TrainState()

    def after_step(st, record):
        if mgr.should_save(st.step):
            mgr.save(model, opt, sched, st)
        return stop_after is not None and st.step >= stop_after

    train(
        model, opt, sched, state, data, until_step=until_step, seed=SEED, batch_size=8, after_step=after_step
    )
    mgr.wait_retention()  # retention runs behind the saves; these tests look at the folders after it
    return state


def reference_losses(until_step):
    data, model, opt, sched = build()
    state = TrainState()
    train(model, opt, sched, state, data, until_step=until_step, seed=SEED, batch_size=8)
    return state.losses


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    path.write_bytes(bytes(data))


def names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir())


# ---------------------------------------------------------------- saving and retention


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("storage_options", {"key": "k"}),
        ("cache_dir", "cache"),
        ("read_only", True),
        ("timeout", 5.0),
        ("lease_seconds", 60.0),
    ],
)
def test_a_store_option_given_for_a_folder_is_refused_by_name_and_nothing_is_created(tmp_path, option, value):
    with pytest.raises(CheckpointError, match=f"{option} only apply to an object store"):
        CheckpointManager(tmp_path / "run", keep_last=1, every_steps=1, **{option: value})
    assert not (tmp_path / "run").exists()


def test_a_folder_manager_has_no_store_and_its_url_is_its_folder(tmp_path):
    with CheckpointManager(tmp_path / "run", keep_last=1, every_steps=1) as mgr:
        assert mgr.store is None and mgr.storage is None
        assert mgr.url == str(tmp_path / "run")


def test_save_and_purge_keeps_last_k_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, every_steps=3)
    run_with_manager(mgr, until_step=12)
    assert names(tmp_path) == ["step-00000009", "step-00000012"]
    assert mgr.all_steps() == [9, 12]
    assert mgr.latest_step() == 12
    assert sorted(os.listdir(tmp_path / "step-00000012")) == ["checkpoint.pt", "manifest.json"]


def test_manifest_records_every_part_with_its_real_digest_and_the_run_description(tmp_path):
    data = {"fingerprint": "abc", "order_seed": SEED}
    mgr = CheckpointManager(tmp_path, every_steps=5, data=data, metadata={"run_id": "r1"})
    run_with_manager(mgr, until_step=5)
    manifest = read_manifest(tmp_path / "step-00000005")
    assert manifest["schema"] == "ckpt.manifest.v1"
    assert manifest["layout"] == "single" and manifest["step"] == 5
    assert manifest["state"] == {"step": 5, "epoch": 0, "batch_in_epoch": 5}
    assert manifest["covers"] == ["model", "optimizer", "scheduler", "state", "rng"]
    assert manifest["data"] == data and manifest["metadata"] == {"run_id": "r1"}
    assert len(manifest["save_id"]) == 32
    [part] = manifest["parts"]
    blob = (tmp_path / "step-00000005" / "checkpoint.pt").read_bytes()
    digest = digest_bytes(blob, DEFAULT_ALGO)
    assert part == {"file": "checkpoint.pt", "bytes": len(blob), "algo": DEFAULT_ALGO, "digest": digest}


def test_events_come_in_commit_order_and_retention_deletes_only_after_the_new_save_is_verified(tmp_path):
    events = []
    mgr = CheckpointManager(tmp_path, keep_last=1, every_steps=2, on_event=lambda n, i: events.append((n, i)))
    run_with_manager(mgr, until_step=4)
    order = [n for n, _ in events]
    second = order[order.index("save_end") + 1 :]
    assert second == [
        "save_begin",
        "part_begin",
        "part_written",
        "parts_complete",
        "manifest_written",
        "verified",
        "published",
        "save_end",
        "retention_delete",  # behind the save, on the retention thread
        "retention_renamed",
    ]
    assert events[order.index("retention_delete")][1] == {"step": 2}
    assert names(tmp_path) == ["step-00000004"]


def test_the_save_holds_its_staging_lock_until_it_is_published(tmp_path):
    from ckpt_lesson.runs.commit import writer_is_dead

    seen = {}

    def hook(name, info):
        if name == "parts_complete":
            [staging] = [p for p in tmp_path.iterdir() if p.name.startswith(".staging-")]
            seen["dead_while_saving"] = writer_is_dead(staging)

    mgr = CheckpointManager(tmp_path, every_steps=1, on_event=hook)
    run_with_manager(mgr, until_step=1)
    assert seen == {"dead_while_saving": False}
    assert not (tmp_path / "step-00000001" / ".lock").exists()


def test_an_error_mid_save_leaves_no_staging_folder_and_publishes_nothing(tmp_path):
    def hook(name, info):
        if name == "manifest_written":
            raise KeyboardInterrupt

    mgr = CheckpointManager(tmp_path, every_steps=1, on_event=hook)
    with pytest.raises(KeyboardInterrupt):
        run_with_manager(mgr, until_step=1)
    assert names(tmp_path) == []


def test_verify_on_save_catches_bytes_that_changed_after_writing_and_publishes_nothing(tmp_path):
    def hook(name, info):
        if name == "manifest_written":
            [staging] = [p for p in tmp_path.iterdir() if p.name.startswith(".staging-")]
            flip_byte(staging / "checkpoint.pt")

    mgr = CheckpointManager(tmp_path, every_steps=1, on_event=hook, verify_on_save="device")
    with pytest.raises(CorruptCheckpointError, match="re-read differently"):
        run_with_manager(mgr, until_step=1)
    assert names(tmp_path) == []


def test_saving_a_step_that_is_already_saved_is_refused(tmp_path):
    data, model, opt, sched = build()
    mgr = CheckpointManager(tmp_path, every_steps=1)
    mgr.save(model, opt, sched, TrainState(step=5))
    with pytest.raises(CheckpointError, match="step 5 is already saved.*call restore_latest first"):
        mgr.save(model, opt, sched, TrainState(step=5))


def test_a_corrupt_save_of_the_same_step_is_quarantined_not_deleted(tmp_path, caplog):
    data, model, opt, sched = build()
    mgr = CheckpointManager(tmp_path, every_steps=1)
    mgr.save(model, opt, sched, TrainState(step=5))
    flip_byte(tmp_path / "step-00000005" / "checkpoint.pt")
    with caplog.at_level(logging.WARNING, logger="ckpt_lesson.runs.manager"):
        mgr.save(model, opt, sched, TrainState(step=5))
    quarantined = [n for n in names(tmp_path) if n.startswith(".quarantine-step-00000005-")]
    assert len(quarantined) == 1
    assert "moved it aside" in caplog.text
    assert mgr.latest_step() == 5


def test_a_failed_delete_warns_and_training_goes_on(tmp_path, monkeypatch, caplog):
    real_replace = os.replace

    def refuse_deletes(src, dst):
        if Path(dst).name.startswith(".deleting-"):
            raise PermissionError(13, "Permission denied")
        return real_replace(src, dst)

    monkeypatch.setattr("ckpt_lesson.runs.manager.os.replace", refuse_deletes)
    mgr = CheckpointManager(tmp_path, keep_last=1, every_steps=2)
    with caplog.at_level(logging.WARNING, logger="ckpt_lesson.runs.manager"):
        state = run_with_manager(mgr, until_step=6)
    assert state.step == 6
    assert mgr.all_steps() == [2, 4, 6]
    assert "could not delete step-00000002" in caplog.text
    monkeypatch.undo()
    assert mgr.apply_retention() == [2, 4]  # retried once the disk allows it
    assert mgr.all_steps() == [6]


def test_keep_best_policy_keeps_the_best_metric_save_alongside_the_last(tmp_path):
    val_loss = {}
    mgr = CheckpointManager(tmp_path, every_steps=1, retention=KeepBest(val_loss, k_best=1, keep_last=1))
    data, model, opt, sched = build()
    for step, loss in [(1, 0.9), (2, 0.2), (3, 0.5), (4, 0.7)]:
        val_loss[step] = loss
        mgr.save(model, opt, sched, TrainState(step=step))
    assert mgr.all_steps() == [2, 4]


# ---------------------------------------------------------------- cadence and config


def test_wall_clock_cadence_with_a_fake_clock_saves_when_the_interval_passes(tmp_path):
    clock = FakeClock()
    mgr = CheckpointManager(tmp_path, every_seconds=30.0, clock=clock, keep_last=10)
    data, model, opt, sched = build()
    state = TrainState()

    def after_step(st, record):
        clock.now += 7.0  # each step "takes" 7 seconds
        if mgr.should_save(st.step):
            mgr.save(model, opt, sched, st)

    train(model, opt, sched, state, data, until_step=12, seed=SEED, batch_size=8, after_step=after_step)
    assert mgr.all_steps() == [5, 10]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_last": 0, "every_steps": 1}, "keep_last must be an int >= 1"),
        ({"every_steps": 0}, "every_steps must be"),
        ({"every_seconds": -5}, "every_seconds must be"),
        ({}, "set every_steps, every_seconds or both"),
        ({"every_steps": 1, "num_shards": 0}, "num_shards must be"),
        ({"every_steps": 1, "metadata": {"f": object()}}, "metadata must hold only JSON"),
        ({"every_steps": 1, "data": ["x"]}, "data must be a dict"),
    ],
)
def test_config_validation_errors_say_what_is_wrong(tmp_path, kwargs, match):
    with pytest.raises(CheckpointError, match=match):
        CheckpointManager(tmp_path, **kwargs)
    with pytest.raises(ValueError, match=match):  # CheckpointError is a ValueError
        ManagerConfig(**kwargs)


def test_manager_config_is_frozen_and_keyword_only():
    config = ManagerConfig(every_steps=2)
    with pytest.raises(AttributeError):
        config.keep_last = 5
    with pytest.raises(TypeError):
        ManagerConfig(3)


def test_a_file_as_run_dir_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        CheckpointManager(tmp_path / "f", every_steps=1)


def test_a_closed_manager_refuses_to_save_and_works_as_a_context_manager(tmp_path):
    data, model, opt, sched = build()
    with CheckpointManager(tmp_path, every_steps=1) as mgr:
        mgr.save(model, opt, sched, TrainState(step=1))
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(model, opt, sched, TrainState(step=2))


# ---------------------------------------------------------------- restore


def test_restore_latest_returns_none_for_an_empty_run_dir(tmp_path):
    data, model, opt, sched = build()
    mgr = CheckpointManager(tmp_path / "new", every_steps=1)
    assert mgr.restore_latest(model, opt, sched) is None
    assert mgr.last_restore["step"] is None and mgr.last_restore["skipped"] == []


def test_restore_latest_resumes_bit_for_bit_from_a_single_file_save(tmp_path):
    reference = reference_losses(14)
    mgr = CheckpointManager(tmp_path, every_steps=4)
    run_with_manager(mgr, until_step=14, stop_after=10)  # "crash" after step 10; last save was step 8
    built = build()
    _, model, opt, sched = built
    mgr2 = CheckpointManager(tmp_path, every_steps=4)
    state = mgr2.restore_latest(model, opt, sched)
    assert state.step == 8 and mgr2.last_restore["step"] == 8
    run_with_manager(mgr2, until_step=14, state=state, built=built)
    assert state.losses == reference


def test_restore_latest_resumes_bit_for_bit_from_a_sharded_save(tmp_path):
    reference = reference_losses(14)
    mgr = CheckpointManager(tmp_path, every_steps=4, num_shards=3)
    run_with_manager(mgr, until_step=14, stop_after=10)
    files = sorted(os.listdir(tmp_path / "step-00000008"))
    assert files == [
        "index.json",
        "manifest.json",
        "meta.pt",
        "model.shard-000.pt",
        "model.shard-001.pt",
        "model.shard-002.pt",
    ]
    parts = [p["file"] for p in read_manifest(tmp_path / "step-00000008")["parts"]]
    assert parts[-2:] == ["meta.pt", "index.json"]
    built = build()
    _, model, opt, sched = built
    mgr2 = CheckpointManager(tmp_path, every_steps=4, num_shards=3)
    state = mgr2.restore_latest(model, opt, sched)
    assert state.step == 8 and mgr2.last_restore["layout"] == "sharded"
    run_with_manager(mgr2, until_step=14, state=state, built=built)
    assert state.losses == reference


def test_restore_latest_skips_a_corrupt_newer_save_and_logs_why(tmp_path, caplog):
    reference = reference_losses(12)
    mgr = CheckpointManager(tmp_path, every_steps=4, keep_last=3)
    run_with_manager(mgr, until_step=12)
    flip_byte(tmp_path / "step-00000012" / "checkpoint.pt")
    built = build()
    _, model, opt, sched = built
    mgr2 = CheckpointManager(tmp_path, every_steps=4)
    with caplog.at_level(logging.WARNING, logger="ckpt_lesson.runs.manager"):
        state = mgr2.restore_latest(model, opt, sched)
    assert state.step == 8
    assert "skipping step-00000012 (corrupt)" in caplog.text
    assert "after skipping 1 newer save(s)" in caplog.text
    [skip] = mgr2.last_restore["skipped"]
    assert (skip["step"], skip["status"]) == (12, "corrupt")
    assert mgr2.last_restore["save_id"] == read_manifest(tmp_path / "step-00000008")["save_id"]
    run_with_manager(mgr2, until_step=12, state=state, built=built)  # re-does steps 9..12 (quarantines 12)
    assert state.losses == reference
    assert mgr2.latest_step() == 12


def test_restore_latest_ignores_a_staging_dir_and_a_step_dir_without_manifest(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, every_steps=4)
    run_with_manager(mgr, until_step=8)
    (tmp_path / "step-00000008" / "manifest.json").unlink()
    staging = tmp_path / ".staging-step-00000012-4242-abcdef12"
    staging.mkdir()
    (staging / "checkpoint.pt").write_bytes(b"partial")
    _, model, opt, sched = build()
    with caplog.at_level(logging.WARNING, logger="ckpt_lesson.runs.manager"):
        state = CheckpointManager(tmp_path, every_steps=4).restore_latest(model, opt, sched)
    assert state.step == 4
    assert "skipping step-00000008 (incomplete)" in caplog.text
    assert "staging" not in caplog.text


def test_restore_latest_names_a_missing_part_as_incomplete(tmp_path):
    mgr = CheckpointManager(tmp_path, every_steps=4, num_shards=2)
    run_with_manager(mgr, until_step=8)
    (tmp_path / "step-00000008" / "model.shard-001.pt").unlink()
    _, model, opt, sched = build()
    mgr2 = CheckpointManager(tmp_path, every_steps=4, num_shards=2)
    assert mgr2.restore_latest(model, opt, sched).step == 4
    [skip] = mgr2.last_restore["skipped"]
    assert skip["status"] == "incomplete" and "model.shard-001.pt is missing" in skip["reason"]


def test_restore_latest_refuses_when_saves_exist_but_none_is_good_and_lists_each_reason(tmp_path):
    mgr = CheckpointManager(tmp_path, every_steps=4)
    run_with_manager(mgr, until_step=8)
    flip_byte(tmp_path / "step-00000008" / "checkpoint.pt")
    with open(tmp_path / "step-00000004" / "checkpoint.pt", "r+b") as f:
        f.truncate(100)
    _, model, opt, sched = build()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match="2 save\\(s\\) found but none is usable") as exc:
        CheckpointManager(tmp_path, every_steps=4).restore_latest(model, opt, sched)
    assert "step 8: corrupt" in str(exc.value) and "step 4: corrupt" in str(exc.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_latest_step_is_the_newest_save_that_verifies(tmp_path):
    mgr = CheckpointManager(tmp_path, every_steps=2, keep_last=5)
    run_with_manager(mgr, until_step=6)
    assert mgr.latest_step() == 6
    flip_byte(tmp_path / "step-00000006" / "checkpoint.pt")
    assert mgr.latest_step() == 4
    assert [r.status for r in scan_checkpoints(tmp_path)] == ["ok", "ok", "corrupt"]


# ---------------------------------------------------------------- stale staging folders

HOLD_LOCK = (
    "import fcntl, os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDWR)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('locked', flush=True)\n"
    "sys.stdin.read()\n"
)


def _staging_with_lock(run_dir: Path, name: str) -> Path:
    staging = run_dir / name
    staging.mkdir(parents=True)
    (staging / ".lock").touch()
    (staging / "checkpoint.pt").write_bytes(b"half a save")
    return staging


def _hold(lock: Path) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "locked"
    return child


def test_stale_staging_of_a_dead_process_is_cleaned_but_one_held_by_a_live_process_is_not(tmp_path):
    dead = _staging_with_lock(tmp_path, ".staging-step-00000004-111-aaaaaaaa")
    live = _staging_with_lock(tmp_path, ".staging-step-00000008-222-bbbbbbbb")
    killed = _hold(dead / ".lock")
    killed.kill()  # SIGKILL: the kernel still releases its flock
    killed.wait(timeout=10)
    holder = _hold(live / ".lock")
    try:
        mgr = CheckpointManager(tmp_path, every_steps=1)
        assert not dead.exists()
        assert live.exists()
        run_with_manager(mgr, until_step=1)  # a save also cleans up, and still spares the live one
        assert live.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    assert mgr.clean_stale() == [live.name]
    assert names(tmp_path) == ["step-00000001"]


def test_a_staging_folder_without_lock_is_stale_only_once_it_is_old(tmp_path):
    fresh = tmp_path / ".staging-step-00000004-111-aaaaaaaa"
    fresh.mkdir()
    mgr = CheckpointManager(tmp_path, every_steps=1)
    assert fresh.exists()  # its writer may be between mkdir and creating the lock
    old = 1_000_000_000
    os.utime(fresh, (old, old))
    assert mgr.clean_stale() == [fresh.name]


def test_leftover_deleting_folders_are_removed_on_open(tmp_path):
    (tmp_path / ".deleting-step-00000002-abcdef12").mkdir()
    CheckpointManager(tmp_path, every_steps=1)
    assert names(tmp_path) == []


def test_manifest_json_is_plain_json_any_tool_can_read(tmp_path):
    mgr = CheckpointManager(tmp_path, every_steps=1)
    run_with_manager(mgr, until_step=1)
    manifest = json.loads((tmp_path / "step-00000001" / "manifest.json").read_text())
    assert manifest["payload_schema"] == "ckpt.v2"
    assert set(manifest["env"]) >= {"torch", "numpy", "python", "device_type", "world_size"}


# ------------------------------------------ property: crashes never cost the last good save

OPS = ("save", "save", "save", "crash_staging", "truncate", "flip", "drop_manifest", "reopen")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=12), k=st.integers(1, 3), data=st.data())
def test_random_saves_crashes_and_purges_never_lose_the_newest_good_save(ops, k, data):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        mgr = CheckpointManager(run_dir, keep_last=k, every_steps=1)
        saved: set[int] = set()
        damaged: set[int] = set()
        step = crashes = 0

        def good() -> set[int]:
            return {s for s in saved if s not in damaged and (run_dir / f"step-{s:08d}").is_dir()}

        for op in ops:
            published = sorted(s for s in saved if (run_dir / f"step-{s:08d}").is_dir())
            had_good = bool(good())
            if op == "save":
                step += 1
                mgr.save(model, opt, None, TrainState(step=step))
                mgr.wait_retention()
                saved.add(step)
                assert step in good()
                assert not [p for p in run_dir.iterdir() if p.name.startswith(".staging-")]
            elif op == "crash_staging":
                crashes += 1
                _staging_with_lock(run_dir, f".staging-step-{step + 1:08d}-99999-{crashes:08x}")
            elif op == "reopen":
                mgr = CheckpointManager(run_dir, keep_last=k, every_steps=1)
            elif published:
                victim = data.draw(st.sampled_from(published), label="victim")
                folder = run_dir / f"step-{victim:08d}"
                if op == "truncate" and (folder / "checkpoint.pt").exists():
                    with open(folder / "checkpoint.pt", "r+b") as f:
                        f.truncate(max(1, (folder / "checkpoint.pt").stat().st_size // 2))
                elif op == "flip" and (folder / "checkpoint.pt").exists():
                    # A different offset each time: flipping one byte twice would undo the damage.
                    flip_byte(folder / "checkpoint.pt", 64 + 7 * len(damaged) + victim)
                elif op == "drop_manifest":
                    (folder / "manifest.json").unlink(missing_ok=True)
                damaged.add(victim)
            if op == "save" and had_good:
                assert good(), "a purge left no good save although one existed"
            expected = max(good()) if good() else None
            assert mgr.latest_step() == expected
        ok = {r.step for r in scan_checkpoints(run_dir) if r.ok}
        assert ok == good()
        fresh = torch.nn.Linear(2, 1)
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
        any_saves = any(p.name.startswith("step-") for p in run_dir.iterdir())
        if good():
            restored = CheckpointManager(run_dir, every_steps=1).restore_latest(fresh, fresh_opt, None)
            assert restored.step == max(good())
        elif any_saves:
            with pytest.raises(CheckpointError, match="none is usable"):
                CheckpointManager(run_dir, every_steps=1).restore_latest(fresh, fresh_opt, None)


def _package_imports(module: str) -> set[str]:
    """The package's modules that ``module``'s source imports (any depth in the file), by name."""
    import ast

    source = Path(__file__).resolve().parents[1] / (module.replace(".", "/") + ".py")
    found = set()
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("ckpt_lesson")
        ):
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("ckpt_lesson")}
    root = Path(__file__).resolve().parents[1]
    return {name for name in found if (root / (name.replace(".", "/") + ".py")).is_file()}


def test_a_single_process_save_needs_no_multi_rank_module():
    reached, todo = set(), ["ckpt_lesson.runs.manager"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(_package_imports(module))
    assert "ckpt_lesson.runs.save_parts" in reached and "ckpt_lesson.runs.store_commit" in reached
    assert not [m for m in reached if "dcp" in m or ".distributed" in m], sorted(reached)
