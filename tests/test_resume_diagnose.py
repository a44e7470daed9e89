"""The verdict on a trial and the one-line diagnosis, from the shape of the failure."""

from __future__ import annotations

from pathlib import Path

from ckpt_lesson.resume_test.compare import trajectory
from ckpt_lesson.resume_test.diagnose import exact_resumes, judge_trial
from ckpt_lesson.resume_test.plan import TrialPlan
from ckpt_lesson.resume_test.runner import Attempt, Kill, TrialRun
from ckpt_lesson.resume_test.steps import StepRecord
from ckpt_lesson.resume_test.watch import FILES, MANAGER, NONE

IDS = {s: (s % 4 * 2, s % 4 * 2 + 1) for s in range(1, 13)}  # epochs of 4 steps: 1-4, 5-8, 9-12
#: log_step's RNG digests: a seeded torch generator drawn every step, and an unseeded ``random``.
RNG = {s: {"torch": f"{s:08x}", "random": "0000aaaa"} for s in range(0, 14)}


def run(index, steps, *, losses=None, ids=IDS, rng=RNG, folder=Path(".")):
    losses = losses or {}
    records = [
        StepRecord(
            s, losses.get(s, 1.0 / s), ids.get(s) if ids else None, {}, 1.0 + s, rng.get(s) if rng else None
        )
        for s in steps
    ]
    return Attempt(index, folder, 0.0, records=records)


def killed(a, point="right after step-00000006 was published", *, mid_save=False, held=True, damaged=()):
    a.kill = Kill("after-save", 6, point, mid_save, a.records[-1].step if a.records else None, "KILL",
                  held_save=held, damaged=list(damaged))  # fmt: skip
    return a


def trial(*attempts, status="finished"):
    return TrialRun(TrialPlan(1, "after-save", "after-save"), Path("."), list(attempts), status)


BASE = trajectory(run(1, range(1, 13)).records)
BASE_NO_IDS = trajectory(run(1, range(1, 13), ids=None).records)


def judge(t, base=BASE, layout=MANAGER, exact=()):
    return judge_trial(t, base, atol=0.0, rtol=0.0, layout=layout, exact=list(exact), timeout=60)


def test_a_trial_that_matches_passes_with_no_diagnosis():
    v = judge(trial(killed(run(1, range(1, 8))), run(2, range(7, 13))))
    assert v.ok and v.diagnosis is None and v.first_difference is None
    assert [r.steps_redone for r in v.restarts] == [1]


def test_a_difference_at_the_first_resumed_step_is_named_with_its_kill():
    v = judge(trial(killed(run(1, range(1, 7))), run(2, range(7, 13), losses={7: 5.0, 8: 5.0})))
    assert not v.ok and v.first_difference.step == 7
    assert v.kill_point == "right after step-00000006 was published"
    assert v.diagnosis.startswith("diverges at the first step after resume, on the same samples")


def test_a_first_step_whose_rng_digest_differs_is_the_rng_stream_not_restored():
    other = {**RNG, 7: {"torch": "ffffffff", "random": "0000aaaa"}}
    v = judge(trial(killed(run(1, range(1, 7))), run(2, range(7, 13), losses={7: 5.0}, rng=other)))
    assert "on the same samples: RNG state not restored" in v.diagnosis


def test_a_first_step_one_draw_ahead_is_the_rng_consumed_in_another_order():
    ahead = {**RNG, 7: RNG[8]}  # a prefetched batch drew from the restored generator a second time
    v = judge(trial(killed(run(1, range(1, 7))), run(2, range(7, 13), losses={7: 5.0}, rng=ahead)))
    assert "the torch RNG stream after it equals the baseline's one step later" in v.diagnosis
    assert "the RNG was restored but consumed in another order" in v.diagnosis


def test_sample_ids_one_batch_ahead_are_the_rng_consumed_in_another_order():
    shifted = {**IDS, **{s: IDS.get(s + 1, (99,)) for s in range(7, 13)}}
    v = judge(trial(killed(run(1, range(1, 7))), run(2, range(7, 13), ids=shifted)))
    assert v.first_difference.what == "sample_ids"
    assert "its sample ids are the baseline's next batch: the RNG was restored but consumed" in v.diagnosis


def test_same_samples_and_same_rng_but_another_loss_is_other_state_missing():
    v = judge(trial(killed(run(1, range(1, 7))), run(2, range(7, 13), losses={7: 5.0})))
    assert "on the same samples and the same RNG stream: state other than model/optimizer/RNG" in v.diagnosis


def test_without_rng_digests_it_says_it_cannot_tell():
    v = judge(trial(killed(run(1, range(1, 7), rng=None)), run(2, range(7, 13), losses={7: 5.0}, rng=None)),
              base=trajectory(run(1, range(1, 13), rng=None).records))  # fmt: skip
    assert "on the same samples: cannot tell whether the RNG state was not restored" in v.diagnosis


def test_an_unseeded_generator_is_not_taken_as_evidence():
    unseeded = {s: {"random": f"{s + 500:08x}"} for s in range(14)}  # differs from the baseline's every run
    base = trajectory(run(1, range(1, 13), rng={s: {"random": f"{s:08x}"} for s in range(14)}).records)
    resumed = run(2, range(7, 13), losses={7: 5.0}, rng=unseeded)
    v = judge(trial(killed(run(1, range(1, 7), rng=unseeded)), resumed), base=base)
    assert "cannot tell" in v.diagnosis


def test_without_sample_ids_or_digests_it_cannot_tell_rng_from_data_position():
    v = judge(trial(killed(run(1, range(1, 7), ids=None, rng=None)),
                    run(2, range(7, 13), losses={7: 5.0}, ids=None, rng=None)),
              base=trajectory(run(1, range(1, 13), ids=None, rng=None).records))  # fmt: skip
    assert "cannot tell whether the RNG state, the data position or other carried state" in v.diagnosis


def test_the_first_difference_is_blamed_on_the_kill_before_it_not_the_last_kill():
    first = killed(run(1, range(1, 7)), "right after step-00000006 was published")
    second = killed(run(2, range(7, 10), losses={7: 5.0}), "at a random moment after step 9")
    v = judge(trial(first, second, run(3, range(7, 13), losses={7: 5.0})))
    assert v.first_difference.attempt == 3 and v.kill_point == "at a random moment after step 9"
    v = judge(
        trial(first, killed(run(2, range(7, 11), losses={8: 5.0}), "after step 10"), run(3, range(11, 13)))
    )
    assert v.first_difference.step == 8 and v.kill_point == "right after step-00000006 was published"


def test_a_difference_one_step_after_resume_is_the_optimizer():
    v = judge(trial(killed(run(1, range(1, 7))), run(2, range(7, 13), losses={8: 5.0})))
    assert "second does not" in v.diagnosis and "optimizer" in v.diagnosis


def test_a_difference_several_steps_after_resume_is_state_carried_across_steps():
    v = judge(trial(killed(run(1, range(1, 7))), run(2, range(7, 13), losses={9: 5.0})))
    assert v.diagnosis.startswith("the first 2 step(s) after resuming from step 6 match, then step 9")
    assert "gradient-accumulation window" in v.diagnosis


def test_one_step_late_with_other_resumes_exact_is_not_blamed_on_the_optimizer():
    v = judge(trial(killed(run(1, range(1, 7))), run(2, range(7, 13), losses={8: 5.0})), exact=[4])
    assert "resumes from step 4 were exact" in v.diagnosis and "gradient-accumulation" in v.diagnosis


def test_exact_resumes_lists_restarts_that_matched_for_several_steps():
    good = trial(killed(run(1, range(1, 5))), run(2, range(5, 13)))
    short = trial(killed(run(1, range(1, 9))), killed(run(2, range(9, 10))), run(3, range(9, 13)))
    assert exact_resumes([good, short], BASE, atol=0.0, rtol=0.0) == [4, 8]


def test_sample_ids_from_the_epoch_start_mean_the_data_position_was_lost():
    replay = {
        s: IDS[s - 2] for s in range(7, 13)
    }  # resumed at step 7 with the ids of step 5, the epoch start
    v = judge(trial(killed(run(1, range(1, 7))), run(2, range(7, 13), ids={**IDS, **replay})))
    assert v.first_difference.what == "sample_ids"
    assert v.diagnosis.startswith("sample ids repeat from the epoch start (step 5)")


#: A shuffled baseline: epochs of 4 steps (1-4, 5-8, 9-12), each in its own order.
ORDERS = [
    [(0, 1), (2, 3), (4, 5), (6, 7)],
    [(3, 6), (1, 4), (7, 0), (5, 2)],
    [(5, 0), (7, 2), (1, 6), (3, 4)],
]
SHUFFLED = {s: ORDERS[(s - 1) // 4][(s - 1) % 4] for s in range(1, 13)}


def shuffled_trial(killed_after, resumed_ids):
    first = killed(run(1, range(1, killed_after + 1), ids=SHUFFLED))
    return trial(first, run(2, range(killed_after + 1, 13), ids={**SHUFFLED, **resumed_ids}))


def test_an_epoch_that_replays_an_earlier_epochs_order_after_a_save_at_an_epochs_end_is_not_a_lost_position():
    # Resumed from the save at the end of epoch 2: epoch 3 begins where it should, in epoch 1's order
    # (a shuffle whose generator began again from its seed), as Lightning's stock resume does.
    base = trajectory(run(1, range(1, 13), ids=SHUFFLED).records)
    v = judge(
        shuffled_trial(8, {9: ORDERS[0][0], 10: ORDERS[0][1], 11: ORDERS[0][2], 12: ORDERS[0][3]}), base
    )
    assert v.first_difference.step == 9 and v.first_difference.what == "sample_ids"
    assert v.diagnosis.startswith(
        "sample ids at the first step after resume are those of step 1, the same place in the epoch begun "
        "at step 1: the data position is restored, but the epoch's shuffled order replays"
    )
    assert "restarts the epoch" not in v.diagnosis


def test_a_mid_epoch_resume_at_the_right_place_in_an_earlier_epochs_order_names_the_order():
    base = trajectory(run(1, range(1, 13), ids=SHUFFLED).records)
    v = judge(
        shuffled_trial(6, {7: ORDERS[0][2], 8: ORDERS[0][3]}), base
    )  # the batches skipped, but of epoch 1
    assert v.diagnosis.startswith("sample ids at the first step after resume are those of step 3, the same")


def test_a_restarted_epoch_in_an_earlier_epochs_order_names_the_position_and_the_order():
    base = trajectory(run(1, range(1, 13), ids=SHUFFLED).records)
    v = judge(shuffled_trial(6, {7: ORDERS[0][0], 8: ORDERS[0][1]}), base)  # epoch 2 begun again as epoch 1
    assert v.diagnosis.startswith("sample ids repeat from the epoch start (step 1) at the first step after")
    assert v.diagnosis.endswith(
        "not of the interrupted one begun at step 5: the generator the shuffle draws from was not "
        "restored either"
    )


def test_unseen_sample_ids_mean_the_data_order_was_lost():
    other = {s: (100 + s,) for s in range(7, 13)}
    v = judge(trial(killed(run(1, range(1, 7))), run(2, range(7, 13), ids={**IDS, **other})))
    assert v.diagnosis.startswith("sample ids differ at the first step after resume: the data order")
    # A plain shuffled DataLoader is the common cause: the diagnosis names the loader and its fix.
    assert v.diagnosis.endswith("save the loader's position, cl.resumable(loader) in the state")


def test_a_crash_after_a_kill_inside_a_plain_save_is_a_save_that_is_not_atomic(tmp_path):
    (tmp_path / "stderr.log").write_text("Traceback...\nEOFError: Ran out of input\n")
    cut = {"name": "ckpt.pt", "status": "possibly incomplete"}
    first = killed(
        run(1, range(1, 7)), "while files were being written after step 6", mid_save=True, damaged=[cut]
    )
    v = judge(trial(first, run(2, [], folder=tmp_path), status="crashed"), layout=FILES)
    assert "EOFError: Ran out of input" in v.diagnosis and "the save is not atomic" in v.diagnosis


def test_a_staging_folder_left_by_a_managed_save_is_not_blamed_for_a_crash(tmp_path):
    (tmp_path / "stderr.log").write_text("ValueError: bad config\n")
    staging = {"name": ".staging-step-00000006-1-a", "status": "incomplete"}
    first = killed(run(1, range(1, 7)), "during the save of step 6", mid_save=True, damaged=[staging])
    v = judge(trial(first, run(2, [], folder=tmp_path), status="crashed"))
    assert "crashed (exit None: ValueError: bad config)" in v.diagnosis and "atomic" not in v.diagnosis


def test_a_restart_from_step_zero_while_a_save_existed_means_no_checkpoint_was_found():
    v = judge(trial(killed(run(1, range(1, 7))), run(2, range(1, 13))))
    assert not v.ok and v.diagnosis.startswith("the restart began again at step 1; it did not restore a save")


def test_a_restart_that_began_again_and_crashed_on_an_existing_save_is_blamed_on_the_missing_restore(
    tmp_path,
):
    (tmp_path / "stderr.log").write_text(
        "ckpt_lesson.errors.CheckpointError: step 6 is already saved in ckpt/step-00000006 and verifies\n"
    )
    v = judge(trial(killed(run(1, range(1, 9))), run(2, range(1, 7), folder=tmp_path), status="crashed"))
    assert not v.ok and v.diagnosis.startswith("the restart began again at step 1; it did not restore a save")
    assert "restore_latest" in v.diagnosis and "then crashed (exit None: ckpt_lesson.errors" in v.diagnosis


def test_a_restart_from_step_zero_before_any_save_is_fine():
    v = judge(trial(killed(run(1, range(1, 3)), held=False), run(2, range(1, 13))))
    assert v.ok


def test_a_command_that_writes_no_checkpoint_is_no_failure_of_its_own():
    # Nothing was saved, so nothing could be resumed: the overall verdict is INCONCLUSIVE, not FAIL.
    v = judge(trial(killed(run(1, range(1, 3)), held=False), run(2, range(1, 13))), layout=NONE)
    assert v.ok and v.diagnosis is None


def test_a_difference_before_any_kill_means_the_run_is_not_reproducible():
    v = judge(trial(killed(run(1, range(1, 7), losses={2: 9.0})), run(2, range(7, 13))))
    assert v.diagnosis.startswith("the run is not reproducible") and v.kill_point is None


def test_a_timeout_names_the_kill_before_it():
    v = judge(trial(killed(run(1, range(1, 7))), run(2, range(7, 9)), status="timeout"))
    assert "did not finish within --timeout 60 s (after the kill right after" in v.diagnosis


def test_steps_never_reported_after_a_restart_mean_it_skipped_work():
    v = judge(trial(killed(run(1, range(1, 7))), run(2, range(8, 13))))
    assert v.first_difference.what == "missing" and v.diagnosis.startswith("step(s) 7 were never reported")


def with_metric(attempt, values):
    attempt.records = [
        StepRecord(r.step, r.loss, r.sample_ids, {"scale": values[r.step]}, r.t) for r in attempt.records
    ]
    return attempt


def test_a_metric_back_at_its_first_step_value_after_resume_names_the_state_that_was_reset():
    grown = {s: 2.0 ** (10 + s // 4) for s in range(1, 13)}  # a GradScaler's scale, growing
    fresh = {**grown, 7: grown[1], 8: grown[1], 9: grown[1] * 2}
    base = trajectory(with_metric(run(1, range(1, 13)), grown).records)
    first, restart = with_metric(run(1, range(1, 7)), grown), with_metric(run(2, range(7, 13)), fresh)
    v = judge(trial(killed(first), restart), base=base)
    assert not v.ok and v.first_difference.what == "metric scale"
    assert v.diagnosis.startswith("metric 'scale' is back at its first-step value (1024) at the first step")
    assert "was reset, not restored" in v.diagnosis


def test_a_metric_that_differs_without_returning_to_its_first_step_value_is_not_blamed():
    values = {s: float(s) for s in range(1, 13)}
    moved = {**values, 7: 99.0, 8: 98.0}
    base = trajectory(with_metric(run(1, range(1, 13)), values).records)
    v = judge(trial(killed(with_metric(run(1, range(1, 7)), values)),
                    with_metric(run(2, range(7, 13), losses={7: 5.0}), moved)), base=base)  # fmt: skip
    # Not blamed on the metric; with no RNG fingerprint logged the tool says it cannot tell (issue 21).
    assert "metric 'scale'" not in v.diagnosis
    assert v.diagnosis.startswith("diverges at the first step after resume, on the same samples: cannot tell")


def _resumed_with_other_rng(ids=IDS):
    drawn = {s: {"torch": f"ffff{s:04x}", "random": "0000aaaa"} for s in range(7, 14)}
    first = killed(run(1, range(1, 7)))
    first.kill.newest = {"name": "step-00000006", "step": 6, "save_id": "abc", "covers": ["model", "rng"]}
    return trial(first, run(2, range(7, 13), ids=ids, rng={**RNG, **drawn}, losses={7: 5.0}))


def test_ids_and_rng_that_differ_after_a_save_holding_the_rng_name_a_loader_built_after_the_restore():
    other = {s: (100 + s,) for s in range(7, 13)}
    v = judge(_resumed_with_other_rng({**IDS, **other}))
    assert v.diagnosis.startswith(
        "sample ids and the torch RNG stream differ at the first step after resume, although the save "
        "it resumed from (step-00000006) holds the RNG state: the generator was restored, then drawn from"
    )
    assert "DataLoader(shuffle=True) whose iterator is created after the restore" in v.diagnosis
    assert "a prefetch (or an RNG saved after the next batch was already drawn" in v.diagnosis
    assert "a model or module built after the restore" in v.diagnosis


def test_an_rng_that_differs_on_the_same_samples_after_a_save_holding_it_names_what_drew_or_reseeded():
    v = judge(_resumed_with_other_rng())
    assert v.diagnosis.startswith("diverges at the first step after resume, on the same samples: RNG state")
    assert "the save it resumed from (step-00000006) holds the RNG state" in v.diagnosis
    assert "a manual_seed after restore_latest" in v.diagnosis


def test_without_a_save_known_to_hold_the_rng_it_stays_not_restored():
    t = _resumed_with_other_rng()
    t.attempts[0].kill.newest["covers"] = ["model"]
    v = judge(t)
    assert v.diagnosis.endswith("draw differently than in the uninterrupted run)")


LOADER_AFTER_RESTORE = """
import os
import torch
from torch.utils.data import DataLoader, TensorDataset
from ckpt_lesson import CheckpointManager, TrainState, log_step
torch.set_num_threads(1)
torch.manual_seed(0)
data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1), torch.arange(32))
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
manager = CheckpointManager(os.environ["CKPT_LESSON_CKPT_DIR"], every_steps=4)
state = manager.restore_latest(model, optimizer, None) or TrainState()
while state.step < 24:
    loader = DataLoader(data, batch_size=4, shuffle=True)  # built (and iterated) after the restore
    for i, (x, y, ids) in enumerate(loader):
        if i < state.batch_in_epoch:
            continue  # the batches this epoch already trained on
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state.step += 1
        state.batch_in_epoch += 1
        log_step(state.step, loss.item(), sample_ids=ids)
        if state.step % 4 == 0:
            manager.save(model, optimizer, None, state)
        if state.step >= 24:
            break
    else:
        state.epoch += 1
        state.batch_in_epoch = 0
"""


def test_a_shuffled_loader_built_after_the_restore_is_named_as_the_consumer_of_the_restored_rng(
    tmp_path, capsys
):
    import json
    import sys

    from ckpt_lesson.cli import main

    script = tmp_path / "loader_after_restore.py"
    script.write_text(LOADER_AFTER_RESTORE)
    code = main(["resume-test", "--workdir", str(tmp_path / "w"), "--trials", "1", "--kills", "1",
                 "--kill-at", "after-save", "--", sys.executable, str(script)])  # fmt: skip
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "w" / "report.json").read_text())
    assert code == 1 and report["repeatability"]["repeats"], out
    assert "although the save it resumed from (step-000000" in report["diagnosis"], out
    assert "DataLoader(shuffle=True) whose iterator is created after the restore" in report["diagnosis"]
