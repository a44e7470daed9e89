"""``python -m ckpt_lesson migrate PATH``: rewrite an old checkpoint file in the current schema."""

from __future__ import annotations

import argparse

from ckpt_lesson.files.migrate import DEFAULT_BACKUP_SUFFIX, migrate_file
from ckpt_lesson.files.storage import is_store_url
from ckpt_lesson.files.store_migrate import migrate_store_object


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``migrate`` command's arguments."""
    parser.description = (
        "Rewrite an old checkpoint file in the current schema, adding its integrity footer. "
        "The original bytes are kept as PATH + SUFFIX; a file already current is left alone. "
        "In a bucket the backup object is written (If-None-Match) and read back before the "
        "object is replaced (If-Match on the ETag read first)."
    )
    parser.add_argument(
        "path",
        metavar="PATH",
        help="checkpoint file to migrate (e.g. runs/old/last.pt), or an object in a bucket "
        "(s3://BUCKET/PREFIX/last.pt; credentials and endpoint from the AWS_* environment)",
    )
    parser.add_argument(
        "--backup-suffix",
        default=DEFAULT_BACKUP_SUFFIX,
        metavar="S",
        help=f"suffix for the backup of the original file (default: {DEFAULT_BACKUP_SUFFIX})",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``migrate``; returns 0 (migrated or already current). Errors raise CheckpointError."""
    migrate = migrate_store_object if is_store_url(args.path) else migrate_file
    result = migrate(args.path, backup_suffix=args.backup_suffix)
    if result.changed:
        print(
            f"migrated {result.path}: {result.from_schema} -> {result.to_schema}, "
            f"integrity footer added; original kept as {result.backup}"
        )
    else:
        print(f"already current: {result.path} is {result.to_schema}; nothing changed")
    return 0
