"""Retention rules: pure functions over step numbers, tested without disk. Then retention off the
training thread: the save returns before the deletion, the next save waits only when the deleter
falls behind, and a kill during a background deletion loses nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.retention import KeepBest, KeepLastK, keep_last_k
from ckpt_lesson.runs.scan import scan_checkpoints


def test_keep_last_k_deletes_everything_older_than_the_k_newest_verified():
    assert keep_last_k([10, 20, 30, 40, 50], verified={10, 20, 30, 40, 50}, k=3) == [10, 20]


def test_keep_last_k_deletes_nothing_when_fewer_than_k_are_verified():
    assert keep_last_k([10, 20, 30], verified={30}, k=2) == []
    assert keep_last_k([], verified=set(), k=1) == []


def test_keep_last_k_keeps_an_unverified_save_between_kept_ones_and_deletes_older_unverified():
    # 30 is corrupt but newer than the oldest kept verified save (20): left alone as evidence.
    assert keep_last_k([10, 15, 20, 30, 40], verified={10, 20, 40}, k=2) == [10, 15]


def test_keep_last_k_counts_only_verified_saves_not_all_saves():
    # Three newest are unverified; the only good save (10) must survive.
    assert keep_last_k([10, 20, 30, 40], verified={10}, k=1) == []


def test_keep_last_k_ignores_order_duplicates_and_verified_steps_not_present():
    assert keep_last_k([40, 10, 30, 10, 20], verified={10, 20, 30, 40, 99}, k=2) == [10, 20]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_keep_last_k_rejects_a_k_that_could_keep_nothing(bad):
    with pytest.raises(CheckpointError, match="k must be an int >= 1"):
        keep_last_k([1, 2], verified={1, 2}, k=bad)


def test_keep_last_k_policy_object_matches_the_function():
    assert KeepLastK(2).to_delete([1, 2, 3, 4], verified={1, 2, 3, 4}) == [1, 2]
    with pytest.raises(CheckpointError):
        KeepLastK(0)


def test_keep_best_protects_the_best_metric_step_from_deletion():
    policy = KeepBest({1: 0.5, 2: 0.1, 3: 0.4, 4: 0.3}, k_best=1, keep_last=1)
    assert policy.to_delete([1, 2, 3, 4], verified={1, 2, 3, 4}) == [1, 3]


def test_keep_best_in_max_mode_protects_the_highest_metric():
    policy = KeepBest({1: 0.9, 2: 0.1, 3: 0.4}, k_best=1, keep_last=1, mode="max")
    assert policy.to_delete([1, 2, 3], verified={1, 2, 3}) == [2]


def test_keep_best_never_protects_an_unverified_step():
    policy = KeepBest({1: 0.0, 2: 0.5, 3: 0.9}, k_best=1, keep_last=1)
    # Step 1 has the best metric but is not verified: step 2 is the best verified one.
    assert policy.to_delete([1, 2, 3], verified={2, 3}) == [1]


def test_keep_best_rejects_bad_settings():
    with pytest.raises(CheckpointError, match="k_best"):
        KeepBest({}, k_best=0)
    with pytest.raises(CheckpointError, match="mode"):
        KeepBest({}, mode="median")


steps_st = st.lists(st.integers(min_value=1, max_value=60), max_size=20, unique=True)


@settings(max_examples=80, deadline=None)
@given(steps=steps_st, data=st.data(), k=st.integers(min_value=1, max_value=5))
def test_keep_last_k_never_deletes_the_newest_verified_nor_leaves_fewer_than_k_good(steps, data, k):
    verified = set(data.draw(st.lists(st.sampled_from(steps), unique=True) if steps else st.just([])))
    deleted = keep_last_k(steps, verified, k)
    remaining = set(steps) - set(deleted)
    assert deleted == sorted(deleted)
    assert set(deleted) <= set(steps)
    good_before = verified & set(steps)
    good_after = verified & remaining
    if good_before:
        assert max(good_before) in remaining
        assert len(good_after) == min(k, len(good_before))
    if len(good_before) < k:
        assert deleted == []
    # Nothing newer than the oldest kept verified save is ever deleted.
    if deleted:
        assert max(deleted) < min(sorted(good_before)[-k:])


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir())


def test_save_returns_while_the_old_save_is_still_being_deleted_on_another_thread(tmp_path):
    release = threading.Event()
    seen: dict[str, object] = {}

    def hook(name: str, info: dict) -> None:
        if name == "retention_delete":
            seen["thread"] = threading.current_thread().name
            seen["released"] = release.wait(timeout=60)  # hold the deleter until the test says so

    model, opt = tiny()
    mgr = CheckpointManager(tmp_path, keep_last=1, every_steps=1, on_event=hook)
    mgr.save(model, opt, None, TrainState(step=1))
    mgr.save(model, opt, None, TrainState(step=2))  # returns although the deletion of 1 is held
    assert names(tmp_path) == ["step-00000001", "step-00000002"]
    release.set()
    assert mgr.wait_retention() == [1]
    assert names(tmp_path) == ["step-00000002"]
    assert seen == {"thread": "ckpt-retention", "released": True}
    mgr.close()


def test_the_next_save_waits_for_a_deleter_that_fell_behind(tmp_path):
    order: list[str] = []
    release = threading.Event()

    def hook(name: str, info: dict) -> None:
        if name == "retention_delete" and info["step"] == 1:
            release.wait(timeout=60)
            order.append("deleted 1")
        if name == "save_begin" and info["step"] == 3:
            order.append("save 3 begins")
            release.set()
        if name == "save_end" and info["step"] == 3:
            order.append("save 3 ends")

    model, opt = tiny()
    with CheckpointManager(tmp_path, keep_last=1, every_steps=1, on_event=hook) as mgr:
        for step in (1, 2, 3):
            mgr.save(model, opt, None, TrainState(step=step))
        assert mgr.wait_retention() == [1, 2]
    # Save 3 wrote while pass 2 was held, and handed its own pass over only after pass 2 finished.
    assert order == ["save 3 begins", "deleted 1", "save 3 ends"]
    assert names(tmp_path) == ["step-00000003"]


def test_close_waits_for_the_deletion_in_flight(tmp_path):
    model, opt = tiny()
    mgr = CheckpointManager(tmp_path, keep_last=2, every_steps=1)
    for step in (1, 2, 3, 4):
        mgr.save(model, opt, None, TrainState(step=step))
    mgr.close()
    assert names(tmp_path) == ["step-00000003", "step-00000004"]


def test_background_retention_false_deletes_inside_save(tmp_path):
    model, opt = tiny()
    mgr = CheckpointManager(tmp_path, keep_last=1, every_steps=1, background_retention=False)
    for step in (1, 2):
        mgr.save(model, opt, None, TrainState(step=step))
    assert names(tmp_path) == ["step-00000002"]


CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading
    import torch
    from ckpt_lesson.files.checkpoint import TrainState
    from ckpt_lesson.runs.manager import CheckpointManager

    run_dir, kill_at = sys.argv[1], sys.argv[2]

    def hook(name, info):
        if name == kill_at and info.get("step") == 1:
            with open(os.path.join(run_dir, "..", "killed-on"), "w") as f:
                f.write(threading.current_thread().name)
            os.kill(os.getpid(), signal.SIGKILL)

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = CheckpointManager(run_dir, keep_last=1, every_steps=1, on_event=hook)
    for step in (1, 2):
        mgr.save(model, opt, None, TrainState(step=step))
    mgr.close()
    """
)


@pytest.mark.parametrize(
    ("kill_at", "left_behind"),
    [
        ("retention_delete", ["step-00000001", "step-00000002"]),  # before the rename: a good old save
        ("retention_renamed", [".deleting-", "step-00000002"]),  # after it: a leftover, never a save
    ],
)
def test_a_sigkill_during_a_background_deletion_leaves_the_save_or_a_leftover_the_next_manager_cleans(
    tmp_path, kill_at, left_behind
):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(run_dir), kill_at],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (tmp_path / "killed-on").read_text() == "ckpt-retention"  # it died on the retention thread
    found = names(run_dir)
    assert [n[: len(".deleting-")] if n.startswith(".deleting-") else n for n in found] == left_behind
    assert [(r.step, r.status) for r in scan_checkpoints(run_dir) if not r.path.name.startswith(".")] == [
        (s, "ok") for s in sorted(int(n[5:]) for n in found if n.startswith("step-"))
    ]
    model, opt = tiny()
    with CheckpointManager(run_dir, keep_last=1, every_steps=1) as mgr:
        assert not [n for n in names(run_dir) if n.startswith(".deleting-")]  # cleaned on opening
        assert mgr.restore_latest(model, opt, None).step == 2
        mgr.save(model, opt, None, TrainState(step=3))
    assert names(run_dir) == ["step-00000003"]


def test_the_scrub_finds_a_rotten_save_that_no_deletion_depended_on_yet(tmp_path):
    scrubbed: dict[int, bool] = {}
    done = threading.Event()

    def hook(name: str, info: dict) -> None:
        if name == "scrubbed":
            scrubbed[info["step"]] = info["ok"]
            if info["step"] == 1:
                done.set()

    model, opt = tiny()
    mgr = CheckpointManager(tmp_path, keep_last=5, every_steps=1, scrub_bytes_per_s=1e12, on_event=hook)
    for step in (1, 2):
        mgr.save(model, opt, None, TrainState(step=step))
    mgr.wait_retention()
    path = tmp_path / "step-00000001" / "checkpoint.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    scrubbed.clear()
    done.clear()  # the scrubs after saves 1 and 2 may have read step 1 before the flip
    mgr.save(model, opt, None, TrainState(step=3))  # nothing to delete: only the scrub reads step 1
    assert done.wait(timeout=60)
    mgr.close()
    assert scrubbed[1] is False
    assert 1 not in mgr._retention.known.verified


def test_the_background_cleaner_spares_a_staging_folder_its_own_process_has_not_locked_yet(tmp_path):
    # Between mkdir and flock a save's staging folder looks abandoned; a cleaner on another thread of
    # the same process once probed its lock there, which made the save's own flock fail (EAGAIN).
    from ckpt_lesson.runs.commit import LOCK_NAME, clean_stale, staging_name

    mine = tmp_path / staging_name(7)
    mine.mkdir()
    (mine / LOCK_NAME).touch()  # created, not yet locked: exactly the window
    assert clean_stale(tmp_path, spare_pid=os.getpid()) == []
    assert mine.is_dir()
    assert clean_stale(tmp_path) == [mine.name]  # without sparing, an unlocked lock means a dead writer
