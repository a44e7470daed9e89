"""Fault injection on real ranks: SIGKILL one rank or all of them during a save, then restore.

Each scenario is one launch of 2 FSDP2 ranks: save step 2 cleanly, then start
saving step 4 and SIGKILL ranks at a chosen event of the manager (fired from
inside DCP's writing and ``finish``, so also from the async save's background
thread). The prediction is written down before the run: the save of step 4 is
the one restored only if the rename that publishes it happened before the kill.
Afterwards one launch of 2 ranks opens a manager on every run directory (which
removes the staging folders dead writers left) and restores the latest save.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _distributed_workers import launch

# name: (scenario for w_fault, step the restore must pick)
SCENARIOS: dict[str, tuple[dict[str, Any], int]] = {
    "one_rank_mid_write": ({"event": "file_partial", "at": 1, "kill": "self", "mode": "sync"}, 2),
    "all_ranks_mid_write": ({"event": "file_partial", "at": 0, "kill": "all", "mode": "sync"}, 2),
    "rank0_before_the_manifest": ({"event": "metadata_written", "at": 0, "kill": "self", "mode": "sync"}, 2),
    "all_ranks_before_the_manifest": ({"event": "finish_begin", "at": 0, "kill": "all", "mode": "sync"}, 2),
    "rank0_before_publish": ({"event": "manifest_written", "at": 0, "kill": "self", "mode": "sync"}, 2),
    "all_ranks_before_publish": ({"event": "manifest_written", "at": 0, "kill": "all", "mode": "sync"}, 2),
    # Rank 1 dies while rank 0 goes on to publish: the save is complete, so it is the one restored.
    "rank1_while_rank0_publishes": ({"event": "manifest_written", "at": 0, "kill": [1], "mode": "sync"}, 4),
    "all_ranks_after_publish": ({"event": "published", "at": 0, "kill": "all", "mode": "sync"}, 4),
    "async_one_rank_mid_write": ({"event": "file_partial", "at": 1, "kill": "self", "mode": "async"}, 2),
    "async_all_ranks_before_publish": (
        {"event": "manifest_written", "at": 0, "kill": "all", "mode": "async"},
        2,
    ),
}


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    base = tmp_path_factory.mktemp("distributed_faults")
    exit_codes = {}
    for name, (scenario, _) in SCENARIOS.items():
        exit_codes[name] = launch("w_fault", 2, base, str(base / name), scenario)
    assert launch("w_restore_all", 2, base, [str(base / name) for name in SCENARIOS]) == [0, 0]
    results = {}
    for name in SCENARIOS:
        run = base / name
        results[name] = {
            "exit_codes": exit_codes[name],
            "restored": [json.loads((run / f"restored-rank{r}.json").read_text()) for r in (0, 1)],
            "outcomes": {r: _outcome(run, r) for r in (0, 1)},
        }
    return results


def _outcome(run: Path, rank: int) -> str | None:
    path = run / f"outcome-rank{rank}.json"
    return json.loads(path.read_text())["outcome"] if path.exists() else None


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_after_a_kill_every_rank_restores_the_predicted_save(faults: dict[str, Any], name: str) -> None:
    result = faults[name]
    assert any(code == -9 for code in result["exit_codes"]), "the scenario must actually kill a rank"
    predicted = SCENARIOS[name][1]
    assert [r["step"] for r in result["restored"]] == [predicted, predicted]
    assert all(r["skipped"] == [] for r in result["restored"])  # nothing half-written was ever published


@pytest.mark.parametrize("name", ["all_ranks_mid_write", "rank0_before_the_manifest", "rank0_before_publish"])
def test_a_staging_folder_left_by_a_killed_rank_0_is_removed_when_a_manager_opens_the_run(
    faults: dict[str, Any], name: str
) -> None:
    rank0 = faults[name]["restored"][0]
    assert len(rank0["staging_before"]) == 1  # rank 0 died holding the lock: its folder stayed
    assert rank0["staging_after"] == []


def test_a_surviving_rank_0_removes_its_own_staging_folder(faults: dict[str, Any]) -> None:
    assert faults["one_rank_mid_write"]["restored"][0]["staging_before"] == []


# Async scenarios are left out: there the survivor's training thread may meet the dead peer first,
# in a training collective, and torch raises its own error there.
@pytest.mark.parametrize("name", ["one_rank_mid_write", "rank0_before_the_manifest", "rank0_before_publish"])
def test_a_surviving_rank_gets_a_checkpoint_error_instead_of_hanging(
    faults: dict[str, Any], name: str
) -> None:
    result = faults[name]
    killed = SCENARIOS[name][0]["at"]
    survivor = 1 - killed
    assert result["exit_codes"][killed] == -9
    outcome = result["outcomes"][survivor]
    assert outcome is not None and outcome.startswith("CheckpointError: save of step 4 failed")
    assert "nothing was published" in outcome or "previous save" in outcome
