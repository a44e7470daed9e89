"""The pieces of one reproducible pass: derived seeds, seeded fetches, tagged batches, the skip."""

from __future__ import annotations

import pickle
import random
import subprocess
import sys

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler

from ckpt_lesson.runs.data_passes import PassBatches, SeededFetch, TaggedBatch, derive_seed, seeded_globals


def test_a_derived_seed_is_the_same_in_another_process_and_differs_per_part():
    code = "from ckpt_lesson.runs.data_passes import derive_seed; print(derive_seed(7, 3, 'sampler'))"
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
