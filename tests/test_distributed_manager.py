"""DistributedCheckpointManager on real ranks (gloo, CPU): resharding, exact resume, world-size policy.

One launch of 2 ranks trains an FSDP2 run and a DDP run for 6 steps without
interruption, saving steps 2 and 4 (the FSDP2 step 4 asynchronously) and
recording every loss and the full model/optimizer state at each save. Then the
same saves are restored on 2, 1 and 4 ranks, once each, and every check below
reads what those four launches recorded. A copy of the FSDP2 run whose newest
save has one flipped byte (in a file that rank 1, not rank 0, hashes) is
restored on 2 ranks too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _distributed_local import flip_byte, restore_locally, save_locally
from _distributed_workers import launch, make_run, w_close_frees_threads, w_resume, w_train_and_save

from ckpt_lesson import CheckpointError, TrainState
from ckpt_lesson.distributed import DistributedCheckpointManager

KINDS = ("fsdp", "ddp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("distributed_runs")
    assert launch(w_train_and_save, 2, base, str(base)) == [0, 0]
    flipped = base / "fsdp_flipped"
    shutil.copytree(base / "fsdp", flipped)
    victim = flipped / "step-00000004" / "__1_0.distcp"  # data files sorted: index 1 is rank 1's share
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    assert launch(w_resume, 2, base, str(base), [*KINDS, "fsdp_flipped"]) == [0, 0]
    assert launch(w_resume, 1, base, str(base), list(KINDS)) == [0]
    assert launch(w_resume, 4, base, str(base), list(KINDS)) == [0, 0, 0, 0]
    return base


def _read(runs: Path, kind: str, name: str) -> dict[str, Any]:
    return json.loads((runs / kind / name).read_text())


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_a_save_from_two_ranks_restores_model_and_optimizer_bit_exactly_on_any_world_size(
    runs: Path, kind: str, world: int
) -> None:
    report = _read(runs, kind, f"resume-w{world}-rank0.json")
    assert report["step"] == 4
    assert report["tensors_compared"] > 10  # weights, biases, both Adam moments, step counters
    assert report["differences"] == []


@pytest.mark.parametrize("kind", KINDS)
def test_resuming_on_two_ranks_reproduces_the_uninterrupted_losses_bit_for_bit(runs: Path, kind: str) -> None:
    for rank in (0, 1):
        uninterrupted = _read(runs, kind, f"train-rank{rank}.json")["losses"]
        resumed = _read(runs, kind, f"resume-w2-rank{rank}.json")["losses"]
        assert len(uninterrupted) == 6
        assert resumed == uninterrupted  # floats compared exactly: the same bits or a failure


@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_gets_back_its_own_sampler_position_and_generator_state(runs: Path, kind: str) -> None:
    got = [_read(runs, kind, f"resume-w2-rank{rank}.json") for rank in (0, 1)]
    saved = [_read(runs, kind, f"train-rank{rank}.json")["saved"]["4"] for rank in (0, 1)]
    for rank in (0, 1):
        assert got[rank]["sampler"] == saved[rank]["sampler"]
        assert got[rank]["torch_rng"] == saved[rank]["torch_rng"]
    # The two ranks' streams differ, so a shared key (one rank's copy for all) would have failed above.
    assert saved[0]["sampler"] != saved[1]["sampler"]
    assert saved[0]["torch_rng"] != saved[1]["torch_rng"]


@pytest.mark.parametrize("world", [1, 4])
def test_a_changed_world_size_is_refused_by_default_with_a_message_naming_both_sizes(
    runs: Path, world: int
) -> None:
    for rank in range(world):
        refusal = _read(runs, "fsdp", f"resume-w{world}-rank{rank}.json")["refusal"]
        assert refusal["type"] == "StateMismatchError"
        message = refusal["message"]
        assert "saved by 2 rank(s)" in message and f"this run has {world}" in message
        assert "RNG state and data position" in message
        assert "on_world_size_change='reseed'" in message


def test_the_reseed_option_restores_counters_gives_distinct_seeds_and_logs_it(runs: Path) -> None:
    reports = [_read(runs, "ddp", f"resume-w4-rank{rank}.json") for rank in range(4)]
    rank0_saved = _read(runs, "ddp", "train-rank0.json")["losses"][:4]
    for report in reports:
        assert report["resharded"] is True
        assert report["counters"]["step"] == 4
        assert report["counters"]["losses"] == rank0_saved  # everyone continues from rank 0's counters
    assert len({r["reseed"] for r in reports}) == 4
    warnings = reports[0]["warnings"]
    assert any("re-seeded" in w and "data positions NOT restored" in w for w in warnings)


def test_ranks_share_the_hashing_and_all_fall_back_past_a_flipped_byte(runs: Path) -> None:
    reports = [_read(runs, "fsdp_flipped", f"resume-w2-rank{rank}.json") for rank in (0, 1)]
    for report in reports:
        assert report["step"] == 2
        [skipped] = report["skipped"]
        assert skipped["step"] == 4 and skipped["status"] == "corrupt"
        assert "__1_0.distcp" in skipped["reason"]
    assert reports[0]["differences"] == []  # equal to the state recorded at step 2
    for rank in (0, 1):  # and training on from step 2 still matches the uninterrupted run
        assert reports[rank]["losses"] == _read(runs, "fsdp", f"train-rank{rank}.json")["losses"]


# ---------------------------------------------------------------- the same manager in one process (no group)


def test_should_save_follows_the_step_rule_and_the_time_rule_with_a_fake_clock(tmp_path: Path) -> None:
    now = [0.0]
    mgr = DistributedCheckpointManager(tmp_path, every_steps=5, every_seconds=60, clock=lambda: now[0])
    assert [s for s in range(1, 12) if mgr.should_save(s)] == [5, 10]
    now[0] = 61.0
    assert mgr.should_save(11)


def test_an_async_save_holds_the_state_of_the_moment_it_was_requested(tmp_path: Path) -> None:
    model, opt, sched, _ = make_run("plain", 1, 0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    mgr = DistributedCheckpointManager(tmp_path, every_steps=1)
    mgr.save_async(model, opt, sched, TrainState(step=1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on while the save is written
    assert mgr.wait() == tmp_path / "step-00000001"
    restored, (fresh, _, _, _) = restore_locally(tmp_path)
    assert restored.step == 1
    assert all(torch.equal(expected[k], v) for k, v in fresh.state_dict().items())


def test_a_failed_async_save_surfaces_from_wait_and_leaves_no_folder_behind(tmp_path: Path) -> None:
    def hook(name: str, info: dict[str, Any]) -> None:
        if name == "manifest_written":
            raise OSError("disk went away")

    model, opt, sched, _ = make_run("plain", 1, 0)
    mgr = DistributedCheckpointManager(tmp_path, every_steps=1, on_event=hook)
    mgr.save_async(model, opt, sched, TrainState(step=1))
    with pytest.raises(CheckpointError, match="save of step 1 failed.*disk went away"):
        mgr.wait()
    assert list(tmp_path.iterdir()) == []
    assert mgr.wait() is None  # the failure is reported once


def test_a_second_save_waits_for_the_one_in_flight(tmp_path: Path) -> None:
    model, opt, sched, _ = make_run("plain", 1, 0)
    with DistributedCheckpointManager(tmp_path, every_steps=1) as mgr:
        mgr.save_async(model, opt, sched, TrainState(step=1))
        mgr.save(model, opt, sched, TrainState(step=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(model, opt, sched, TrainState(step=3))
    with pytest.raises(CheckpointError, match="closed"):
        mgr.restore_latest(model, opt, sched)  # its groups are gone: no collective may run


def test_a_run_without_saves_restores_nothing_and_one_with_only_damaged_saves_lists_them(
    tmp_path: Path,
) -> None:
    assert restore_locally(tmp_path / "empty")[0] is None
    save_locally(tmp_path / "run", steps=(2, 4))
    flip_byte(tmp_path / "run" / "step-00000002" / ".metadata")
    (tmp_path / "run" / "step-00000004" / "manifest.json").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"(?s)2 save\(s\) found but none is usable.*step 4: incomplete.*step 2: corrupt",
    ):
        restore_locally(tmp_path / "run")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"every_steps": 0}, "every_steps"),
        ({}, "every_steps, every_seconds or both"),
        ({"every_steps": 1, "keep_last": 0}, "k must be"),
        ({"every_steps": 1, "metadata": {"f": object()}}, "JSON"),
        ({"every_steps": 1, "retention": 3}, "to_delete"),
    ],
)
def test_invalid_settings_are_refused_when_the_manager_is_made(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        DistributedCheckpointManager(tmp_path, **options)


def test_close_joins_the_threads_of_the_distributed_managers_own_groups(tmp_path: Path) -> None:
    # Left to interpreter teardown, the gloo threads of the manager's groups made about 1 torchrun
    # job in 12-20 abort ("terminate called without an active exception"); close() joins them.
    assert launch(w_close_frees_threads, 2, tmp_path, str(tmp_path)) == [0, 0]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"threads-rank{rank}.json").read_text())
        gloo = {k: [n for n in names if "gloo" in n] for k, names in seen.items()}
        assert len(gloo["opened"]) > len(gloo["before"]) > 0  # the two groups really started threads
        assert gloo["after"] == gloo["before"]
        assert not any(n.startswith("AsyncCheckpoint") for n in seen["after"])
