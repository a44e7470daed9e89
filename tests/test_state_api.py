"""The state API: any mapping of named parts saves and restores, in every manager and the file pair."""

from __future__ import annotations

import pytest
import torch

import ckpt_lesson as cl
from ckpt_lesson.runs.async_save import AsyncCheckpointer


def _build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model, opt, steps=3):
    for _ in range(steps):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


def _same(a, b):
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def _manager(path, **kw):
    return cl.CheckpointManager(path, every_steps=1, **kw)


@pytest.mark.parametrize("num_shards", [None, 3])
def test_manager_round_trip_restores_objects_in_place_and_returns_values(tmp_path, num_shards):
    model, opt = _build()
    _train(model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    hidden = torch.randn(2, 3)
    state = {"model": model, "optimizer": opt, "scaler": scaler, "hidden": hidden, "best": 0.25}
    _manager(tmp_path, num_shards=num_shards).save(7, state)
    after_save = torch.rand(3)
    model2, opt2 = _build(seed=1)
    scaler2 = torch.amp.GradScaler("cpu")
    restored = _manager(tmp_path).restore_latest(
        {"model": model2, "optimizer": opt2, "scaler": scaler2, "hidden": None, "best": None}
    )
    assert restored.step == 7 and restored.path.name == "step-00000007"
    assert restored.values["best"] == 0.25 and torch.equal(restored.values["hidden"], hidden)
    assert _same(model, model2) and scaler2.get_scale() == 1024.0
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert torch.equal(torch.rand(3), after_save)  # the RNG came back to the moment of the save


def test_a_fresh_run_directory_restores_to_none(tmp_path):
    model, opt = _build()
    assert _manager(tmp_path / "new").restore_latest({"model": model, "optimizer": opt}) is None


def test_compiled_save_restores_into_a_plain_model_and_the_reverse(tmp_path):
    model, opt = _build()
    _train(model, opt)
    compiled = torch.compile(model, backend="eager")
    assert list(compiled.state_dict())[0].startswith("_orig_mod.")
    _manager(tmp_path / "a").save(3, {"model": compiled, "optimizer": opt})
    plain, plain_opt = _build(seed=1)
    _manager(tmp_path / "a").restore_latest({"model": plain, "optimizer": plain_opt})
    assert _same(model, plain)
    _manager(tmp_path / "b").save(3, {"model": plain, "optimizer": plain_opt})
    target, target_opt = _build(seed=2)
    _manager(tmp_path / "b").restore_latest(
        {"model": torch.compile(target, backend="eager"), "optimizer": target_opt}
    )
    assert _same(model, target)


def test_positional_save_of_a_compiled_model_restores_into_a_plain_one(tmp_path):
    model, opt = _build()
    compiled = torch.compile(model, backend="eager")
    cl.save_checkpoint(compiled, opt, None, cl.TrainState(step=2), tmp_path / "c.pt")
    plain, plain_opt = _build(seed=1)
    assert cl.load_checkpoint(tmp_path / "c.pt", plain, plain_opt, None).step == 2
    assert _same(model, plain)


def test_a_save_written_before_keys_were_canonical_still_restores(tmp_path):
    # Older code saved a compiled model's keys as they came: every key prefixed with _orig_mod.
    from ckpt_lesson.files.checkpoint import build_payload

    model, opt = _build()
    _train(model, opt)
    payload = build_payload(model, opt, None, cl.TrainState(step=3))
    payload["model"] = {f"_orig_mod.{k}": v for k, v in payload["model"].items()}
    for group in payload["optimizer"]["param_groups"]:
        binding = group["ckpt_lesson_binding"]
        binding["param_names"] = [f"_orig_mod.{n}" for n in binding["param_names"]]
    cl.atomic_save(payload, tmp_path / "old.pt")
    plain, plain_opt = _build(seed=1)
    assert cl.load_checkpoint(tmp_path / "old.pt", plain, plain_opt, None).step == 3
    assert _same(model, plain)


def test_the_single_file_pair_round_trips_and_names_missing_parts(tmp_path):
    model, opt = _build()
    ema = torch.nn.Linear(2, 2)
    cl.save_state(tmp_path / "s.pt", 4, {"model": model, "optimizer": opt, "ema": ema})
    model2, opt2 = _build(seed=1)
    with pytest.raises(cl.StateMismatchError, match=r"parts \['ema'\].*strict=False"):
        cl.load_state(tmp_path / "s.pt", {"model": model2, "optimizer": opt2})
    assert _same(model2, _build(seed=1)[0])  # refused before anything changed
    restored = cl.load_state(tmp_path / "s.pt", {"model": model2, "optimizer": opt2}, strict=False)
    assert restored.step == 4 and _same(model, model2)


def test_saved_values_come_back_without_placeholders_and_objects_are_still_refused_by_name(tmp_path):
    model, opt = _build()
    values = {"hidden": [torch.ones(2), torch.zeros(2)], "best": 0.25, "epoch": 3}
    mgr = _manager(tmp_path)
    mgr.save(5, {"model": model, "optimizer": opt, **values})
    model2, opt2 = _build(seed=1)
    restored = mgr.restore_latest({"model": model2, "optimizer": opt2})  # only the objects
    assert restored.step == 5 and _same(model, model2)
    assert restored.values["best"] == 0.25 and restored.values["epoch"] == 3
    assert [t.tolist() for t in restored.values["hidden"]] == [[1.0, 1.0], [0.0, 0.0]]
    # A placeholder still works, and its saved value comes back the same way.
    again = _manager(tmp_path).restore_latest({"model": model2, "optimizer": opt2, "best": None})
    assert again.values["best"] == 0.25 and set(again.values) == {"hidden", "best", "epoch"}
    # An object left out is refused by name; so is a name the save lacks, object or placeholder.
    with pytest.raises(cl.StateMismatchError, match=r"holds parts \['optimizer'\] that the state"):
        _manager(tmp_path).restore_latest({"model": model2})
    with pytest.raises(cl.StateMismatchError, match=r"has parts \['ema'\] that the save lacks"):
        _manager(tmp_path).restore_latest({"model": model2, "optimizer": opt2, "ema": 0.0})
    # An object where a value was saved: the message says to leave it out.
    with pytest.raises(cl.StateMismatchError, match="leave it out of that state"):
        _manager(tmp_path).restore_latest({"model": model2, "optimizer": opt2, "best": torch.nn.Linear(1, 1)})


@pytest.mark.parametrize(
    ("state", "pattern"),
    [
        ({"thing": object()}, r"state\['thing'\].*neither an object"),
        ({"x": torch.nn.Module.state_dict}, r"state\['x'\]"),
        ({"m": type("OnlySave", (), {"state_dict": lambda self: {}})()}, r"no load_state_dict"),
        ({1: 2}, r"part names must be non-empty strings"),
    ],
)
def test_bad_parts_are_refused_by_name_before_anything_is_written(tmp_path, state, pattern):
    with pytest.raises(cl.CheckpointError, match=pattern):
        _manager(tmp_path).save(1, state)
    assert not list(tmp_path.glob("step-*"))


def test_none_where_an_object_was_saved_is_a_named_error(tmp_path):
    model, opt = _build()
    _manager(tmp_path).save(1, {"model": model, "optimizer": opt})
    with pytest.raises(cl.StateMismatchError, match=r"part 'optimizer'.*holds None"):
        _manager(tmp_path).restore_latest({"model": model, "optimizer": None})


def test_positional_none_optimizer_is_a_checkpoint_error_not_attribute_error(tmp_path):
    model, _ = _build()
    with pytest.raises(cl.CheckpointError, match=r"optimizer is None.*state API"):
        _manager(tmp_path).save(model, None, None, cl.TrainState(step=1))
    with pytest.raises(cl.CheckpointError, match=r"optimizer is None"):
        _manager(tmp_path).restore_latest(model, None, None)


def test_a_run_without_optimizer_or_scheduler_saves_and_restores(tmp_path):
    model, _ = _build()
    _manager(tmp_path).save(5, {"model": model})
    model2, _ = _build(seed=1)
    assert _manager(tmp_path).restore_latest({"model": model2}).step == 5
    assert _same(model, model2)


def test_rng_false_saves_no_generator_state_and_a_snapshot_is_saved_as_given(tmp_path):
    model, _ = _build()
    _manager(tmp_path / "off").save(1, {"model": model}, rng=False)
    assert _manager(tmp_path / "off").restore_latest({"model": model}).rng is None
    snap = cl.capture_rng_state()
    expected = torch.rand(4)  # what the run draws next, after the snapshot
    _manager(tmp_path / "snap").save(1, {"model": model}, rng=snap)
    _manager(tmp_path / "snap").restore_latest({"model": model})
    assert torch.equal(torch.rand(4), expected)


def test_positional_saves_restore_through_the_state_api(tmp_path):
    model, opt = _build()
    _manager(tmp_path).save(model, opt, None, cl.TrainState(step=9, epoch=1), extras={"note": "x"})
    model2, opt2 = _build(seed=1)
    restored = _manager(tmp_path).restore_latest(
        {"model": model2, "optimizer": opt2, "train_state": None, "extras": None}
    )
    assert restored.step == 9 and restored.values["train_state"]["epoch"] == 1
    assert restored.values["extras"] == {"note": "x"} and _same(model, model2)


def test_load_state_reads_a_positional_sharded_save_through_the_one_reader(tmp_path):
    from ckpt_lesson.files.sharded import save_sharded_checkpoint

    model, opt = _build()
    _train(model, opt)
    save_sharded_checkpoint(model, opt, None, cl.TrainState(step=4), tmp_path / "sharded", num_shards=3)
    model2, opt2 = _build(seed=1)
    restored = cl.load_state(tmp_path / "sharded", {"model": model2, "optimizer": opt2})
    assert restored.step == 4 and restored.values["train_state"]["step"] == 4
    assert _same(model, model2)
    assert all(
        torch.equal(a, b)
        for x, y in zip(opt.state.values(), opt2.state.values(), strict=True)
        for a, b in zip(x.values(), y.values(), strict=True)
    )


def test_a_state_api_file_that_lost_its_footer_is_refused_as_damaged(tmp_path):
    from ckpt_lesson.files.payload import build_state_payload

    model, _ = _build()
    torch.save(build_state_payload(2, {"model": model}, rng=False), tmp_path / "bare.pt")  # no footer
    with pytest.raises(cl.CorruptCheckpointError, match="without its integrity footer"):
        cl.load_state(tmp_path / "bare.pt", {"model": _build(seed=1)[0]})


def test_a_state_api_save_refuses_a_positional_restore_with_the_fix(tmp_path):
    model, opt = _build()
    _manager(tmp_path).save(1, {"model": model, "optimizer": opt})
    with pytest.raises(cl.StateMismatchError, match=r"state API.*restore_latest\(\{"):
        _manager(tmp_path).restore_latest(model, opt, None)


def test_async_state_save_copies_parts_values_and_rng_at_the_call(tmp_path):
    model, opt = _build()
    hidden = torch.zeros(3)
    mgr = _manager(tmp_path)
    with AsyncCheckpointer(mgr) as ckpt:
        snap = cl.capture_rng_state()
        expected = torch.rand(2)
        ckpt.save_async(4, {"model": model, "optimizer": opt, "hidden": hidden}, rng=snap)
        hidden.add_(1.0)  # after the call: must not reach the save
        saved_weight = model[0].weight.detach().clone()
        with torch.no_grad():
            model[0].weight.add_(1.0)
    model2, opt2 = _build(seed=1)
    restored = _manager(tmp_path).restore_latest({"model": model2, "optimizer": opt2, "hidden": None})
    assert torch.equal(restored.values["hidden"], torch.zeros(3))
    assert torch.equal(model2[0].weight, saved_weight)
    assert torch.equal(torch.rand(2), expected)


def test_async_positional_save_takes_rng_and_extras(tmp_path):
    model, opt = _build()
    mgr = _manager(tmp_path)
    snap = cl.capture_rng_state()
    expected = torch.rand(2)
    with AsyncCheckpointer(mgr) as ckpt:
        ckpt.save_async(model, opt, None, cl.TrainState(step=2), rng=snap, extras={"k": 1})
    restored = _manager(tmp_path).restore_latest(
        {"model": model, "optimizer": opt, "train_state": None, "extras": None}
    )
    assert restored.values["extras"] == {"k": 1} and torch.equal(torch.rand(2), expected)


def test_course_names_stay_importable_but_out_of_the_library_listing():
    for name in cl.COURSE_NAMES:
        assert hasattr(cl, name) and name not in cl.__all__


def test_a_mapped_restore_keeps_no_tensor_mapped_except_what_modules_copy(tmp_path):
    # Module weights may be read from the file mapping (load_state_dict copies them); optimizer
    # moments and plain values are kept by the caller, so they must be private copies.
    from ckpt_lesson.files.checkpoint import read_state_payload

    model, opt = _build()
    _train(model, opt)
    cl.save_state(tmp_path / "s.pt", 3, {"model": model, "optimizer": opt, "h": torch.ones(4)})
    payload = read_state_payload(tmp_path / "s.pt", mmap=True)
    assert payload["modules"] == ["model"]
    plain = read_state_payload(tmp_path / "s.pt", mmap=False)
    moment = payload["objects"]["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(moment, plain["objects"]["optimizer"]["state"][0]["exp_avg"])
    size = (tmp_path / "s.pt").stat().st_size
    with open(tmp_path / "s.pt", "r+b") as f:  # rewritten in place: a mapped tensor would now read zeros
        f.write(b"\0" * size)
    assert torch.equal(moment, plain["objects"]["optimizer"]["state"][0]["exp_avg"])
    assert payload["values"]["h"].tolist() == [1.0] * 4


def test_a_module_part_refuses_to_restore_into_something_else(tmp_path):
    model, opt = _build()
    cl.save_state(tmp_path / "s.pt", 1, {"model": model})
    with pytest.raises(cl.StateMismatchError, match=r"part 'model'.*torch.nn.Module"):
        cl.load_state(tmp_path / "s.pt", {"model": torch.optim.lr_scheduler.StepLR(opt, 2)})


def _untouched(model, opt, seed: int) -> bool:
    fresh_model, _ = _build(seed=seed)
    return _same(model, fresh_model) and opt.state_dict()["state"] == {}


def test_following_the_strict_hint_after_renaming_the_model_part_refuses_the_optimizer_by_name(tmp_path):
    # Issue 31, why-item 4: strict=False skipped the renamed module part but loaded its optimizer's
    # moments and step onto the weights it had not restored.
    model, opt = _build()
    _train(model, opt)
    _manager(tmp_path).save(3, {"model": model, "optimizer": opt})
    net, net_opt = _build(seed=1)
    with pytest.raises(cl.StateMismatchError, match=r"strict=False"):
        _manager(tmp_path).restore_latest({"net": net, "optimizer": net_opt})
    with pytest.raises(
        cl.StateMismatchError, match=r"part 'optimizer' holds optimizer state for .*\['model', 'net'\]"
    ):
        _manager(tmp_path).restore_latest({"net": net, "optimizer": net_opt}, strict=False)
    assert _untouched(net, net_opt, seed=1)  # nothing was changed
    # Leaving the optimizer out restores the rest; giving the module its saved name restores both.
    assert _manager(tmp_path).restore_latest({"net": net}, strict=False).step == 3
    restored = _manager(tmp_path).restore_latest(
        {"model": net, "optimizer": net_opt, "ema": None}, strict=False
    )
    assert restored.step == 3 and _same(model, net)
    assert net_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_the_file_pair_refuses_an_optimizer_without_its_module_for_both_save_forms(tmp_path):
    model, opt = _build()
    _train(model, opt)
    cl.save_state(tmp_path / "s.pt", 3, {"model": model, "optimizer": opt})
    cl.save_checkpoint(model, opt, None, cl.TrainState(step=3), tmp_path / "p.pt")
    for path in (tmp_path / "s.pt", tmp_path / "p.pt"):
        live, live_opt = _build(seed=1)
        with pytest.raises(
            cl.StateMismatchError, match=r"part 'optimizer'.*\['model'\].*leave 'optimizer' out"
        ):
            cl.load_state(path, {"optimizer": live_opt}, strict=False)
        with pytest.raises(cl.StateMismatchError, match=r"part 'optimizer'.*\['model', 'net'\]"):
            cl.load_state(path, {"net": live, "optimizer": live_opt}, strict=False)
        assert _untouched(live, live_opt, seed=1)


class LiveDict:
    """The common idiom: state_dict() hands out the object's own __dict__ (a live reference)."""

    def __init__(self, count: int = 0) -> None:
        self.count, self.history, self.buffer = count, [count], torch.full((2,), float(count))

    def state_dict(self):
        return self.__dict__

    def load_state_dict(self, sd) -> None:
        buffer = self.buffer
        self.__dict__.update(sd)
        self.buffer = buffer.copy_(sd["buffer"])  # in place, as classes that own a buffer do


class RefusesToLoad:
    def state_dict(self):
        return {"version": 1}

    def load_state_dict(self, sd) -> None:
        raise ValueError("this build cannot read version 1")


def test_a_refused_restore_rolls_back_a_part_whose_state_dict_is_its_own_dict(tmp_path):
    # Issue 31, why-item 5: the rollback reloaded part.state_dict(), the live __dict__ the failed
    # load had already changed, so "Nothing was changed" left the part restored.
    model, opt = _build()
    _train(model, opt)
    saved = {"model": model, "optimizer": opt, "counter": LiveDict(5), "loader": RefusesToLoad()}
    _manager(tmp_path).save(3, saved)
    cl.save_state(tmp_path / "s.pt", 3, saved)
    for restore in (
        lambda state: _manager(tmp_path).restore_latest(state),
        lambda state: cl.load_state(tmp_path / "s.pt", state),
    ):
        live_model, live_opt = _build(seed=1)
        counter = LiveDict(0)
        state = {"model": live_model, "optimizer": live_opt, "counter": counter, "loader": RefusesToLoad()}
        with pytest.raises(cl.StateMismatchError, match=r"part 'loader'.*Nothing was changed"):
            restore(state)
        assert (counter.count, counter.history) == (0, [0]) and torch.equal(counter.buffer, torch.zeros(2))
        assert _untouched(live_model, live_opt, seed=1)


class BrokenScheduler:
    def __init__(self, opt) -> None:
        self.inner = torch.optim.lr_scheduler.StepLR(opt, step_size=2)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd) -> None:
        raise KeyError("last_epoch")


def test_a_positional_restore_refused_by_the_scheduler_leaves_optimizer_and_model_unchanged(tmp_path):
    model, opt = _build()
    _train(model, opt)
    cl.save_checkpoint(
        model, opt, torch.optim.lr_scheduler.StepLR(opt, 2), cl.TrainState(3), tmp_path / "c.pt"
    )
    live, live_opt = _build(seed=1)
    with pytest.raises(
        cl.StateMismatchError, match=r"part 'scheduler' \(BrokenScheduler\).*Nothing was changed"
    ):
        cl.load_checkpoint(tmp_path / "c.pt", live, live_opt, BrokenScheduler(live_opt))
    assert _untouched(live, live_opt, seed=1)
