"""``cl.resumable(DataLoader(...))``: a run stopped mid-epoch resumes with exactly the batches it had left.

Each sampler kind runs three epochs uninterrupted, then again stopped in the middle of epoch 1:
the position goes through ``torch.save`` / ``torch.load(weights_only=True)``, everything is built
fresh (a new dataset, a new loader, another global seed) and restored. The batches (sample ids
and the augmentation each fetch drew) must be the uninterrupted run's, and the dataset's fetch log
(written by the worker processes too) must show that the skip read nothing. One case is a real
process SIGKILLed mid-epoch and restarted through ``CheckpointManager``.
"""

from __future__ import annotations

import io
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
)

import ckpt_lesson as cl
from ckpt_lesson.errors import CheckpointError, StateMismatchError
from ckpt_lesson.runs.data_position import PassBatches, SeededFetch, TaggedBatch, derive_seed, seeded_globals

EPOCHS = 3
WORKER = Path(__file__).with_name("_data_position_worker.py")


class Augmented(Dataset):
    """23 samples (batches of 4 leave a short last one); each fetch logs its index to a file and
    draws a random augmentation from the global generator, so worker seeding shows."""

    def __init__(self, log: Path, size: int = 23) -> None:
        self.log, self.size = log, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        with open(self.log, "a") as f:  # appends from worker processes land too
            f.write(f"{int(index)}\n")
        return torch.tensor([int(index), int(torch.randint(1000, ()))])


class ShuffledChunks:
    """A user batch sampler: chunks of 3 in an order drawn from the global generator at its start."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return (self.n + 2) // 3

    def __iter__(self):
        chunks = [list(range(i, min(i + 3, self.n))) for i in range(0, self.n, 3)]
        for k in torch.randperm(len(chunks)).tolist():
            yield chunks[k]


KINDS = {
    "random-sampler": lambda ds: DataLoader(ds, batch_size=4, shuffle=True),
    "sequential-sampler": lambda ds: DataLoader(ds, batch_size=4),
    "user-batch-sampler": lambda ds: DataLoader(ds, batch_sampler=ShuffledChunks(len(ds))),
    "distributed-sampler": lambda ds: DataLoader(
        ds, batch_size=3, sampler=DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
    ),
    "drop-last": lambda ds: DataLoader(ds, batch_size=4, shuffle=True, drop_last=True),
    "two-workers": lambda ds: DataLoader(ds, batch_size=4, shuffle=True, num_workers=2),
    "persistent-workers": lambda ds: DataLoader(
        ds, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True
    ),
    "user-generator": lambda ds: DataLoader(
        ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(11)
    ),
}


def fetched(log: Path) -> list[int]:
    return [int(x) for x in log.read_text().split()] if log.exists() else []


def run(loader, *, stop_after: int | None = None) -> list[tuple[int, list[int], list[int]]]:
    """The loop a script runs: epochs from ``loader.epoch``; stop after ``stop_after`` batches."""
    seen = []
    for epoch in range(loader.epoch, EPOCHS):
        for batch in loader:
            seen.append((epoch, batch[:, 0].tolist(), batch[:, 1].tolist()))
            if len(seen) == stop_after:
                return seen
    return seen


def round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_run_stopped_mid_epoch_resumes_with_exactly_the_remaining_batches_and_fetches_none_twice(
    tmp_path, kind
):
    torch.manual_seed(0)
    full = run(cl.resumable(KINDS[kind](Augmented(tmp_path / "full.log"))))
    per_epoch = len(full) // EPOCHS
    assert per_epoch >= 4 and len(full) == EPOCHS * per_epoch
    stop = per_epoch + per_epoch // 2  # in the middle of epoch 1

    torch.manual_seed(0)
    first = cl.resumable(KINDS[kind](Augmented(tmp_path / "first.log")))
    before = run(first, stop_after=stop)
    saved = round_trip(first.state_dict())
    assert (saved["epoch"], saved["consumed"]) == (1, stop - per_epoch)

    torch.manual_seed(12345)  # another global seed: the position must not depend on it
    second = cl.resumable(KINDS[kind](Augmented(tmp_path / "second.log")))
    second.load_state_dict(saved)
    assert second.epoch == 1
    after = run(second)

    assert before + after == full  # sample ids, epochs and every augmentation draw
    remaining = [i for _, ids, _ in full[stop:] for i in ids]
    # The resumed process read exactly the samples it handed out: the skip read nothing.
    assert sorted(fetched(tmp_path / "second.log")) == sorted(remaining)
    if "workers" not in kind:  # workers prefetch ahead of a stop; in-process fetches are exact
        assert fetched(tmp_path / "first.log") + fetched(tmp_path / "second.log") == fetched(
            tmp_path / "full.log"
        )


def test_a_process_sigkilled_mid_epoch_resumes_through_the_manager_with_the_uninterrupted_batches(tmp_path):
    def launch(name: str, kill_at: int) -> tuple[int, list[str], list[int]]:
        logs = tmp_path / f"logs-{name}"
        logs.mkdir(exist_ok=True)
        ckpt = tmp_path / ("ckpt-base" if name == "base" else "ckpt")
        proc = subprocess.run([sys.executable, str(WORKER), str(ckpt), str(logs), str(kill_at)], timeout=120)
        batches = [line for f in sorted(logs.glob("batches-*")) for line in f.read_text().splitlines()]
        fetches = [int(x) for f in logs.glob("fetches-*") for x in f.read_text().split()]
        return proc.returncode, batches, fetches

    code, baseline, _ = launch("base", 0)
    assert code == 0 and len(baseline) == 15  # 3 epochs of 5 batches (24 samples, batch 5)
    code, killed, _ = launch("killed", 8)  # saves at 3, 6; killed after batch 8 (epoch 1, batch 3)
    assert code == -9
    code, resumed, fetches = launch("resumed", 0)
    assert code == 0
    assert resumed[0].startswith("7 1 ")  # resumed after the save of step 6, in epoch 1
    assert killed[:6] + resumed == baseline
    rest = [int(i) for line in baseline[6:] for i in line.split("[")[1].split("]")[0].split(",")]
    assert sorted(fetches) == sorted(rest)  # the resumed process fetched each remaining sample once


def test_a_save_after_the_epoch_ended_resumes_at_the_next_epoch(tmp_path):
    torch.manual_seed(0)
    full = run(cl.resumable(KINDS["random-sampler"](Augmented(tmp_path / "a.log"))))
    loader = cl.resumable(KINDS["random-sampler"](Augmented(tmp_path / "b.log")))
    first_epoch = list(loader)  # the pass runs to its end: the loop's scheduler step comes after
    assert loader.epoch == 1
    again = cl.resumable(KINDS["random-sampler"](Augmented(tmp_path / "c.log")))
    again.load_state_dict(round_trip(loader.state_dict()))
    assert again.epoch == 1 and len(first_epoch) == 6
    assert run(again) == full[6:]


def test_iterating_draws_nothing_from_the_global_generator_and_leaves_a_given_generator_alone(tmp_path):
    torch.manual_seed(0)
    given = torch.Generator().manual_seed(11)
    loader = cl.resumable(
        DataLoader(Augmented(tmp_path / "a.log"), batch_size=4, shuffle=True, generator=given)
    )
    state, mine = torch.get_rng_state(), given.get_state()
    passes = [list(loader) for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(given.get_state(), mine)
    assert loader.seed == 11  # the given generator's seed is where the passes derive from
    assert [b[:, 0].tolist() for b in passes[0]] != [b[:, 0].tolist() for b in passes[1]]


def test_the_seed_comes_from_torch_manual_seed_and_a_restore_uses_the_saved_one(tmp_path):
    torch.manual_seed(21)
    loader = cl.resumable(DataLoader(Augmented(tmp_path / "a.log"), batch_size=4, shuffle=True))
    assert loader.seed == 21
    torch.manual_seed(5)
    other = cl.resumable(DataLoader(Augmented(tmp_path / "b.log"), batch_size=4, shuffle=True))
    other.load_state_dict(loader.state_dict())
    assert other.seed == 21
    fixed = cl.resumable(DataLoader(Augmented(tmp_path / "c.log"), batch_size=4, shuffle=True), seed=5)
    with pytest.raises(StateMismatchError, match="the save's seed is 21, but seed=5 was given"):
        fixed.load_state_dict(loader.state_dict())


def test_the_loader_is_a_part_the_manager_saves_and_refuses_into_a_loader_of_another_length(tmp_path):
    torch.manual_seed(0)
    loader = cl.resumable(DataLoader(Augmented(tmp_path / "a.log"), batch_size=4, shuffle=True))
    run(loader, stop_after=3)
    mgr = cl.CheckpointManager(tmp_path / "run", keep_last=1, every_steps=1)
    mgr.save(3, {"loader": loader})
    other = cl.resumable(DataLoader(Augmented(tmp_path / "b.log"), batch_size=5, shuffle=True))
    with pytest.raises(StateMismatchError, match="had 6 batches per epoch, this one has 5"):
        mgr.restore_latest({"loader": other})
    same = cl.resumable(DataLoader(Augmented(tmp_path / "c.log"), batch_size=4, shuffle=True))
    assert mgr.restore_latest({"loader": same}).step == 3 and same.batches_consumed == 3
    mgr.close()


def test_resumable_adapts_the_loader_in_place_and_leaves_its_sampler_and_generator_alone(tmp_path):
    inner = DataLoader(Augmented(tmp_path / "a.log"), batch_size=4, shuffle=True)
    sampler, batch_sampler, dataset = inner.sampler, inner.batch_sampler, inner.dataset
    loader = cl.resumable(inner)
    assert loader is inner and isinstance(loader, DataLoader) and cl.resumable(loader) is loader
    list(loader)
    assert len(loader) == 6 and loader.dataset is dataset and loader.batch_size == 4 and loader.epoch == 1
    assert loader.sampler is sampler and loader.batch_sampler is batch_sampler and loader.generator is None
    with pytest.raises(CheckpointError, match="already derives from seed"):
        cl.resumable(loader, seed=loader.seed + 1)


class MyLoader(DataLoader):
    def describe(self) -> str:
        return "mine"


def test_a_dataloader_subclass_keeps_its_own_methods(tmp_path):
    loader = cl.resumable(MyLoader(Augmented(tmp_path / "a.log"), batch_size=4, shuffle=True), seed=3)
    assert isinstance(loader, MyLoader) and loader.describe() == "mine" and len(list(loader)) == 6


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(5)


def test_an_iterable_dataset_is_refused_with_what_resuming_it_would_need():
    with pytest.raises(
        CheckpointError, match="Stream is an IterableDataset: it has no indices to skip to"
    ) as e:
        cl.resumable(DataLoader(Stream(), batch_size=2))
    assert "state_dict()/load_state_dict()" in str(e.value) and "StatefulDataLoader" in str(e.value)


def test_a_stateful_dataloader_is_refused_by_resumable_and_still_saved_as_a_part(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def build():
        return StatefulDataLoader(
            list(range(12)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1)
        )

    with pytest.raises(CheckpointError, match="already saves its own position"):
        cl.resumable(build())
    loader = build()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    mgr = cl.CheckpointManager(tmp_path / "run", keep_last=1, every_steps=1)
    mgr.save(2, {"loader": loader})
    rest = [b.tolist() for b in it]
    fresh = build()
    assert mgr.restore_latest({"loader": fresh}).step == 2
    assert [b.tolist() for b in fresh] == rest and len(head + rest) == 6
    mgr.close()


def test_a_malformed_position_is_refused_before_anything_changes(tmp_path):
    loader = cl.resumable(DataLoader(Augmented(tmp_path / "a.log"), batch_size=4))
    with pytest.raises(StateMismatchError, match="malformed state"):
        loader.load_state_dict({"epoch": "1"})
    assert loader.epoch == 0 and loader.batches_consumed == 0


# -- the pieces of one reproducible pass: derived seeds, seeded fetches, tagged batches, the skip


def test_a_derived_seed_is_the_same_in_another_process_and_differs_per_part():
    code = "from ckpt_lesson.runs.data_position import derive_seed; print(derive_seed(7, 3, 'sampler'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(other.stdout) == derive_seed(7, 3, "sampler") < 2**63
    assert len({derive_seed(7, 3), derive_seed(7, 4), derive_seed(8, 3), derive_seed(7, 3, "sampler")}) == 4


def test_seeded_globals_draws_the_same_inside_and_puts_every_global_generator_back():
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    with seeded_globals(42):
        first = (torch.rand(2), random.random(), np.random.rand())
    with seeded_globals(42):
        again = (torch.rand(2), random.random(), np.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()


def test_a_tagged_batch_keeps_its_seed_through_pickling_to_a_worker():
    batch = TaggedBatch([3, 1, 2])
    batch.seed = 99
    copy = pickle.loads(pickle.dumps(batch))
    assert copy == [3, 1, 2] and copy.seed == 99


def test_a_seeded_fetch_draws_by_the_batch_seed_not_by_the_caller_generator():
    class Noisy:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return float(torch.rand(()))

    batch = TaggedBatch([0, 1])
    batch.seed = 5
    torch.manual_seed(0)
    a = SeededFetch(Noisy()).__getitems__(batch)
    torch.manual_seed(123)
    assert SeededFetch(Noisy()).__getitems__(batch) == a


def test_a_pass_started_at_batch_k_yields_the_full_pass_from_k_on_without_advancing_a_given_generator():
    given = torch.Generator().manual_seed(3)
    sampler = RandomSampler(range(10), generator=given)
    batches = BatchSampler(sampler, batch_size=3, drop_last=False)
    passes = PassBatches(batches, generator_owners=[sampler, batches], length=len(batches))
    passes.start(seed=1, epoch=2, skip=0)
    full = [list(b) for b in passes]
    passes.start(seed=1, epoch=2, skip=2)
    rest = list(passes)
    assert [list(b) for b in rest] == full[2:] and [b.seed for b in rest] == [
        derive_seed(1, 2, p) for p in (2, 3)
    ]
    assert torch.equal(given.get_state(), torch.Generator().manual_seed(3).get_state())
    assert sampler.generator is given
    passes.start(seed=1, epoch=3, skip=0)
    assert [list(b) for b in passes] != full  # another epoch, another order
