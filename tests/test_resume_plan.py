"""Kill plans from the baseline's saves, and the trigger that fires at each kind of point."""

from __future__ import annotations

from ckpt_lesson.resume_test.plan import KillTarget, KillTrigger, plan_trials
from ckpt_lesson.resume_test.steps import StepRecord
from ckpt_lesson.resume_test.watch import FILES, MANAGER, FolderEvent

STEPS = list(range(1, 41))


def plan(**kw):
    kinds = ("after-save", "mid-save", "random")
    args = dict(steps=STEPS, save_steps=[10, 20, 30, 40], trials=3, kinds=kinds, kills=2, seed=0,
                step_seconds=0.01)  # fmt: skip
    args.update(kw)
    return plan_trials(**args)


def rec(step):
    return StepRecord(step, 0.5)


def test_kinds_cycle_from_kill_to_kill_and_saves_before_the_last_step_are_the_targets():
    plans = plan()
    assert [sorted(t.kind for t in p.targets) for p in plans] == [
        ["after-save", "mid-save"], ["after-save", "random"], ["mid-save", "random"],
    ]  # fmt: skip
    assert sorted(plans[0].kind.split("+")) == ["after-save", "mid-save"]
    first = {t.step for t in plans[0].targets}
    assert len(first) == 2 and first <= {10, 20, 30}
    for p in plans:
        steps = [t.step for t in p.targets]
        assert steps == sorted(steps)
        for t in p.targets:
            assert 1 <= t.step < 40 and 0 <= t.delay <= 0.01
            assert t.kind == "random" or t.step in (10, 20, 30)


def test_the_same_seed_gives_the_same_plan_and_another_seed_may_not():
    assert plan() == plan()
    assert any(plan(seed=s) != plan() for s in range(1, 6))


def test_without_saves_to_aim_at_a_trial_falls_back_to_random_kills():
    (p,) = plan(save_steps=[40], trials=1, kinds=("after-save",))
    assert (p.requested, p.kind) == ("after-save", "random")


def test_fewer_candidates_than_kills_gives_fewer_kills():
    (p,) = plan(save_steps=[10, 40], trials=1, kinds=("mid-save",), kills=5)
    assert [t.step for t in p.targets] == [10]


def test_after_save_in_a_manager_folder_fires_when_the_target_step_is_published():
    trigger = KillTrigger(KillTarget("after-save", 20), MANAGER)
    assert trigger.check([FolderEvent("published", "step-00000010", 10)], [], 10, saving=False) is None
    assert (
        trigger.check([FolderEvent("staging", ".staging-step-00000020-1-a", 20)], [], 20, saving=True) is None
    )
    hit = trigger.check([FolderEvent("published", "step-00000020", 20)], [], 20, saving=False)
    assert hit.point == "right after step-00000020 was published" and not hit.mid_save


def test_mid_save_in_a_manager_folder_fires_on_the_staging_folder_and_notes_a_miss():
    trigger = KillTrigger(KillTarget("mid-save", 20), MANAGER)
    hit = trigger.check([FolderEvent("staging", ".staging-step-00000020-1-a", 20)], [], 20, saving=True)
    assert hit.mid_save and "during the save of step 20" in hit.point
    late = KillTrigger(KillTarget("mid-save", 20), MANAGER)
    missed = late.check([FolderEvent("published", "step-00000020", 20)], [], 20, saving=False)
    assert not missed.mid_save and "finished before the kill" in missed.point


def test_mid_save_in_a_plain_folder_fires_on_file_activity_after_the_target_step():
    trigger = KillTrigger(KillTarget("mid-save", 10), FILES)
    assert trigger.check([FolderEvent("activity", "ckpt.pt")], [rec(5)], 5, saving=True) is None
    hit = trigger.check([FolderEvent("activity", "ckpt.pt")], [rec(10)], 10, saving=True)
    assert hit.mid_save and hit.point == "while files were being written after step 10 (ckpt.pt)"


def test_after_save_in_a_plain_folder_waits_for_the_next_step_report():
    trigger = KillTrigger(KillTarget("after-save", 10), FILES)
    assert trigger.check([FolderEvent("activity", "ckpt.pt")], [rec(10)], 10, saving=True) is None
    assert trigger.check([FolderEvent("activity", "ckpt.pt")], [], 10, saving=True) is None
    hit = trigger.check([], [rec(11)], 11, saving=False)
    assert hit.point == "right after the save at step 10 (at step 11)" and not hit.mid_save


def test_a_random_kill_waits_its_delay_after_the_target_step():
    now = [100.0]
    trigger = KillTrigger(KillTarget("random", 5, delay=0.5), FILES, clock=lambda: now[0])
    assert trigger.check([], [rec(4)], 4, saving=False) is None
    assert trigger.seconds_until_due() is None
    assert trigger.check([], [rec(5)], 5, saving=False) is None
    assert trigger.seconds_until_due() == 0.5
    now[0] += 0.5
    hit = trigger.check([], [], 5, saving=True)
    assert "0.500 s after step 5" in hit.point and "a save was in progress" in hit.point and hit.mid_save
