"""Sharded checkpoints: bit-for-bit resume, index-last commit, and every refusal."""

from __future__ import annotations

import builtins
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt_lesson.files.sharded as sharded
from ckpt_lesson.course.training import (
    SyntheticRegression,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
    train,
)
from ckpt_lesson.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    SchemaError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from ckpt_lesson.files.checkpoint import TrainState
from ckpt_lesson.files.hashing import DEFAULT_ALGO, digest_bytes
from ckpt_lesson.files.record_seal import seal_record
from ckpt_lesson.files.shard_index import read_shard_index, verify_sharded_checkpoint
from ckpt_lesson.files.shard_plan import plan_shards, shard_keys_by_prefix
from ckpt_lesson.files.sharded import load_sharded_checkpoint, save_sharded_checkpoint

SEED = 7
N_SAMPLES = 64  # 4 batches of 16 per epoch, so a 10-step run crosses epochs


def build(seed: int = SEED):
    seed_everything(seed)
    data = SyntheticRegression(n=N_SAMPLES, seed=0)
    model = make_model()
    optimizer, scheduler = make_optimizer_and_scheduler(model, total_steps=10)
    return data, model, optimizer, scheduler


def save_after_steps(out_dir: Path, steps: int = 3, **kwargs) -> sharded.ShardedSaveResult:
    data, model, optimizer, scheduler = build()
    state = TrainState()
    train(model, optimizer, scheduler, state, data, until_step=steps, seed=SEED)
    kwargs.setdefault("num_shards", 3)
    return save_sharded_checkpoint(model, optimizer, scheduler, state, out_dir, **kwargs)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    out = tmp_path / "step-3"
    save_after_steps(out)
    return out


def edit_index(ckpt_dir: Path, change) -> None:
    path = ckpt_dir / "index.json"
    index = json.loads(path.read_text())
    change(index)
    # Re-sealed like an attacker would: the index's own checksum is public, so the checks behind it must hold.
    path.write_text(json.dumps(seal_record(index)))


def assert_refused(ckpt_dir: Path, error: type[CheckpointError], model=None) -> CheckpointError:
    """Load must raise ``error`` and leave the fresh model's weights exactly as they were."""
    if model is None:
        _, model, optimizer, scheduler = build(seed=999)
    else:
        optimizer, scheduler = make_optimizer_and_scheduler(model, total_steps=10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error) as info:
        load_sharded_checkpoint(ckpt_dir, model, optimizer, scheduler)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    return info.value


# --- round trip ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["round_robin", "param_group"])
def test_sharded_resume_matches_an_uninterrupted_run_bit_for_bit(tmp_path: Path, layout: str) -> None:
    data, model, optimizer, scheduler = build()
    reference = TrainState()
    train(model, optimizer, scheduler, reference, data, until_step=10, seed=SEED)

    data, model, optimizer, scheduler = build()
    state = TrainState()
    train(model, optimizer, scheduler, state, data, until_step=5, seed=SEED)
    out = tmp_path / "ckpt"
    save_sharded_checkpoint(model, optimizer, scheduler, state, out, num_shards=3, layout=layout)

    # Fresh objects from a *different* seed: only the checkpoint can make the run match.
    data, model, optimizer, scheduler = build(seed=999)
    resumed = load_sharded_checkpoint(out, model, optimizer, scheduler)
    assert resumed.step == 5
    train(model, optimizer, scheduler, resumed, data, until_step=10, seed=SEED)
    assert resumed.losses == reference.losses
    assert (resumed.epoch, resumed.batch_in_epoch) == (reference.epoch, reference.batch_in_epoch)


def test_save_creates_missing_parent_directories_and_names_shards_with_three_digits(tmp_path: Path) -> None:
    result = save_after_steps(tmp_path / "a" / "b" / "step-3", num_shards=2)
    names = sorted(p.name for p in result.out_dir.iterdir())
    assert names == ["index.json", "meta.pt", "model.shard-000.pt", "model.shard-001.pt"]
    assert [f["name"] for f in result.files] == ["model.shard-000.pt", "model.shard-001.pt"]


# --- index last, hashes while writing ------------------------------------------------------


def test_the_index_is_written_after_every_shard_and_meta(tmp_path: Path, monkeypatch) -> None:
    order: list[str] = []
    real_save, real_json = sharded.atomic_save, sharded.atomic_write_json

    # Recorded when each write has *finished*: the parts are written in parallel, in any order.
    def spy_save(payload, path, **kwargs):
        digest = real_save(payload, path, **kwargs)
        order.append(Path(path).name)
        return digest

    def spy_json(obj, path, **kwargs):
        assert (Path(path).parent / "index.json").exists() is False
        digest = real_json(obj, path, **kwargs)
        order.append(Path(path).name)
        return digest

    monkeypatch.setattr(sharded, "atomic_save", spy_save)
    monkeypatch.setattr(sharded, "atomic_write_json", spy_json)
    save_after_steps(tmp_path / "ckpt", num_shards=3)
    shards = ["model.shard-000.pt", "model.shard-001.pt", "model.shard-002.pt"]
    assert sorted(order[:-1]) == sorted([*shards, "meta.pt"])
    assert order[-1] == "index.json"


def test_a_crash_while_writing_a_shard_leaves_no_index_and_load_says_incomplete(
    tmp_path: Path, monkeypatch
) -> None:
    real_save = sharded.atomic_save

    def dies_on_second_shard(payload, path, **kwargs):
        if Path(path).name == "model.shard-001.pt":
            raise KeyboardInterrupt("killed mid-save")
        return real_save(payload, path, **kwargs)

    monkeypatch.setattr(sharded, "atomic_save", dies_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        save_after_steps(tmp_path / "ckpt", num_shards=3)
    assert (tmp_path / "ckpt" / "model.shard-000.pt").exists()
    assert not (tmp_path / "ckpt" / "index.json").exists()
    err = assert_refused(tmp_path / "ckpt", IncompleteCheckpointError)
    assert "never finished" in str(err)


def test_index_sizes_and_hashes_equal_those_of_the_bytes_on_disk(tmp_path: Path) -> None:
    result = save_after_steps(tmp_path / "ckpt", num_shards=3)
    index = read_shard_index(result.out_dir)
    for entry in [*index["shards"], index["meta"]]:
        raw = (result.out_dir / entry["file"]).read_bytes()
        assert entry["bytes"] == len(raw)
        assert entry["algo"] == DEFAULT_ALGO and entry["digest"] == digest_bytes(raw, DEFAULT_ALGO)
    assert [e["digest"] for e in index["shards"]] == [f["digest"] for f in result.files]
    index_bytes = (result.out_dir / "index.json").read_bytes()
    assert result.index.digest == digest_bytes(index_bytes, result.index.algo)
    assert index["payload_schema"] == "ckpt.v2" and index["layout"] == "round_robin"


def test_save_never_reads_back_the_files_it_wrote(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "ckpt"
    reads: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def spy_open(file, mode="r", *args, **kwargs):
        if "r" in mode and str(out) in str(file):
            reads.append(f"open {file} {mode}")
        return real_open(file, mode, *args, **kwargs)

    def spy_os_open(path, flags, *args, **kwargs):
        is_dir = os.path.isdir(path)
        if str(out) in str(path) and not is_dir and not flags & (os.O_WRONLY | os.O_RDWR):
            reads.append(f"os.open {path}")
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(f"read_bytes {self}"))
    result = save_after_steps(out, num_shards=3)
    monkeypatch.undo()
    assert reads == []
    assert result.files[0]["digest"] == digest_bytes((out / "model.shard-000.pt").read_bytes())


# --- save-side validation -----------------------------------------------------------------


def test_save_refuses_a_directory_that_already_holds_a_checkpoint(ckpt: Path) -> None:
    index_before = (ckpt / "index.json").read_bytes()
    with pytest.raises(CheckpointError, match="new directory"):
        save_after_steps(ckpt, num_shards=2)
    assert (ckpt / "index.json").read_bytes() == index_before


@pytest.mark.parametrize(
    ("num_shards", "layout", "match"),
    [
        (0, "round_robin", "num_shards"),
        (True, "round_robin", "num_shards"),
        (2.0, "round_robin", "num_shards"),
        (2, "zigzag", "layout"),
        (1, "param_group", ">= 2"),
    ],
)
def test_save_rejects_bad_shard_arguments_before_creating_anything(
    tmp_path: Path, num_shards, layout: str, match: str
) -> None:
    with pytest.raises(CheckpointError, match=match):
        save_after_steps(tmp_path / "ckpt", num_shards=num_shards, layout=layout)
    assert not (tmp_path / "ckpt").exists()


def test_save_refuses_an_out_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_bytes(b"not a directory")
    with pytest.raises(CheckpointError, match="is a file"):
        save_after_steps(tmp_path / "ckpt", num_shards=2)


def test_save_clears_leftover_shards_of_an_unfinished_save(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "model.shard-004.pt").write_bytes(b"debris of a save killed before its index")
    save_after_steps(out, num_shards=2)
    assert not (out / "model.shard-004.pt").exists()
    assert len(verify_sharded_checkpoint(out)) == 3


def test_a_shard_holding_a_view_stores_only_the_view_bytes(tmp_path: Path) -> None:
    class Sliced(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("big", torch.zeros(100_000), persistent=False)
            self.register_buffer("small", self.big[:4])

    model = Sliced()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    result = save_sharded_checkpoint(model, optimizer, None, TrainState(), tmp_path / "c", num_shards=1)
    assert result.shard_bytes[0] < 10_000  # not the 400 kB of the buffer it was sliced from


# --- refusals: every one leaves the model untouched ---------------------------------------


def test_load_refuses_a_shard_with_one_flipped_byte(ckpt: Path) -> None:
    shard = ckpt / "model.shard-001.pt"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    assert_refused(ckpt, CorruptCheckpointError)
    with pytest.raises(CorruptCheckpointError):
        verify_sharded_checkpoint(ckpt)


def test_load_refuses_a_shard_swapped_for_the_same_shard_of_another_save(ckpt: Path, tmp_path: Path) -> None:
    # The swapped-in file is intact (its own footer checks out); only the index's sha256 catches it.
    other = save_after_steps(tmp_path / "step-4", steps=4).out_dir
    shutil.copyfile(other / "model.shard-001.pt", ckpt / "model.shard-001.pt")
    err = assert_refused(ckpt, CorruptCheckpointError)
    assert "model.shard-001.pt" in str(err)


def test_load_refuses_a_truncated_shard(ckpt: Path) -> None:
    shard = ckpt / "model.shard-002.pt"
    shard.write_bytes(shard.read_bytes()[:-100])
    err = assert_refused(ckpt, CorruptCheckpointError)
    assert "bytes on disk" in str(err)


def test_load_refuses_a_tampered_meta_file(ckpt: Path) -> None:
    meta = ckpt / "meta.pt"
    raw = bytearray(meta.read_bytes())
    raw[100] ^= 0xFF
    meta.write_bytes(bytes(raw))
    assert_refused(ckpt, CorruptCheckpointError)


@pytest.mark.parametrize("name", ["model.shard-001.pt", "meta.pt"])
def test_load_refuses_a_checkpoint_with_a_missing_file(ckpt: Path, name: str) -> None:
    (ckpt / name).unlink()
    err = assert_refused(ckpt, IncompleteCheckpointError)
    assert name in str(err)


def test_load_refuses_a_directory_without_index(ckpt: Path) -> None:
    (ckpt / "index.json").unlink()
    assert_refused(ckpt, IncompleteCheckpointError)


@pytest.mark.parametrize(
    "bad_name",
    ["../x.pt", "sub/../../x.pt", "/etc/passwd", "..\\x.pt", "C:\\x.pt", "./model.shard-000.pt", ""],
)
def test_load_refuses_index_file_names_that_could_leave_the_directory(ckpt: Path, bad_name: str) -> None:
    edit_index(ckpt, lambda index: index["shards"][1].update(file=bad_name))
    assert_refused(ckpt, UnsafeCheckpointError)


def test_load_refuses_an_absolute_path_even_to_a_file_inside_the_directory(ckpt: Path) -> None:
    inside = str((ckpt / "model.shard-001.pt").resolve())
    edit_index(ckpt, lambda index: index["meta"].update(file=inside))
    assert_refused(ckpt, UnsafeCheckpointError)


def test_load_refuses_a_shard_replaced_by_a_symlink_leaving_the_directory(ckpt: Path, tmp_path: Path) -> None:
    shard = ckpt / "model.shard-000.pt"
    outside = tmp_path / "elsewhere.pt"
    shutil.copyfile(shard, outside)  # identical bytes: the hash would pass, the path must not
    shard.unlink()
    shard.symlink_to(outside)
    err = assert_refused(ckpt, UnsafeCheckpointError)
    assert "outside the checkpoint directory" in str(err)


def test_load_refuses_a_shard_that_is_a_symlink_loop(ckpt: Path) -> None:
    shard = ckpt / "model.shard-000.pt"
    shard.unlink()
    shard.symlink_to("loop.pt")
    (ckpt / "loop.pt").symlink_to("model.shard-000.pt")
    assert_refused(ckpt, UnsafeCheckpointError)


def test_load_follows_a_symlink_that_stays_inside_the_directory(ckpt: Path) -> None:
    shard = ckpt / "model.shard-000.pt"
    shard.rename(ckpt / "real-000.bin")
    shard.symlink_to("real-000.bin")
    _, model, optimizer, scheduler = build(seed=999)
    assert load_sharded_checkpoint(ckpt, model, optimizer, scheduler).step == 3


def test_load_refuses_a_key_listed_in_two_shards(ckpt: Path) -> None:
    def duplicate(index):
        index["shards"][1]["keys"].append(index["shards"][0]["keys"][0])

    edit_index(ckpt, duplicate)
    err = assert_refused(ckpt, CorruptCheckpointError)
    assert "shard 0 and shard 1" in str(err)


def test_load_refuses_a_num_shards_that_disagrees_with_the_listed_shards(ckpt: Path) -> None:
    edit_index(ckpt, lambda index: index.update(num_shards=4))
    assert_refused(ckpt, CorruptCheckpointError)


def test_load_refuses_a_shard_file_the_index_does_not_list(ckpt: Path) -> None:
    shutil.copyfile(ckpt / "model.shard-000.pt", ckpt / "model.shard-003.pt")
    err = assert_refused(ckpt, CorruptCheckpointError)
    assert "model.shard-003.pt" in str(err)


def test_load_refuses_a_shard_whose_keys_differ_from_the_index(ckpt: Path) -> None:
    edit_index(ckpt, lambda index: index["shards"][2]["keys"].pop())
    err = assert_refused(ckpt, CorruptCheckpointError)
    assert "model.shard-002.pt" in str(err)


def test_load_refuses_a_model_with_a_key_the_checkpoint_lacks(ckpt: Path) -> None:
    seed_everything(999)
    bigger = torch.nn.Sequential(*make_model(), torch.nn.Linear(1, 1))
    err = assert_refused(ckpt, StateMismatchError, model=bigger)
    assert "missing ['7.bias', '7.weight']" in str(err)


def test_load_refuses_a_model_without_a_key_the_checkpoint_has(ckpt: Path) -> None:
    seed_everything(999)
    smaller = torch.nn.Sequential(*list(make_model())[:-1])
    err = assert_refused(ckpt, StateMismatchError, model=smaller)
    assert "unexpected ['6.bias', '6.weight']" in str(err)


def test_load_refuses_an_index_that_is_not_json(ckpt: Path) -> None:
    (ckpt / "index.json").write_text('{"schema": "ckpt.sharded.v1", ')
    assert_refused(ckpt, CorruptCheckpointError)


def test_load_refuses_an_index_of_an_unknown_schema(ckpt: Path) -> None:
    edit_index(ckpt, lambda index: index.update(schema="ckpt.sharded.v9"))
    assert_refused(ckpt, SchemaError)


def test_load_refuses_a_payload_schema_newer_than_this_code_before_reading_shards(ckpt: Path) -> None:
    edit_index(ckpt, lambda index: index.update(payload_schema="ckpt.v99"))
    (ckpt / "meta.pt").unlink()  # never reached: the index alone is enough to refuse
    assert_refused(ckpt, SchemaError)


def test_load_refuses_an_index_that_is_a_symlink_leaving_the_directory(ckpt: Path, tmp_path: Path) -> None:
    outside = tmp_path / "index-elsewhere.json"
    shutil.copyfile(ckpt / "index.json", outside)
    (ckpt / "index.json").unlink()
    (ckpt / "index.json").symlink_to(outside)
    assert_refused(ckpt, UnsafeCheckpointError)


def test_load_refuses_an_index_recording_a_malformed_hash(ckpt: Path) -> None:
    edit_index(ckpt, lambda index: index["shards"][0].update(digest="not-a-hash"))
    assert_refused(ckpt, CorruptCheckpointError)


# --- the optimizer state sits with its parameters (ckpt.sharded.v2) -------------------------------


def test_the_optimizer_moments_are_written_into_the_shards_not_into_meta(tmp_path: Path) -> None:
    result = save_after_steps(tmp_path / "ckpt", num_shards=3)
    meta = torch.load(result.out_dir / "meta.pt", weights_only=True)
    assert meta["optimizer"]["state"] == {}
    listed = [pid for f in result.files for pid in f["optimizer_state"]]
    n_params = len(list(build()[1].parameters()))
    assert sorted(listed) == list(range(n_params))
    for f in result.files:
        body = torch.load(result.out_dir / f["name"], weights_only=True)
        assert sorted(body["optimizer_state"]) == sorted(f["optimizer_state"])
        assert all("exp_avg" in body["optimizer_state"][pid] for pid in f["optimizer_state"])


def test_parallel_and_one_at_a_time_writers_produce_identical_shards(tmp_path: Path) -> None:
    one = save_after_steps(tmp_path / "one", num_shards=4, workers=1)
    many = save_after_steps(tmp_path / "many", num_shards=4, workers=4)
    assert [f["digest"] for f in one.files] == [f["digest"] for f in many.files]
    assert [f["keys"] for f in one.files] == [f["keys"] for f in many.files]


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2"])
def test_save_rejects_a_bad_worker_count_before_creating_anything(tmp_path: Path, workers) -> None:
    with pytest.raises(CheckpointError, match="workers must be an int >= 1"):
        save_after_steps(tmp_path / "ckpt", workers=workers)
    assert not (tmp_path / "ckpt").exists()


def _rewrite_as_v1(ckpt_dir: Path) -> None:
    """Turn a v2 save into the v1 layout earlier versions wrote: moments back in meta.pt."""
    from ckpt_lesson.files.atomic import atomic_save

    index = json.loads((ckpt_dir / "index.json").read_text())
    meta = torch.load(ckpt_dir / "meta.pt", weights_only=True)
    for entry in index["shards"]:
        body = torch.load(ckpt_dir / entry["file"], weights_only=True)
        meta["optimizer"]["state"].update(body["optimizer_state"])
        digest = atomic_save(body["model"], ckpt_dir / entry["file"], algo="sha256")
        entry.pop("optimizer_state")
        entry.update(digest.record())
    meta["optimizer"]["state"] = dict(sorted(meta["optimizer"]["state"].items()))
    index["meta"].update(atomic_save(meta, ckpt_dir / "meta.pt", algo="sha256").record())
    index["schema"] = "ckpt.sharded.v1"
    index.pop("record_digest", None)
    (ckpt_dir / "index.json").write_text(json.dumps(seal_record(index)))


def test_a_v1_checkpoint_with_the_moments_in_meta_still_resumes_bit_for_bit(tmp_path: Path) -> None:
    data, model, optimizer, scheduler = build()
    reference = TrainState()
    train(model, optimizer, scheduler, reference, data, until_step=8, seed=SEED)
    out = tmp_path / "ckpt"
    save_after_steps(out, steps=4)
    _rewrite_as_v1(out)
    assert read_shard_index(out)["schema"] == "ckpt.sharded.v1"
    data, model, optimizer, scheduler = build(seed=999)
    resumed = load_sharded_checkpoint(out, model, optimizer, scheduler)
    train(model, optimizer, scheduler, resumed, data, until_step=8, seed=SEED)
    assert resumed.losses == reference.losses


def test_load_refuses_an_optimizer_state_listed_in_two_shards(ckpt: Path) -> None:
    edit_index(
        ckpt,
        lambda index: index["shards"][1]["optimizer_state"].extend(index["shards"][0]["optimizer_state"]),
    )
    assert "listed in shard 0 and shard 1" in str(assert_refused(ckpt, CorruptCheckpointError))


def test_load_refuses_a_v2_shard_entry_without_its_optimizer_state_list(ckpt: Path) -> None:
    edit_index(ckpt, lambda index: index["shards"][0].pop("optimizer_state"))
    assert "optimizer_state" in str(assert_refused(ckpt, CorruptCheckpointError))


def test_load_refuses_a_shard_holding_other_parameters_optimizer_state(ckpt: Path) -> None:
    # Swap two shards' lists in the index: each file's hash still matches, its contents no longer do.
    def swap(index):
        a, b = index["shards"][0], index["shards"][1]
        a["optimizer_state"], b["optimizer_state"] = b["optimizer_state"], a["optimizer_state"]

    edit_index(ckpt, swap)
    assert "optimizer states of other parameters" in str(assert_refused(ckpt, CorruptCheckpointError))


def test_verify_returns_the_digests_the_save_recorded(tmp_path: Path) -> None:
    result = save_after_steps(tmp_path / "ckpt", num_shards=3)
    digests = verify_sharded_checkpoint(result.out_dir)
    assert [d.digest for d in digests] == [f["digest"] for f in result.files] + [result.meta["digest"]]
    assert [d.size for d in digests] == [*result.shard_bytes, result.meta["bytes"]]


def test_a_refusal_still_raises_under_python_dash_o(ckpt: Path) -> None:
    shard = ckpt / "model.shard-001.pt"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    script = textwrap.dedent(
        """
        import sys
        from ckpt_lesson.files.sharded import load_sharded_checkpoint
        from ckpt_lesson.course.training import make_model, make_optimizer_and_scheduler
        print("optimize", sys.flags.optimize)
        model = make_model()
        load_sharded_checkpoint(sys.argv[1], model, *make_optimizer_and_scheduler(model))
        print("LOADED")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-O", "-c", script, str(ckpt)], capture_output=True, text=True, timeout=120
    )
    assert "optimize 1" in proc.stdout
    assert proc.returncode != 0 and "LOADED" not in proc.stdout
    assert "CorruptCheckpointError" in proc.stderr


# --- planning (pure) ------------------------------------------------------------------------


def test_shard_keys_by_prefix_sends_sorted_key_j_to_shard_j_mod_n_as_a_dict() -> None:
    sd = {f"k{i}": torch.zeros(1) for i in (6, 2, 5, 0, 3, 1, 4)}  # registration order is not sorted
    assert shard_keys_by_prefix(sd, 3) == {0: ["k0", "k3", "k6"], 1: ["k1", "k4"], 2: ["k2", "k5"]}
    assert shard_keys_by_prefix(sd, 9)[8] == []  # every shard index is present, even an empty one


def test_param_group_gives_weights_the_first_half_of_the_shards_and_balances_them_by_size() -> None:
    sd = {
        "a.weight": torch.zeros(100),
        "a.bias": torch.zeros(10),
        "b.weight": torch.zeros(60),
        "b.bias": torch.zeros(1),
        "c.weight": torch.zeros(50),
        "bn.running_mean": torch.zeros(5),
    }
    plan = plan_shards(sd, 5, "param_group")
    assert plan[:3] == [["a.weight"], ["b.weight"], ["c.weight"]]
    assert plan[3:] == [["a.bias"], ["b.bias", "bn.running_mean"]]
    # two weight shards: 100 alone, 60 + 50 together (greedy largest-first into the lightest)
    assert plan_shards(sd, 4, "param_group")[:2] == [["a.weight"], ["b.weight", "c.weight"]]


def test_plan_gives_empty_shards_when_there_are_more_shards_than_keys() -> None:
    assert plan_shards({"w": torch.zeros(2)}, 3) == [["w"], [], []]


state_dicts = st.dictionaries(
    st.text("abcxyz.", min_size=1, max_size=6).flatmap(
        lambda stem: st.sampled_from([stem + ".weight", stem + ".bias", stem + ".running_var"])
    ),
    st.integers(0, 50).map(torch.zeros),
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(sd=state_dicts, num_shards=st.integers(2, 6), layout=st.sampled_from(["round_robin", "param_group"]))
def test_every_plan_places_every_key_exactly_once(sd, num_shards: int, layout: str) -> None:
    plan = plan_shards(sd, num_shards, layout)
    assert len(plan) == num_shards
    placed = [k for shard in plan for k in shard]
    assert sorted(placed) == sorted(sd)
    order = list(sd)
    assert all(shard == sorted(shard, key=order.index) for shard in plan)
    if layout == "param_group":
        n_weights = (num_shards + 1) // 2
        assert all(k.endswith("weight") for shard in plan[:n_weights] for k in shard)
        assert not any(k.endswith("weight") for shard in plan[n_weights:] for k in shard)
