"""ckpt_lesson: crash-safe checkpoint save and resume for PyTorch training.

Public names live here; the modules behind them are small and private in
spirit (import from ``ckpt_lesson``, not from its modules).
"""

from __future__ import annotations

from ._version_check import check_torch_version

check_torch_version()

from .atomic import atomic_save, atomic_write_json, fsync_dir  # noqa: E402
from .checkpoint import BUCKETS, TrainState, load_checkpoint, read_checkpoint, save_checkpoint  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointError,
    ContractMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    SchemaError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from .integrity import FileDigest, file_digest  # noqa: E402
from .rng import capture_rng_state, restore_rng_state  # noqa: E402
from .schema import CURRENT_SCHEMA, SCHEMA_V1, SCHEMA_V2, migrate_v1_to_v2  # noqa: E402
# Feature modules: one import line per module, kept in alphabetical order of module.
from .cadence import SaveCadence, should_save  # noqa: E402
from .demo import run_full_demo, run_negative_control, run_resume_demo  # noqa: E402
from .demo_artifacts import write_demo_artifacts  # noqa: E402
from .exercises import (  # noqa: E402
    GradeResult,
    check_cadence,
    check_keep_k,
    check_migration,
    check_verify_part,
)
from .manager import CheckpointManager, ManagerConfig  # noqa: E402
from .migrate import MigrationResult, migrate_file, write_legacy_v1_checkpoint  # noqa: E402
from .retention import KeepBest, KeepLastK, keep_last_k  # noqa: E402
from .scan import ScanResult, read_manifest, scan_checkpoints, verify_part  # noqa: E402
from .sharded import (  # noqa: E402
    ShardedSaveResult,
    load_sharded_checkpoint,
    plan_shards,
    read_shard_index,
    save_sharded_checkpoint,
    shard_keys_by_prefix,
    verify_sharded_checkpoint,
)
from .skill import render_skill_markdown, write_skill_markdown  # noqa: E402
from .train_cmd import run_managed_training  # noqa: E402
from .training import (  # noqa: E402
    SyntheticRegression,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
    train,
)

__version__ = "0.1.0"

__all__ = [
    "BUCKETS",
    "CURRENT_SCHEMA",
    "CheckpointError",
    "CheckpointManager",
    "ContractMismatchError",
    "CorruptCheckpointError",
    "FileDigest",
    "GradeResult",
    "IncompleteCheckpointError",
    "KeepBest",
    "KeepLastK",
    "ManagerConfig",
    "MigrationResult",
    "SCHEMA_V1",
    "SCHEMA_V2",
    "SaveCadence",
    "ScanResult",
    "SchemaError",
    "ShardedSaveResult",
    "StateMismatchError",
    "SyntheticRegression",
    "TrainState",
    "UnsafeCheckpointError",
    "__version__",
    "atomic_save",
    "atomic_write_json",
    "capture_rng_state",
    "check_cadence",
    "check_keep_k",
    "check_migration",
    "check_torch_version",
    "check_verify_part",
    "file_digest",
    "fsync_dir",
    "keep_last_k",
    "load_checkpoint",
    "load_sharded_checkpoint",
    "make_model",
    "make_optimizer_and_scheduler",
    "migrate_file",
    "migrate_v1_to_v2",
    "plan_shards",
    "read_checkpoint",
    "read_manifest",
    "read_shard_index",
    "render_skill_markdown",
    "restore_rng_state",
    "run_full_demo",
    "run_managed_training",
    "run_negative_control",
    "run_resume_demo",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "scan_checkpoints",
    "seed_everything",
    "shard_keys_by_prefix",
    "should_save",
    "train",
    "verify_part",
    "verify_sharded_checkpoint",
    "write_demo_artifacts",
    "write_legacy_v1_checkpoint",
    "write_skill_markdown",
]
