"""``python -m ckpt_lesson chaos``: arguments for a fault-injection campaign.

The campaign itself lives in :mod:`ckpt_lesson.faults.campaign` (single-process
runs) and :mod:`ckpt_lesson.faults.rank_chaos` (ranks of a multi-rank DCP save);
this module checks the flags, calls one of them and prints its table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.faults.campaign import MAX_RANKS, run_campaign
from ckpt_lesson.files.storage import is_store_url, open_storage


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kills",
        type=int,
        default=None,
        help="kills to make (default 20; with --ranks, 10: one per named kill)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="1 (default): kill single-process runs; 2 to 8: kill ranks of a multi-rank DCP save instead",
    )
    parser.add_argument(
        "--publish",
        choices=("rename", "marker"),
        default=None,
        help="with --ranks: how saves are published (default rename; marker: a commit marker written last; "
        "with --store always marker)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds points, steps and offsets (default 0)")
    parser.add_argument("--workdir", default=None, help="folder for run directories (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("--random-only", action="store_true", help="skip the named-point kills")
    parser.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="save every run to this bucket prefix (s3://BUCKET/PREFIX; credentials and endpoint from the "
        "AWS_* environment) and kill at the object store's points: mid-upload, before and after the "
        "commit marker, during retention; with --ranks N, kill ranks of multi-rank saves to the bucket "
        "(mid-write, before the manifest, before and after the conditional COMMIT marker)",
    )


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.ranks <= MAX_RANKS:
        raise CheckpointError(f"--ranks must be 1 (single process) to {MAX_RANKS}, got {args.ranks}.")
    if args.publish is not None and args.ranks == 1:
        raise CheckpointError("--publish applies to multi-rank saves only; add --ranks 2 (or more).")
    if args.kills is not None and args.kills < 1:
        raise CheckpointError(f"--kills must be >= 1, got {args.kills}.")
    if args.workdir is not None and Path(args.workdir).exists() and not Path(args.workdir).is_dir():
        raise CheckpointError(f"--workdir {args.workdir}: is a file, not a folder; pick another --workdir.")
    if args.store is not None:
        if args.publish == "rename":
            raise CheckpointError(
                "--store with --publish rename: a bucket has no atomic rename, so multi-rank saves to it are "
                "published by their COMMIT marker; drop --publish (or --store)."
            )
        check_store(args.store)
    publish = args.publish or ("marker" if args.store else "rename")
    started = time.perf_counter()
    if args.ranks > 1:
        from ckpt_lesson.faults.rank_chaos import NAMED_KILLS, draw_kills, run_rank_campaign

        count = len(NAMED_KILLS) if args.kills is None else args.kills
        kills = draw_kills(
            count, world=args.ranks, seed=args.seed, named=not args.random_only, publish=publish
        )
        result: Any = run_rank_campaign(
            kills, world=args.ranks, seed=args.seed, workdir=args.workdir, keep=args.keep, store=args.store
        )
    else:
        kills_made = 20 if args.kills is None else args.kills
        result = run_campaign(
            kills_made,
            seed=args.seed,
            workdir=args.workdir,
            named_points=not args.random_only,
            keep=args.keep,
            store=args.store,
        )
    print(result.table())
    print(f"{'wall time':<24}{time.perf_counter() - started:.1f} s")
    return 0 if result.ok else 1


def check_store(url: str) -> None:
    """Refuse a ``--store`` that is not a reachable bucket with conditional writes, naming the flag.

    Raises:
        CheckpointError: Not a URL, the client is not installed (``pip install
            ckpt_lesson[s3]``), the bucket cannot be reached or lacks conditional writes.
    """
    if not is_store_url(url):
        raise CheckpointError(
            f"--store {url}: not a bucket URL; write it as s3://BUCKET/PREFIX (a local folder is --workdir)."
        )
    try:
        storage = open_storage(url)
        storage.list_keys()  # reachable, bucket exists, credentials accepted
        storage.check_conditional_writes()
    except CheckpointError as exc:
        raise type(exc)(f"--store: {exc}") from None
