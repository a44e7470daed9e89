"""A writer process for the object-store tests: saves step 2, then SIGKILLs itself while saving step 4.

Usage: python tests/_store_writer.py URL POINT
POINT: ``part:N`` (after N parts are up), ``manifest`` (manifest up, before the marker) or
``commit`` (right after the marker was created, before the lease is removed).
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


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # the machine is gone


def main() -> None:
    url, point = sys.argv[1], sys.argv[2]
    run = build_tiny_run(seed=4)
    mgr = CheckpointManager(url, every_steps=2, num_shards=2, lease_seconds=3600)
    run.train(until_step=2)
    mgr.save(run.model, run.optimizer, run.scheduler, run.state)
    real_put, real_create, parts = FsspecStorage.put_file, FsspecStorage.create_if_absent, []

    def put_then_die(self, key, local, **kwargs):
        result = real_put(self, key, local, **kwargs)
        parts.append(key)
        if point == f"part:{len(parts)}":
            die()
        return result

    def create_around_death(self, key, data):
        if point == "manifest" and key.endswith("/COMMIT"):
            die()
        created = real_create(self, key, data)
        if point == "commit" and key.endswith("/COMMIT"):
            die()
        return created

    FsspecStorage.put_file = put_then_die
    FsspecStorage.create_if_absent = create_around_death
    run.train(until_step=4)
    mgr.save(run.model, run.optimizer, run.scheduler, run.state)


if __name__ == "__main__":
    main()
