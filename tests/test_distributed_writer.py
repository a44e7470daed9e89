"""CommitWriter and its hashing file system: digests taken in the write, commit in finish."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _distributed_local import save_locally
from _distributed_workers import make_run
from torch.distributed.checkpoint.api import CheckpointException

from ckpt_lesson import IncompleteCheckpointError, TrainState
from ckpt_lesson.distributed import (
    CommitWriter,
    DistributedCheckpointManager,
    FolderTarget,
    HashingFileSystem,
    hash_file,
)
from ckpt_lesson.runs.dcp_manifest import read_dcp_manifest


@pytest.mark.parametrize(("algo", "threads"), [("xxh3_128", 1), ("sha256", 3)])
def test_every_file_written_is_in_the_manifest_with_the_digest_of_its_bytes(
    tmp_path: Path, algo: str, threads: int
) -> None:
    save_locally(tmp_path / "run", steps=(2,), algo=algo, thread_count=threads)
    folder = tmp_path / "run" / "step-00000002"
    manifest, _ = read_dcp_manifest(folder)
    on_disk = {p.name for p in folder.iterdir()} - {"manifest.json"}
    assert on_disk == {part["file"] for part in manifest["parts"]}
    assert len(on_disk) == threads + 1  # one data file per writer thread, plus .metadata
    for part in manifest["parts"]:  # the digests taken while writing match a fresh read of the file
        assert part["algo"] == algo
        recorded = {"algo": part["algo"], "digest": part["digest"]}
        assert hash_file(folder / part["file"], algo) == (part["bytes"], recorded)


def test_the_file_system_creates_files_exclusively(tmp_path: Path) -> None:
    fs = HashingFileSystem()
    (tmp_path / "taken").write_bytes(b"old")
    with pytest.raises(FileExistsError), fs.create_stream(tmp_path / "taken", "wb"):
        pass
    assert (tmp_path / "taken").read_bytes() == b"old"


def test_a_stream_that_fails_midway_leaves_no_record(tmp_path: Path) -> None:
    fs = HashingFileSystem()
    with pytest.raises(OSError), fs.create_stream(tmp_path / "f", "wb") as stream:
        stream.write(b"half")
        raise OSError("disk full")
    with fs.create_stream(tmp_path / "g", "wb") as stream:
        stream.write(memoryview(b"whole"))
        assert stream.tell() == 5 and stream.fileno() > 2
    assert set(fs.records) == {"g"}
    assert fs.records["g"][0] == 5


def test_the_commit_events_come_in_protocol_order_and_the_manifest_last(tmp_path: Path) -> None:
    events: list[str] = []
    save_locally(tmp_path / "run", steps=(2,), on_event=lambda name, info: events.append(name))
    order = [events.index(name) for name in ("save_begin", "file_partial", "writes_complete", "finish_begin")]
    order += [
        events.index(name) for name in ("metadata_written", "manifest_written", "published", "save_end")
    ]
    assert order == sorted(order)


class _LosesAnItem(CommitWriter):
    """Drops one write result, as a writer thread that died silently would (DCP swallows its error)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        results = future.wait()
        future = torch.futures.Future()
        future.set_result(results[:-1])
        return future


def test_a_planned_item_that_was_never_written_fails_the_save_and_publishes_nothing(tmp_path: Path) -> None:
    model, opt, _, _ = make_run("plain", 1, 0)
    staging, final = tmp_path / ".staging-step-00000002-x", tmp_path / "step-00000002"
    staging.mkdir()
    fields = {"world_size": 1, "per_rank_keys": ["rank0_local"], "state": {}, "covers": [], "metadata": {}}
    writer = _LosesAnItem(FolderTarget(staging, final), step=2, manifest_fields=fields)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"model": model.state_dict()}, storage_writer=writer, no_dist=True)
    [(error, _)] = info.value.failures.values()
    assert isinstance(error, IncompleteCheckpointError) and "1 planned item(s) were not written" in str(error)
    assert not final.exists() and not (staging / "manifest.json").exists()


def test_an_async_save_hashes_and_commits_in_the_background_thread(tmp_path: Path) -> None:
    threads: dict[str, str] = {}

    def hook(name: str, info: dict[str, Any]) -> None:
        threads.setdefault(name, threading.current_thread().name)

    model, opt, sched, _ = make_run("plain", 1, 0)
    mgr = DistributedCheckpointManager(tmp_path / "run", every_steps=2, on_event=hook)
    mgr.save_async(model, opt, sched, TrainState(step=2))
    folder = mgr.wait()
    assert threads["save_begin"] == threading.current_thread().name
    for name in ("file_partial", "finish_begin", "manifest_written", "published"):
        assert threads[name] != threading.current_thread().name, name
    manifest, _ = read_dcp_manifest(folder)
    for part in manifest["parts"]:
        recorded = {"algo": part["algo"], "digest": part["digest"]}
        assert hash_file(folder / part["file"]) == (part["bytes"], recorded)
