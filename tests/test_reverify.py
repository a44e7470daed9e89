"""The shared retention rule: cheap checks of every kept save, one full re-hash per pass, and the
bit-rot guarantee docs/performance.md states, for both managers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _distributed_local import flip_byte as flip_dcp_byte
from _distributed_local import save_locally

from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.runs.layout import step_dir_name
from ckpt_lesson.runs.manager import CheckpointManager
from ckpt_lesson.runs.retention import KeepLastK
from ckpt_lesson.runs.reverify import KnownGood, check_save, retention_pass
from ckpt_lesson.runs.scan import scan_checkpoints


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def good_steps(run_dir: Path) -> set[int]:
    return {r.step for r in scan_checkpoints(run_dir) if r.ok and r.step is not None}


def no_events(name: str, **info: object) -> None:
    pass


def test_a_pass_hashes_at_most_one_older_kept_save_and_stats_the_rest(tmp_path, monkeypatch):
    model, opt = tiny()
    with CheckpointManager(tmp_path, keep_last=4, every_steps=1, background_retention=False) as mgr:
        for step in range(1, 5):
            mgr.save(model, opt, None, TrainState(step=step))
    hashed, cheap = [], []
    import ckpt_lesson.runs.reverify as reverify

    real = reverify.check_save

    def counting(folder: Path, *, full: bool) -> str | None:
        (hashed if full else cheap).append(folder.name)
        return real(folder, full=full)

    monkeypatch.setattr(reverify, "check_save", counting)
    known = KnownGood()
    for step in (1, 2, 3, 4):
        known.mark_hashed(step)
    (tmp_path / step_dir_name(5)).mkdir()  # stands in for nothing: only folders with a manifest count
    deleted = retention_pass(tmp_path, KeepLastK(3), known, emit=no_events)
    assert deleted == [1]
    assert len(hashed) == 1 and hashed == ["step-00000002"]  # least recently hashed, then oldest
    assert sorted(cheap) == ["step-00000002", "step-00000003", "step-00000004"]


def test_in_steady_state_each_pass_hashes_the_oldest_kept_save_the_one_it_falls_back_to(
    tmp_path, monkeypatch
):
    import ckpt_lesson.runs.reverify as reverify

    hashed: list[str] = []
    real = reverify.check_save

    def counting(folder: Path, *, full: bool) -> str | None:
        if full:
            hashed.append(folder.name)
        return real(folder, full=full)

    monkeypatch.setattr(reverify, "check_save", counting)
    model, opt = tiny()
    with CheckpointManager(tmp_path, keep_last=3, every_steps=1, background_retention=False) as mgr:
        for step in range(1, 8):
            mgr.save(model, opt, None, TrainState(step=step))
    # Passes 1-3 delete nothing and so check nothing; from save 4 on, save n deletes n-3 after
    # hashing n-2, the oldest save left: one checkpoint read per save, whatever keep_last is.
    assert hashed == [step_dir_name(n - 2) for n in range(4, 8)]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_a_same_size_bit_flip_is_found_within_k_minus_1_saves_and_k_minus_1_good_saves_remain(tmp_path, k):
    """The guarantee of docs/performance.md, for every position the rotten save can have."""
    model, opt = tiny()
    for victim_age in range(1, k):  # which kept save rots: 1 = the one before the newest
        run = tmp_path / f"age{victim_age}"
        mgr = CheckpointManager(run, keep_last=k, every_steps=1)
        step = 0
        for _ in range(k + 2):  # a steady state: every save deletes one
            step += 1
            mgr.save(model, opt, None, TrainState(step=step))
        mgr.wait_retention()
        victim = step - victim_age
        flip_byte(run / step_dir_name(victim) / "checkpoint.pt")
        found_after = None
        for n in range(1, k):
            step += 1
            mgr.save(model, opt, None, TrainState(step=step))
            mgr.wait_retention()
            assert len(good_steps(run)) >= k - 1, f"victim at age {victim_age}, after {n} saves"
            if victim not in mgr._retention.known.verified:
                found_after = n
                break
        assert found_after is not None, f"k={k}: a rotten save at age {victim_age} was not found in k-1 saves"
        mgr.close()


def test_with_keep_last_2_a_flip_in_the_kept_save_never_leaves_one_good_save(tmp_path):
    model, opt = tiny()
    with CheckpointManager(tmp_path, keep_last=2, every_steps=1) as mgr:
        for step in (1, 2):
            mgr.save(model, opt, None, TrainState(step=step))
        flip_byte(tmp_path / step_dir_name(2) / "checkpoint.pt")
        mgr.save(model, opt, None, TrainState(step=3))
        mgr.wait_retention()
    assert good_steps(tmp_path) == {1, 3}


def test_a_dcp_save_with_a_same_size_bit_flip_never_leaves_one_good_save(tmp_path):
    """Issue 20, item 5: the multi-rank manager used to check sizes only and kept one good save."""
    save_locally(tmp_path, steps=(2, 4), keep_last=2)
    flip_dcp_byte(tmp_path / "step-00000004" / "__0_0.distcp")
    assert check_save(tmp_path / "step-00000004", full=False) is None  # same size: stat cannot see it
    from _distributed_workers import make_run

    from ckpt_lesson.distributed import DistributedCheckpointManager

    model, opt, sched, _ = make_run("plain", 1, 0)
    mgr = DistributedCheckpointManager(tmp_path, keep_last=2, every_steps=2)
    mgr.saves.worker.known.verified.update({2, 4})  # what the saving process knew before the bit flipped
    mgr.save(model, opt, sched, TrainState(step=6))
    mgr.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]
    assert check_save(tmp_path / "step-00000002", full=True) is None
    assert check_save(tmp_path / "step-00000006", full=True) is None


def test_a_save_published_unchecked_is_hashed_before_anything_is_deleted_for_it(tmp_path):
    model, opt = tiny()
    events: list[str] = []

    def hook(name: str, info: dict) -> None:
        events.append(name)
        if name == "published" and info["step"] == 2:
            flip_byte(tmp_path / step_dir_name(2) / "checkpoint.pt")

    with CheckpointManager(tmp_path, keep_last=1, every_steps=1, verify_on_save=False, on_event=hook) as mgr:
        mgr.save(model, opt, None, TrainState(step=1))
        mgr.save(model, opt, None, TrainState(step=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]
    assert "retention_delete" not in events


def test_on_two_gloo_ranks_a_same_size_bit_flip_keeps_two_good_dcp_saves(tmp_path):
    import json

    from _distributed_workers import launch, w_retention_after_bit_flip

    assert launch(w_retention_after_bit_flip, 2, tmp_path, str(tmp_path)) == [0, 0]
    listing = json.loads((tmp_path / "listing.json").read_text())
    assert listing == ["step-00000002", "step-00000004", "step-00000006"]
    assert check_save(tmp_path / "run" / "step-00000002", full=True) is None
    assert check_save(tmp_path / "run" / "step-00000004", full=True) is not None
