"""A loop over ``cl.resumable(DataLoader(...))`` that can SIGKILL itself after a given batch.

Run by tests/test_data_position.py: ``python _data_position_worker.py CKPT_DIR LOG_DIR KILL_AT``
(``KILL_AT`` 0: no kill). Every batch handed to the loop appends ``step epoch ids augs`` to
``LOG_DIR/batches-<pid>.txt``; every dataset fetch appends its index to ``LOG_DIR/fetches-<pid>.txt``
(from the loader's worker processes too).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import ckpt_lesson as cl


class Augmented(Dataset):
    """24 samples; each fetch draws a random "augmentation" and is logged by index."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        with open(self.log, "a") as f:  # O_APPEND: one line per fetch, whichever process
            f.write(f"{index}\n")
        return torch.tensor([index, int(torch.randint(1000, ()))])


def main() -> int:
    ckpt_dir, log_dir, kill_at = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # a fresh global seed each process
    dataset = Augmented(log_dir / f"fetches-{os.getpid()}.txt")
    loader = cl.resumable(DataLoader(dataset, batch_size=5, shuffle=True, num_workers=2), seed=7)
    mgr = cl.CheckpointManager(ckpt_dir, keep_last=2, every_steps=3)
    state = {"loader": loader}
    restored = mgr.restore_latest(state)
    step = restored.step if restored else 0
    with open(log_dir / f"batches-{os.getpid()}.txt", "a") as log:
        for epoch in range(loader.epoch, 3):
            for batch in loader:
                step += 1
                log.write(f"{step} {epoch} {batch[:, 0].tolist()} {batch[:, 1].tolist()}\n")
                log.flush()
                if mgr.should_save(step):
                    mgr.save(step, state)
                if step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
