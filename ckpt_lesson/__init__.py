"""ckpt_lesson: crash-safe checkpoint save and resume for PyTorch training.

Public names live here; the modules behind them are small and private in
spirit (import from ``ckpt_lesson``, not from its modules).
"""

from __future__ import annotations

from ._version_check import check_torch_version

check_torch_version()

from .cli import main as run_command  # noqa: E402  (one `python -m ckpt_lesson` command, in-process)
from .cli.lesson_demo import main, parse_args  # noqa: E402, F401 (course harness: COURSE_NAMES)
from .cli.scan import format_table as format_scan_table  # noqa: E402
from .course.accumulating import MicroStepRecord, train_accumulating  # noqa: E402, F401 (course harness: COURSE_NAMES)
from .course.controls import run_negative_control  # noqa: E402, F401 (course harness: COURSE_NAMES)
from .course.demo import run_full_demo, run_resume_demo  # noqa: E402, F401 (course harness: COURSE_NAMES)
from .course.demo_artifacts import write_demo_artifacts  # noqa: E402, F401 (course harness: COURSE_NAMES)
from .course.exercises import (  # noqa: E402, F401 (course harness: COURSE_NAMES)
    GradeResult,
    check_cadence,
    check_keep_k,
    check_migration,
    check_verify_part,
)
from .course.lesson_loop import step_one, synthetic_loader, train_until  # noqa: E402, F401 (course harness: COURSE_NAMES)
from .course.managed import run_managed_training  # noqa: E402, F401 (course harness: COURSE_NAMES)
from .course.preemptible import train_until_preempted  # noqa: E402, F401 (course harness: COURSE_NAMES)
from .course.skill import render_skill_markdown, write_skill_markdown  # noqa: E402, F401 (course harness: COURSE_NAMES)
from .course.training import (  # noqa: E402, F401 (course harness: COURSE_NAMES)
    SyntheticRegression,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
    train,
)
from .errors import (  # noqa: E402
    CheckpointError,
    ContractMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LoadEnvironmentError,
    SchemaError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from .faults.campaign import CampaignResult, run_campaign  # noqa: E402
from .faults.harness import KillPlan, RunConfig, compute_baseline, run_kill_sequence  # noqa: E402
from .files.apply import Restored  # noqa: E402
from .files.atomic import atomic_save, atomic_write_json, fsync_dir  # noqa: E402
from .files.checkpoint import (  # noqa: E402
    BUCKETS,
    TrainState,
    load_checkpoint,
    load_state,
    read_checkpoint,
    save_checkpoint,
    save_state,
)
from .files.integrity import FileDigest, file_digest, file_sha256  # noqa: E402
from .files.migrate import MigrationResult, migrate_file, write_legacy_v1_checkpoint  # noqa: E402
from .files.record_seal import seal_record  # noqa: E402
from .files.rng import capture_rng_state, restore_rng_state, tuple_from_nested  # noqa: E402
from .files.schema import (  # noqa: E402
    CHECKPOINT_SCHEMA,
    CURRENT_SCHEMA,
    SCHEMA_V1,
    SCHEMA_V2,
    migrate_v1_to_v2,
)
from .files.shard_index import read_shard_index, verify_sharded_checkpoint  # noqa: E402
from .files.shard_plan import plan_shards, shard_keys_by_prefix  # noqa: E402
from .files.sharded import (  # noqa: E402
    SHARD_SCHEMA,
    ShardedSaveResult,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from .files.storage import open_storage  # noqa: E402
from .files.verify import verify_part  # noqa: E402
from .runs.accumulation import AccumulationState, load_accumulating, save_accumulating  # noqa: E402
from .runs.async_save import AsyncCheckpointer, TrainingSnapshot  # noqa: E402
from .runs.contract import (  # noqa: E402
    ResumeReport,
    check_contract,
    config_fingerprint,
    contract_metadata,
    current_contract,
    model_fingerprint,
    resume_report,
)
from .runs.cost import (  # noqa: E402
    SaveCadence,
    SpotComparison,
    compare_spot,
    cost_per_accepted_step,
    daly_interval,
    expected_wall_time,
    should_save,
    young_interval,
)
from .runs.data_position import ResumableLoader, resumable  # noqa: E402
from .runs.folder_manifest import latest_verified_folder, verify_folder, write_folder_manifest  # noqa: E402
from .runs.layout import ScanResult, read_manifest  # noqa: E402
from .runs.manager import CheckpointManager, StoreCheckpointManager  # noqa: E402
from .runs.manager_config import ManagerConfig  # noqa: E402
from .runs.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler  # noqa: E402
from .runs.report import RecoveryRecorder, read_recovery_log, summarize_recoveries  # noqa: E402
from .runs.retention import KeepBest, KeepLastK, keep_last_k  # noqa: E402
from .runs.scan import scan_checkpoints  # noqa: E402
from .runs.steplog import log_step  # noqa: E402
from .runs.store_commit import CommitConflictError  # noqa: E402
from .runs.warm_start import WarmStartRecord, warm_start_from  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AccumulationState",
    "AsyncCheckpointer",
    "BUCKETS",
    "CHECKPOINT_SCHEMA",
    "COURSE_NAMES",
    "CURRENT_SCHEMA",
    "CampaignResult",
    "CheckpointError",
    "CheckpointManager",
    "CommitConflictError",
    "ContractMismatchError",
    "CorruptCheckpointError",
    "DistributedCheckpointManager",
    "DistributedRestore",
    "FileDigest",
    "IncompleteCheckpointError",
    "KeepBest",
    "KeepLastK",
    "KillPlan",
    "LoadEnvironmentError",
    "ManagerConfig",
    "MigrationResult",
    "PREEMPTED_EXIT_CODE",
    "PreemptionHandler",
    "RecoveryRecorder",
    "Restored",
    "ResumableLoader",
    "ResumeReport",
    "RunConfig",
    "SCHEMA_V1",
    "SCHEMA_V2",
    "SHARD_SCHEMA",
    "SaveCadence",
    "ScanResult",
    "SchemaError",
    "ShardedSaveResult",
    "SpotComparison",
    "StateMismatchError",
    "StoreCheckpointManager",
    "TrainState",
    "TrainingSnapshot",
    "UnsafeCheckpointError",
    "WarmStartRecord",
    "__version__",
    "atomic_save",
    "atomic_write_json",
    "capture_rng_state",
    "check_contract",
    "check_torch_version",
    "compare_spot",
    "compute_baseline",
    "config_fingerprint",
    "contract_metadata",
    "cost_per_accepted_step",
    "current_contract",
    "daly_interval",
    "expected_wall_time",
    "file_digest",
    "file_sha256",
    "format_scan_table",
    "fsync_dir",
    "keep_last_k",
    "latest_verified_folder",
    "load_accumulating",
    "load_checkpoint",
    "load_sharded_checkpoint",
    "load_state",
    "log_step",
    "migrate_file",
    "migrate_v1_to_v2",
    "model_fingerprint",
    "open_storage",
    "plan_shards",
    "read_checkpoint",
    "read_manifest",
    "read_recovery_log",
    "read_shard_index",
    "restore_rng_state",
    "resumable",
    "resume_report",
    "run_campaign",
    "run_command",
    "run_kill_sequence",
    "save_accumulating",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "save_state",
    "scan_checkpoints",
    "seal_record",
    "shard_keys_by_prefix",
    "should_save",
    "summarize_recoveries",
    "tuple_from_nested",
    "verify_folder",
    "verify_part",
    "verify_sharded_checkpoint",
    "warm_start_from",
    "write_folder_manifest",
    "write_legacy_v1_checkpoint",
    "young_interval",
]

#: The course harness (toy model and loop, demos, exercise graders): importable from here for the
#: lesson's code and the notebooks, but not part of the library's listing above.
COURSE_NAMES = (
    "GradeResult",
    "MicroStepRecord",
    "SyntheticRegression",
    "check_cadence",
    "check_keep_k",
    "check_migration",
    "check_verify_part",
    "main",
    "make_model",
    "make_optimizer_and_scheduler",
    "parse_args",
    "render_skill_markdown",
    "run_full_demo",
    "run_managed_training",
    "run_negative_control",
    "run_resume_demo",
    "seed_everything",
    "step_one",
    "synthetic_loader",
    "train",
    "train_accumulating",
    "train_until",
    "train_until_preempted",
    "write_demo_artifacts",
    "write_skill_markdown",
)


#: Served on first use, not at import: ``ckpt_lesson.distributed`` pulls in
#: ``torch.distributed.checkpoint`` (about 0.8 s here), which single-process users never need.
_LAZY = {
    "DistributedCheckpointManager": "ckpt_lesson.distributed",
    "DistributedRestore": "ckpt_lesson.distributed",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_lesson' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
