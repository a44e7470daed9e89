"""A training process that saves step 2, then dies by SIGKILL in the middle of saving step 4.

Usage: python tests/contract/_kill_child.py STORAGE FORM MODE RANKS TMP_DIR POINT [BUCKET ENDPOINT]

POINT is a stage of the save where the process kills itself: ``part_written`` or
``manifest_written`` (the manager's own ``on_event`` stages; on the writer thread in
async mode), or ``upload`` (a bucket: botocore's ``before-send`` of the manifest's
PUT, after every part is up). ``stall`` stops the whole process there instead
(SIGSTOP, with a 2 s lease; ``TMP_DIR/stalled`` tells the test), and once the test
continues it, exits 4 if the save was refused because its lease had expired.
The save goes through the same :class:`Harness` as the contract tests, so the
path is exactly the one under test.

With RANKS > 1 the same program runs on each rank of a gloo job, and the kill
takes the whole job (every rank's pid, as a scheduler does when a node dies):
at the first rank's ``file_written`` (the ranks' name for ``part_written``), or
at rank 0's manifest upload. The stall stops rank 0, which holds the lease. Each
rank that lives to the end writes its exit code to ``TMP_DIR/child-rank<N>.json``;
the launcher writes ``[exit codes, those codes]`` to ``TMP_DIR/child-job.json``.
"""

from __future__ import annotations

import json
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
    storage, form, mode, ranks, tmp, point = sys.argv[1:7]
    if int(ranks) == 1:
        sys.exit(run(sys.argv[1:], None))
    import _kill_child  # this file as a module, so its ranks can unpickle run_on_rank

    from ckpt_lesson.faults.rank_launch import launch

    codes = launch(_kill_child.run_on_rank, int(ranks), tmp, sys.argv[1:], limit=240.0)
    reports = [Path(tmp) / f"child-rank{r}.json" for r in range(int(ranks))]
    outcomes = [json.loads(p.read_text()) if p.exists() else None for p in reports]
    (Path(tmp) / "child-job.json").write_text(json.dumps([codes, outcomes]))


def run_on_rank(rank: int, world: int, argv: list[str]) -> None:
    """One rank of the child job (see the module's docstring)."""
    (Path(argv[4]) / f"pid-rank{rank}").write_text(str(os.getpid()))
    code = run(argv, rank)
    (Path(argv[4]) / f"child-rank{rank}.json").write_text(json.dumps(code))


def kill_the_job(tmp: str, rank: int | None) -> None:
    """SIGKILL every rank of the job (the others first), or this process alone."""
    if rank is not None:
        for pid_file in Path(tmp).glob("pid-rank*"):
            if int(pid_file.read_text()) != os.getpid():
                os.kill(int(pid_file.read_text()), signal.SIGKILL)  # a rank of our own job, by pid
    os.kill(os.getpid(), signal.SIGKILL)


def run(argv: list[str], rank: int | None) -> int:
    """Save step 2, then step 4 with the kill (or stall) armed; the exit code (see the docstring)."""
    storage, form, mode, ranks, tmp, point = argv[:6]
    bucket = Bucket(argv[6], argv[7], options_for(argv[7])) if storage == "bucket" else None
    h = Harness(SavePath(storage, form, mode, int(ranks)), Path(tmp), bucket, rank=rank)
    armed = False
    at = "file_written" if rank is not None and point == "part_written" else point

    def die(name: str, info: dict) -> None:
        if armed and name == at:
            kill_the_job(tmp, rank)

    lease = {"lease_seconds": 2.0} if point == "stall" else {}
    mgr = h.manager(keep_last=1, on_event=die, **lease)
    training = h.run()
    h.save(mgr, training, 2)
    if point in ("upload", "stall") and rank in (None, 0):

        def before_send(request, **_):
            if "/step-00000004/" in request.url and request.url.endswith("/manifest.json"):
                if point == "upload":
                    kill_the_job(tmp, rank)
                (Path(tmp) / "stalled").write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)  # every thread, the lease renewer's too

        storage = mgr.storage if rank is None else mgr.mgr.saves.storage
        storage.fs.s3.meta.events.register("before-send.s3.PutObject", before_send)
    armed = True
    try:
        h.save(mgr, training, 4)
    except CheckpointError as exc:
        print(exc, file=sys.stderr)
        return 4 if "LEASE of this save expired" in str(exc) else 5
    finally:
        if rank is not None:
            mgr.close()
    return 3  # never reached: the kill point was not on this path


if __name__ == "__main__":
    main()
