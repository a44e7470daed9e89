"""A writer process for the object-store tests: saves step 2, then SIGKILLs itself mid-upload of step 4.

Usage: python tests/_store_writer.py URL PARTS_BEFORE_KILL
Credentials and endpoint come from the environment (AWS_ENDPOINT_URL, ...), as on a real machine.
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import build_tiny_run  # noqa: E402

from ckpt_lesson.files.storage_fsspec import FsspecStorage  # noqa: E402
from ckpt_lesson.runs.manager import CheckpointManager  # noqa: E402


def main() -> None:
    url, parts_before_kill = sys.argv[1], int(sys.argv[2])
    run = build_tiny_run(seed=4)
    mgr = CheckpointManager(url, every_steps=2, num_shards=2, lease_seconds=3600)
    run.train(until_step=2)
    mgr.save(run.model, run.optimizer, run.scheduler, run.state)
    uploaded = []
    real_put = FsspecStorage.put_file

    def put_then_die(self, key, local, **kwargs):
        result = real_put(self, key, local, **kwargs)
        uploaded.append(key)
        if len(uploaded) >= parts_before_kill:
            os.kill(os.getpid(), signal.SIGKILL)  # the machine is gone, mid-upload
        return result

    FsspecStorage.put_file = put_then_die
    run.train(until_step=4)
    mgr.save(run.model, run.optimizer, run.scheduler, run.state)


if __name__ == "__main__":
    main()
