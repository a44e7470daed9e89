"""Fault injection: SIGKILL training processes at every named point and check each restore."""

from __future__ import annotations

import dataclasses

import pytest

from ckpt_lesson import cli
from ckpt_lesson.faults.campaign import run_campaign
from ckpt_lesson.faults.harness import (
    POINTS,
    KillPlan,
    RunConfig,
    compute_baseline,
    predict_restored_step,
    run_kill_sequence,
)


@pytest.fixture(scope="module")
def named_campaign(tmp_path_factory):
    # 12 kills: every named point at least once, single-file and sharded.
    return run_campaign(kills=12, seed=1, workdir=tmp_path_factory.mktemp("chaos"), named_points=True)


def test_every_named_point_is_killed_and_restores_the_predicted_save(named_campaign):
    result = named_campaign
    assert {o.plan.point for o in result.outcomes} == set(POINTS)
    assert all(o.killed for o in result.outcomes)
    assert [o.chosen for o in result.outcomes] == [o.predicted for o in result.outcomes]
    assert result.wrong_choices == 0 and result.corrupt_loads == 0
    assert result.ok, result.table()


def test_after_every_kill_the_finished_run_equals_the_uninterrupted_one(named_campaign):
    assert named_campaign.trajectory_differences == 0
    assert named_campaign.unfinished_runs == 0


def test_lost_saves_leave_incomplete_staging_and_bitrot_is_skipped(named_campaign):
    by_point = {o.plan.point: o for o in named_campaign.outcomes}
    for point in ("mid_part", "after_shards", "parts_complete", "manifest_written"):
        assert by_point[point].incomplete_found >= 1, point  # the torn save was there, unpublished
    assert by_point["bitrot"].skipped == 1  # the flipped byte was caught by its hash
    assert by_point["bitrot"].chosen == by_point["bitrot"].plan.step - 5
    assert by_point["manifest_rot"].skipped == 1  # the manifest's own checksum caught it: damage
    assert by_point["manifest_rot"].chosen == by_point["manifest_rot"].plan.step - 5


def test_recovery_records_count_redone_steps(named_campaign):
    redone = [r["steps_redone"] for r in named_campaign.recoveries]
    assert redone and all(0 <= r <= 5 for r in redone)  # never more than one save interval here
    assert all(r["recovery_seconds"] > 0 for r in named_campaign.recoveries)


def test_a_small_random_campaign_passes(tmp_path):
    result = run_campaign(kills=10, seed=7, workdir=tmp_path, named_points=False)
    assert len(result.outcomes) == 10
    assert result.ok, result.table()


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        (KillPlan(20, "save_end"), 20),
        (KillPlan(20, "retention_delete"), 20),
        (KillPlan(20, "mid_part", 100), 15),
        (KillPlan(20, "manifest_written"), 15),
        (KillPlan(5, "parts_complete"), None),
        (KillPlan(23, "between_saves"), 20),
        (KillPlan(4, "between_saves"), None),
        (KillPlan(20, "bitrot"), 15),
    ],
)
def test_the_prediction_is_the_newest_save_that_survived(plan, expected):
    assert predict_restored_step(plan, every_steps=5) == expected


def test_the_harness_detects_a_trajectory_that_differs(tmp_path):
    # Sanity check of the checker itself: against a wrong baseline it must complain.
    cfg = RunConfig(total_steps=12, every_steps=4)
    base = compute_baseline(cfg)
    wrong = dataclasses.replace(base, losses=[*base.losses[:5], base.losses[5] + 1e-7, *base.losses[6:]])
    outcomes, diffs, finished = run_kill_sequence(tmp_path / "run", cfg, [KillPlan(8, "published")], wrong)
    assert diffs >= 1 and not finished
    assert outcomes[0].corrupt_load  # the restored history (steps 1-8) no longer matches


def test_chaos_cli_prints_the_table_and_exits_zero(tmp_path, capsys):
    code = cli.main(["chaos", "--kills", "2", "--seed", "3", "--random-only", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    for row in ("kills", "fallbacks", "wrong choices", "corrupt loads", "trajectory differences", "verdict"):
        assert row in out
    assert "PASS" in out


def test_chaos_cli_refuses_zero_kills_with_exit_2(capsys):
    assert cli.main(["chaos", "--kills", "0"]) == 2
    assert "error: --kills must be >= 1" in capsys.readouterr().err


def test_a_sigkill_that_is_not_the_kill_trigger_is_a_harness_problem_not_a_wrong_choice(
    tmp_path, monkeypatch
):
    # What the OOM killer, or the harness itself after 120 s without progress, does on a loaded
    # machine: a SIGKILL before the planned point. The prediction assumed the planned kill (step 8
    # published), so judging the next restore (step 4) against it would report a wrong choice that
    # the library never made.
    import os
    import signal

    from ckpt_lesson.faults import harness

    cfg = RunConfig(total_steps=12, every_steps=4)
    base = compute_baseline(cfg)

    def arm(plan):
        def hook(name, info):
            if name == "save_end" and info.get("step") == 4:
                os.kill(os.getpid(), signal.SIGKILL)  # not the trigger: nothing announced

        return hook

    monkeypatch.setattr(harness, "_arm", arm)  # the forked child runs this one
    outcomes, _, _ = run_kill_sequence(tmp_path / "run", cfg, [KillPlan(8, "published")], base)
    assert not outcomes[0].killed and not outcomes[0].wrong_choice
    assert "not the kill trigger" in outcomes[0].error
