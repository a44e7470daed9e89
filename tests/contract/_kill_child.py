"""A training process that saves step 2, then dies by SIGKILL in the middle of saving step 4.

Usage: python tests/contract/_kill_child.py STORAGE FORM MODE TMP_DIR POINT [BUCKET ENDPOINT]

POINT is a stage of the save where the process kills itself: ``part_written`` or
``manifest_written`` (the manager's own ``on_event`` stages; on the writer thread in
async mode), or ``upload`` (a bucket: botocore's ``before-send`` of the manifest's
PUT, after every part is up). ``stall`` stops the whole process there instead
(SIGSTOP, with a 2 s lease; ``TMP_DIR/stalled`` tells the test), and once the test
continues it, exits 4 if the save was refused because its lease had expired.
The save goes through the same :class:`Harness` as the contract tests, so the
path is exactly the one under test.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from _paths import Harness, SavePath  # noqa: E402
from _s3_server import Bucket, options_for  # noqa: E402

from ckpt_lesson.errors import CheckpointError  # noqa: E402


def main() -> None:
    storage, form, mode, tmp, point = sys.argv[1:6]
    bucket = Bucket(sys.argv[6], sys.argv[7], options_for(sys.argv[7])) if storage == "bucket" else None
    h = Harness(SavePath(storage, form, mode), Path(tmp), bucket)
    armed = False

    def die(name: str, info: dict) -> None:
        if armed and name == point:
            os.kill(os.getpid(), signal.SIGKILL)

    lease = {"lease_seconds": 2.0} if point == "stall" else {}
    mgr = h.manager(keep_last=1, on_event=die, **lease)
    run = h.run()
    h.save(mgr, run, 2)
    if point in ("upload", "stall"):

        def before_send(request, **_):
            if "/step-00000004/" in request.url and request.url.endswith("/manifest.json"):
                if point == "upload":
                    os.kill(os.getpid(), signal.SIGKILL)
                (Path(tmp) / "stalled").touch()
                os.kill(os.getpid(), signal.SIGSTOP)  # every thread, the lease renewer's too

        mgr.storage.fs.s3.meta.events.register("before-send.s3.PutObject", before_send)
    armed = True
    try:
        h.save(mgr, run, 4)
    except CheckpointError as exc:
        print(exc, file=sys.stderr)
        sys.exit(4 if "LEASE of this save expired" in str(exc) else 5)
    sys.exit(3)  # never reached: the kill point was not on this path


if __name__ == "__main__":
    main()
