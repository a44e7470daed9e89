"""Every guarantee of a save, checked once, on every path (``_paths.PATHS``).

Guarantees (issue 31, "What to build" 4), one test each:

* ``bad_input``: refused with a ``CheckpointError`` that names the part, and nothing is saved;
* ``round_trip``: a restore gives back exactly what was saved;
* ``kill``: a SIGKILL in the middle of a save leaves the previous save restorable, and the next save works;
* ``flipped_byte``: a damaged newest save falls back to the previous good one;
* ``retention``: retention never deletes the last good save (``keep_last=1``, a save that fails);
* ``second_writer``: a second writer of an already saved step is refused, the first save stays;
* ``run_moves_on``: a restore survives the trainer's retention deleting the save it reads;
* ``zombie``: a writer frozen past its lease (buckets) commits nothing, and the previous save restores.

On a 2-rank path each test's body runs on both ranks of one gloo job (``@on_each_rank``, ``_ranks.py``).
``docs/guarantees.md`` has the guarantee x path table (``tests/contract/table.py``).
"""

from __future__ import annotations

from typing import Any

import _paths
import pytest
from _paths import Harness, same, snapshot
from _ranks import on_each_rank

from ckpt_lesson.errors import CheckpointError

save_path = _paths.save_path  # the fixture: one Harness per path

BAD_INPUTS = ["none", "no_state_dict", "dict_of_models", "missing_part", "extra_part", "unsaveable_value"]


class NoStateDict:
    pass


def _refused_save(h: Harness, case: str, run: Any) -> tuple[tuple[Any, ...], dict[str, Any], str]:
    """``(args, kwargs, pattern)`` of a save this path must refuse, naming the part."""
    m, o, s = run.model, run.optimizer, run.scheduler
    if h.path.form == "state":
        parts = {"model": m, "optimizer": o, "scheduler": s}
        return {
            "no_state_dict": ((4, {**parts, "thing": NoStateDict()}), {}, r"state\['thing'\]"),
            "dict_of_models": ((4, {**parts, "models": {"a": m}}), {}, r"state\['models'\]\['a'\]"),
            "unsaveable_value": ((4, {**parts, "fn": len}), {}, r"state\['fn'\]"),
        }[case]
    state = run.state
    return {
        "none": ((m, None, s, state), {}, r"optimizer is None"),
        "no_state_dict": ((m, NoStateDict(), s, state), {}, r"optimizer is a NoStateDict"),
        "dict_of_models": (({"a": m}, o, s, state), {}, r"model is a dict"),
        "unsaveable_value": ((m, o, s, state), {"extras": {"fn": len}}, r"\['extras'\]\['fn'\]"),
    }[case]


def _refused_restore(h: Harness, case: str, run: Any) -> tuple[dict[str, Any], str]:
    """A state-API restore this path must refuse, naming the part (the state form's None and names)."""
    parts = {"model": run.model, "optimizer": run.optimizer, "scheduler": run.scheduler, "best": None}
    return {
        "none": ({**parts, "optimizer": None}, r"part 'optimizer'.*holds None"),
        "missing_part": ({k: v for k, v in parts.items() if k != "scheduler"}, r"parts \['scheduler'\]"),
        # on ranks a second module is refused as such (one nn.Module per DCP save), naming it too
        "extra_part": ({**parts, "ema": run.model}, r"parts \['ema'\]|modules \['model', 'ema'\]"),
    }[case]


@pytest.mark.parametrize("case", BAD_INPUTS)
@on_each_rank
def test_bad_input_is_refused_naming_the_part_and_nothing_is_saved(save_path: Harness, case: str) -> None:
    h = save_path
    h.skip_unless(f"bad_input:{case}")
    mgr = h.manager(keep_last=3)
    run = h.run()
    h.save(mgr, run, 2)
    before = snapshot(run)
    if h.path.form == "positional" or case in ("no_state_dict", "dict_of_models", "unsaveable_value"):
        args, kwargs, pattern = _refused_save(h, case, run)
        run.train(until_step=4)
        with pytest.raises(CheckpointError, match=pattern):
            h.save_args(mgr, *args, **kwargs)
        assert mgr.all_steps() == [2]
    else:
        target = h.run(seed=5)
        untouched = snapshot(target)
        state, pattern = _refused_restore(h, case, target)
        with pytest.raises(CheckpointError, match=pattern):
            mgr.restore_latest(state)
        assert same(snapshot(target), untouched)  # refused before anything changed
    fresh = h.run(seed=9)
    assert h.restore(mgr, fresh)[0] == 2 and same(snapshot(fresh), before)
    mgr.close()


@on_each_rank
def test_a_save_restores_exactly(save_path: Harness) -> None:
    h = save_path
    mgr = h.manager(keep_last=2)
    run = h.run()
    h.save(mgr, run, 3)
    want = snapshot(run)
    fresh = h.run(seed=7)
    step, best = h.restore(h.manager(), fresh)
    assert step == 3 and same(snapshot(fresh), want)
    assert fresh.scheduler.state_dict() == run.scheduler.state_dict()
    assert best == (0.5 if h.path.form == "state" else None)
    mgr.close()


@on_each_rank
def test_a_flipped_byte_falls_back_to_the_previous_good_save(save_path: Harness) -> None:
    h = save_path
    mgr = h.manager(keep_last=3)
    run = h.run()
    h.save(mgr, run, 2)
    want = snapshot(run)
    h.save(mgr, run, 4)
    mgr.close()
    h.flip_a_byte(4)
    fresh = h.run(seed=7)
    reader = h.manager()
    assert h.restore(reader, fresh)[0] == 2 and same(snapshot(fresh), want)
    assert [s["step"] for s in reader.last_restore["skipped"]] == [4]
    reader.close()


@on_each_rank
def test_retention_never_deletes_the_last_good_save(save_path: Harness) -> None:
    h = save_path
    mgr = h.manager(keep_last=1)
    run = h.run()
    h.save(mgr, run, 2)
    want = snapshot(run)
    args, kwargs, _ = _refused_save(h, "unsaveable_value", run)  # a save that fails before it is written
    with pytest.raises(CheckpointError):
        h.save_args(mgr, *args, **kwargs)
    mgr.wait_retention()
    assert mgr.all_steps() == [2]
    fresh = h.run(seed=7)
    assert h.restore(h.manager(), fresh)[0] == 2 and same(snapshot(fresh), want)
    h.save(mgr, run, 6)
    mgr.wait_retention()
    assert mgr.all_steps() == [6]  # the new save is good, so now the older one may go
    mgr.close()


@on_each_rank
def test_a_second_writer_of_a_saved_step_is_refused_and_the_first_save_stays(save_path: Harness) -> None:
    h = save_path
    first, second = h.manager(keep_last=3), h.manager(keep_last=3)
    run = h.run()
    h.save(first, run, 2)
    want = snapshot(run)
    other = h.run(seed=3)  # another machine's state at the same step
    other.train(until_step=2)
    with pytest.raises(CheckpointError, match=r"already"):
        h.save_args(second, *h.args(other, 2, best=0.25))
    fresh = h.run(seed=7)
    assert h.restore(h.manager(), fresh)[0] == 2 and same(snapshot(fresh), want)
    first.close()
    second.close()


KILL_POINTS = ["part_written", "upload"]  # after the first part is written; mid-upload


@pytest.mark.parametrize("point", KILL_POINTS)
@on_each_rank
def test_a_kill_mid_save_leaves_the_previous_save_restorable(save_path: Harness, point: str) -> None:
    h = save_path
    h.skip_unless(f"kill:{point}")
    assert h.kill_mid_save(point) == -9  # the child died at the point, not before or after it
    want = h.run()
    want.train(until_step=2)  # the same seeded run, the same steps: the state the save of step 2 holds
    mgr = h.manager(keep_last=1)
    assert mgr.all_steps() == [2]
    fresh = h.run(seed=7)
    assert h.restore(mgr, fresh)[0] == 2 and same(snapshot(fresh), snapshot(want))
    h.save(mgr, fresh, 4)  # what the killed process left behind is no obstacle
    mgr.wait_retention()
    assert mgr.all_steps() == [4]
    mgr.close()


@on_each_rank
def test_a_zombie_writer_whose_lease_expired_commits_nothing(save_path: Harness) -> None:
    h = save_path
    h.skip_unless("zombie")
    assert h.stall_past_lease() == 4  # the woken writer's save raised: its lease had expired
    want = h.run()
    want.train(until_step=2)
    mgr = h.manager()
    assert mgr.all_steps() == [2]  # nothing committed, and keep_last=1 retention deleted nothing
    fresh = h.run(seed=7)
    assert h.restore(mgr, fresh)[0] == 2 and same(snapshot(fresh), snapshot(want))
    mgr.close()


@on_each_rank
def test_a_restore_survives_retention_deleting_the_save_it_reads(save_path: Harness) -> None:
    h = save_path
    h.skip_unless("run_moves_on")
    trainer, run = h.manager(keep_last=1), h.run()
    for step in (2, 4):
        h.save(trainer, run, step)
    fresh = h.run(seed=7)
    reader, step = h.restore_while_the_run_moves_on(trainer, run, fresh)
    assert step == 6 and same(snapshot(fresh), snapshot(run))  # the newer save the trainer committed
    assert [(s["step"], s["relisted"]) for s in reader.last_restore["skipped"]] == [(4, [6])]
    reader.close()
    trainer.close()
