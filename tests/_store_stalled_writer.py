"""A writer process that freezes (SIGSTOP, every thread at once) right before its manifest goes up.

Usage: python tests/_store_stalled_writer.py URL OUT LEASE_SECONDS

It commits step 2, then saves step 4 with ``keep_last=1``. When s3fs is about to
send the PUT of step 4's ``manifest.json`` (every part is up by then), a handler on
botocore's own ``before-send`` event writes ``OUT/stalled`` and stops the whole
process, as a paused VM or a swapped-out machine stops: its lease renewals stop
too. The test continues it with SIGCONT; the outcome of ``save()`` goes to
``OUT/result.json``. Endpoint and credentials come from the environment.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import build_tiny_run  # noqa: E402

from ckpt_lesson.errors import CheckpointError  # noqa: E402
from ckpt_lesson.runs.manager import CheckpointManager  # noqa: E402


def main() -> None:
    url, out, lease = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    run = build_tiny_run(seed=4)
    mgr = CheckpointManager(url, keep_last=1, every_steps=2, num_shards=2, lease_seconds=lease)
    run.train(until_step=2)
    mgr.save(run.model, run.optimizer, run.scheduler, run.state)

    def stall(request, **_):
        if "/step-00000004/" in request.url and request.url.endswith("/manifest.json"):
            (out / "stalled").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)  # continues here after the test's SIGCONT

    mgr.storage.fs.s3.meta.events.register("before-send.s3.PutObject", stall)
    run.train(until_step=4)
    try:
        mgr.save(run.model, run.optimizer, run.scheduler, run.state)
        result = {"error": None, "message": ""}
    except CheckpointError as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
