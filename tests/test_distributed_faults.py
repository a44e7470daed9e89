"""Fault injection on real ranks: SIGKILL one rank or all of them during a save, then restore.

The campaign is the package's own (``python -m ckpt_lesson chaos --ranks 2``,
:mod:`ckpt_lesson.faults.rank_chaos`): each named kill is one launch of 2 FSDP2
ranks that saves step 2, then starts saving step 4 and SIGKILLs ranks at a
chosen event of the manager (fired from inside DCP's writing and ``finish``,
so also from the async save's background thread). The step to restore is
predicted before each launch. One more launch trains an uninterrupted run and
restores every killed run (which removes the staging folders dead writers
left) and trains it on. The CLI tests at the end run a couple of kills more.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ckpt_lesson.faults.rank_chaos as rank_chaos
from ckpt_lesson import cli
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.faults.rank_chaos import (
    NAMED_KILLS,
    RankCampaignResult,
    RankKill,
    RankKillOutcome,
    check_kill,
    predict_rank_restore,
    run_rank_campaign,
)

NAMES = [kill.name for kill in NAMED_KILLS]


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> RankCampaignResult:
    return run_rank_campaign(
        list(NAMED_KILLS), world=2, workdir=tmp_path_factory.mktemp("distributed_faults")
    )


@pytest.fixture(scope="module")
def by_name(campaign: RankCampaignResult) -> dict[str, RankKillOutcome]:
    return {o.kill.name: o for o in campaign.outcomes}


@pytest.mark.parametrize("name", NAMES)
def test_after_a_distributed_kill_every_rank_restores_the_predicted_save_and_trains_on_identically(
    by_name: dict[str, RankKillOutcome], name: str
) -> None:
    outcome = by_name[name]
    assert outcome.killed, "the scenario must actually kill a rank"
    assert [r["step"] for r in outcome.restored] == [outcome.predicted] * 2
    assert all(r["skipped"] == [] for r in outcome.restored)  # nothing half-written was ever published
    assert [r["losses"] for r in outcome.restored] == outcome.baseline
    assert len(outcome.baseline[0]) == 6 and outcome.baseline[0] != outcome.baseline[1]  # per-rank batches


def test_the_distributed_predictions_cover_both_outcomes_and_the_campaign_passes(
    campaign: RankCampaignResult,
) -> None:
    assert {o.predicted for o in campaign.outcomes} == {2, 4}
    assert campaign.ok and campaign.wrong_choices == 0
    assert campaign.table().splitlines()[-1].split() == ["verdict", "PASS"]


@pytest.mark.parametrize(
    "name", ["sync/mid_write/all@0", "sync/before_manifest/one@0", "sync/before_publish/one@0"]
)
def test_a_staging_folder_left_by_a_killed_distributed_rank_0_is_removed_when_a_manager_opens_the_run(
    by_name: dict[str, RankKillOutcome], name: str
) -> None:
    rank0 = by_name[name].restored[0]
    assert len(rank0["staging_before"]) == 1  # rank 0 died holding the lock: its folder stayed
    assert rank0["staging_after"] == []


def test_a_surviving_distributed_rank_0_removes_its_own_staging_folder(
    by_name: dict[str, RankKillOutcome],
) -> None:
    assert by_name["sync/mid_write/one@1"].restored[0]["staging_before"] == []


# Async kills are left out: there the survivor's training thread may meet the dead peer first,
# in a training collective, and torch raises its own error there.
@pytest.mark.parametrize(
    "name", ["sync/mid_write/one@1", "sync/before_manifest/one@0", "sync/before_publish/one@0"]
)
def test_a_surviving_distributed_rank_gets_a_checkpoint_error_instead_of_hanging(
    by_name: dict[str, RankKillOutcome], name: str
) -> None:
    outcome = by_name[name]
    killed = outcome.kill.at
    assert outcome.exit_codes[killed] == -9
    said = outcome.said[1 - killed]
    assert said is not None and said.startswith("CheckpointError: save of step 4 failed")
    assert "nothing was published" in said or "previous save" in said


@pytest.mark.parametrize(
    ("kill", "problem"),
    [
        (RankKill("mid_write", "others"), "exact for sync rank-0 points only"),
        (RankKill("before_publish", "others", mode="async"), "exact for sync rank-0 points only"),
        (RankKill("before_publish", "all", at=1), "cannot fire on rank 1"),
        (RankKill("mid_write", "one", at=2), "cannot fire on rank 2"),
        (RankKill("mid_flight", "all"), "unknown point"),
    ],
)
def test_a_distributed_kill_whose_outcome_depends_on_timing_is_refused(kill: RankKill, problem: str) -> None:
    with pytest.raises(CheckpointError, match=problem):
        check_kill(kill, 2)


def test_the_distributed_prediction_keeps_the_save_only_when_rank_0_lives_to_publish_it() -> None:
    assert predict_rank_restore(RankKill("before_publish", "others"), 4) == 4
    assert predict_rank_restore(RankKill("before_manifest", "one"), 4) == 2
    assert predict_rank_restore(RankKill("mid_write", "one", at=3, mode="async"), 4) == 2
    assert predict_rank_restore(RankKill("after_publish", "all"), 4) == 4


def test_the_distributed_chaos_command_prints_the_summary_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["chaos", "--ranks", "2", "--kills", "2", "--workdir", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0, "\n".join(lines)
    assert lines[0].split()[:2] == ["kills", "2"] and "of 2 ranks" in lines[0]
    assert lines[1].split() == ["by", "point", "mid_write", "2"]
    assert any(line.split() == ["wrong", "choices", "0"] for line in lines)
    assert any(line.split() == ["verdict", "PASS"] for line in lines)
    assert list(tmp_path.iterdir()) == []  # run folders removed without --keep


def test_a_wrong_distributed_prediction_is_reported_as_fail_with_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Predict the interrupted save for a kill that loses it: the check must notice.
    monkeypatch.setattr(rank_chaos, "predict_rank_restore", lambda kill, world: 4)
    code = cli.main(["chaos", "--ranks", "2", "--kills", "1", "--workdir", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert code == 1
    assert any(line.split() == ["wrong", "choices", "1"] for line in lines)
    assert any(line.split() == ["verdict", "FAIL"] for line in lines)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "0"], "--ranks must be 1"),
        (["--ranks", "9"], "--ranks must be 1"),
        (["--publish", "marker"], "--publish applies to multi-rank saves only"),
    ],
)
def test_the_chaos_command_refuses_distributed_options_that_do_not_fit(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["chaos", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
