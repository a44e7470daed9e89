"""The course's graded exercises, one :class:`Exercise` object each.

A notebook imports the one it needs and uses it Kaggle-style::

    from ckpt_lesson.course.exercises import keep_k
    keep_k.check(keep_last_k)   # PASS / FAIL with the first failing case / NOT ATTEMPTED
    keep_k.hint()               # one more hint per call; keep_k.hint(2) for a chosen one
    keep_k.solution()           # the reference solution's source

:data:`EXERCISES` lists them all by name (the tests grade every reference
solution and known wrong answers through it). The graders themselves live in
:mod:`ckpt_lesson.course.graders_lessons`, ``graders_rng``, ``graders_disk``
and ``graders_index`` (01-05), ``graders_runs`` (06-07) and ``graders_files`` (08-09); the ``check_*``
names are re-exported here, one import for a notebook.
"""

from __future__ import annotations

from ckpt_lesson.course import solutions
from ckpt_lesson.course.exercise import Exercise
from ckpt_lesson.course.graders_disk import check_atomic_save, check_round_trip
from ckpt_lesson.course.graders_files import check_migration, check_verify_part
from ckpt_lesson.course.graders_index import check_write_shards
from ckpt_lesson.course.graders_lessons import check_next_batch, check_plan_param_group
from ckpt_lesson.course.graders_rng import check_rng
from ckpt_lesson.course.graders_runs import check_cadence, check_keep_k
from ckpt_lesson.course.grading import GradeResult

__all__ = [
    "EXERCISES",
    "Exercise",
    "GradeResult",
    "atomic",
    "batch_position",
    "cadence",
    "check_atomic_save",
    "check_cadence",
    "check_keep_k",
    "check_migration",
    "check_next_batch",
    "check_plan_param_group",
    "check_rng",
    "check_round_trip",
    "check_verify_part",
    "check_write_shards",
    "checksum",
    "keep_k",
    "migration",
    "param_group",
    "rng_capture",
    "round_trip",
    "shard_index",
]

# ---------------------------------------------------------------- the lessons' build-it-yourself exercises

rng_capture = Exercise(
    name="rng_capture",
    grader=check_rng,
    hints=(
        "Four generators: Python's `random`, NumPy's legacy global one (`np.random`), torch's CPU "
        "generator, and one per CUDA device (`torch.cuda.get_rng_state_all()`, an empty list without GPU).",
        "`random.getstate()` and `torch.get_rng_state()` survive a weights-only load as they are. "
        "`np.random.get_state()` is a tuple (name, keys, pos, has_gauss, cached_gaussian) whose `keys` is an "
        "ndarray: store `keys.tolist()`.",
        "Keep all five parts of NumPy's state: `np.random.normal()` draws Gaussians in pairs and returns the "
        "second one from the cache (has_gauss, cached_gaussian). Python's state carries its cached "
        "Gaussian too.",
        "To restore, turn the list back into `np.array(keys, dtype=np.uint32)` and call "
        "`np.random.set_state`; "
        "`random.setstate` wants a tuple `(version, tuple(internal), gauss_next)`. Never change the "
        "snapshot.",
    ),
    reference=(solutions.capture_rng_state, solutions.restore_rng_state),
    package=("ckpt_lesson.files.rng:capture_rng_state", "ckpt_lesson.files.rng:restore_rng_state"),
)

atomic = Exercise(
    name="atomic",
    grader=check_atomic_save,
    hints=(
        "Never open the target for writing: write a temp file in the *same directory*, then "
        "`os.replace(temp, target)`, which is atomic.",
        "Name the temp file uniquely, e.g. `f'.{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}'`: two "
        "writers never share it, and the leading dot keeps it out of '*.pt' globs.",
        "Inside `with open(tmp, 'wb') as f:` call `torch.save(payload, f)`, `f.flush()`, "
        "`os.fsync(f.fileno())`. "
        "After the replace, fsync the directory: `fd = os.open(path.parent, os.O_RDONLY)`, `os.fsync(fd)`, "
        "`os.close(fd)`.",
        "Wrap the write and the replace in `try: ... except BaseException: tmp.unlink(missing_ok=True); "
        "raise`, "
        "so a failed save leaves no temp file and the caller still sees the error.",
    ),
    reference=solutions.atomic_save,
    package=("ckpt_lesson.files.atomic:atomic_save", "ckpt_lesson.files.atomic:_atomic_write"),
)

round_trip = Exercise(
    name="round_trip",
    grader=check_round_trip,
    hints=(
        "Save one dict: `schema` ('lesson.v1') plus the five buckets: `model.state_dict()`, "
        "`optimizer.state_dict()`, `scheduler.state_dict()`, the TrainState's fields as a plain dict, and "
        "`capture_rng_state()`. Write it with an atomic save.",
        "Load with `torch.load(path, map_location='cpu', weights_only=True)` inside `try`, and turn any "
        "failure into `raise ValueError(...) from exc`: a cut-short file is 'damaged', not a crash.",
        "Check the schema and that all five buckets are there, and raise `ValueError` naming the file and "
        "what "
        "is missing, before you call any `load_state_dict`.",
        "Apply in one go at the end: model, optimizer, scheduler, then `restore_rng_state`; return "
        "`TrainState(**payload['state'])`.",
    ),
    reference=(solutions.save_checkpoint, solutions.load_checkpoint),
    package=("ckpt_lesson.files.checkpoint:save_checkpoint", "ckpt_lesson.files.checkpoint:load_checkpoint"),
)

shard_index = Exercise(
    name="shard_index",
    grader=check_write_shards,
    hints=(
        "Two phases: first every shard file, then index.json. The index is the commit: it may only appear "
        "once every file it names is complete and on disk.",
        "Serialize a shard to bytes first (`buffer = io.BytesIO()`, `torch.save(tensors, buffer)`, "
        "`data = buffer.getvalue()`), then write `data` and record `len(data)` and "
        "`hashlib.sha256(data).hexdigest()`: you hash exactly the bytes you wrote, with no second read.",
        "Make each shard durable before the index names it: `f.flush()` then `os.fsync(f.fileno())` inside "
        "the `with open(path, 'wb') as f:` block.",
        "Write the index as notebook 02 writes a checkpoint: `json.dump({'shards': entries}, f)` into a temp "
        "file in the same directory, flush and fsync it, `os.replace(tmp, directory / 'index.json')`, then "
        "fsync the directory (`fd = os.open(directory, os.O_RDONLY)`, `os.fsync(fd)`, `os.close(fd)`).",
        "Let errors reach the caller: when a shard cannot be written, the function must stop before the "
        "index, so the directory reads as an unfinished save.",
    ),
    reference=solutions.write_shards,
    package=("ckpt_lesson.course.shard_files:write_shards", "ckpt_lesson.files.atomic:_atomic_write"),
)

param_group = Exercise(
    name="param_group",
    grader=check_plan_param_group,
    hints=(
        "Split the keys into two groups: those ending in 'weight' and all the others (biases, norm "
        "buffers). With fewer than 2 shards there is no room for both: raise ValueError.",
        "Weights get the first `(num_shards + 1) // 2` shards, the others the rest.",
        "Balance each group by bytes (`t.numel() * t.element_size()`): take the tensors largest first and "
        "put "
        "each one into the shard that is currently lightest.",
        "Return one list per shard, `num_shards` lists in all (some may be empty); every key exactly once.",
    ),
    reference=solutions.plan_param_group,
    package=("ckpt_lesson.files.shard_plan:plan_shards", "ckpt_lesson.files.shard_plan:_balance"),
)

batch_position = Exercise(
    name="batch_position",
    grader=check_next_batch,
    hints=(
        "An epoch has `len(data) // batch_size` batches (the last partial batch is dropped). If "
        "`state.batch_in_epoch` has reached that, the epoch is used up: move to the next epoch, batch 0.",
        "The order of epoch e is `torch.randperm(len(data), generator=g)` with "
        "`g = torch.Generator().manual_seed(seed * 1_000_003 + e)`: a private generator, so the global one "
        "(restored on resume) is never touched.",
        "The batch is a slice of that order: `order[b * batch_size:(b + 1) * batch_size]`, as a list.",
        "Only roll the epoch over; do not advance `batch_in_epoch` yourself (the training loop counts "
        "batches after each step). Never loop over earlier batches or epochs.",
    ),
    reference=solutions.next_batch_ids,
    package=(
        "ckpt_lesson.course.training:next_batch_ids",
        "ckpt_lesson.course.training:batch_sample_ids",
        "ckpt_lesson.course.training:epoch_order",
    ),
)

keep_k = Exercise(
    name="keep_k",
    grader=check_keep_k,
    hints=(
        "Sort first: `steps` comes in any order, like a directory listing. Sort the numbers, not their "
        "string forms ('1000' sorts before '200').",
        "List the verified steps in ascending order. If there are fewer than k of them, delete nothing.",
        "The oldest step you keep is the k-th newest verified one: `good[-k]`. Every step older than it "
        "goes, verified or not; everything from it on stays, even a damaged step newer than it.",
        "Build a new list (`sorted(steps)` already returns one) instead of sorting `steps` in place; "
        "return the steps to delete in ascending order.",
    ),
    reference=solutions.keep_last_k,
)

cadence = Exercise(
    name="cadence",
    grader=check_cadence,
    hints=(
        "Start with the two cases that are never a save: step 0 (nothing to protect) and "
        "`step == last_step` (that state is already on disk).",
        "The two rules are joined by OR: test the step rule, and if it does not fire, still test the "
        "time rule. An `if every_steps: return step % every_steps == 0` hides the time rule.",
        "The time rule counts from the last save: `now - last_time >= every_seconds` (>=, not >), and "
        "it cannot fire while `last_time` is None.",
        "Either rule may be None (off). End with `return False`, so the answer is always a bool.",
    ),
    reference=solutions.should_save,
)

checksum = Exercise(
    name="checksum",
    grader=check_verify_part,
    hints=(
        "A missing file is an answer ('missing'), not an exception: check `Path(path).is_file()` first.",
        "Compare the size next: `path.stat().st_size` costs nothing, hashing reads every byte.",
        "Hash in chunks: `h = hashlib.sha256()`, then `h.update(chunk)` for 1 MiB reads until `read` "
        "returns b''; compare `h.hexdigest()` with the record.",
        "Return None only when size and digest both match, otherwise a short non-empty reason.",
    ),
    reference=solutions.verify_part,
)

migration = Exercise(
    name="migration",
    grader=check_migration,
    hints=(
        "Refuse what is not a v1 payload first: `payload.get('schema') != 'ckpt.v1'` raises "
        "`SchemaError` (any ValueError passes).",
        "Never change `payload`: start from `new = dict(payload)` and only assign keys of `new`.",
        "v1 never recorded its environment or data: say so with `recorded: False` blocks instead of "
        "reading this machine's versions.",
        "`new.setdefault('extras', None)` keeps extras when present and adds None when a very old "
        "payload lacks the key.",
    ),
    reference=solutions.migrate_v1_to_v2,
)

#: Every exercise by name, in course order.
EXERCISES: dict[str, Exercise] = {
    ex.name: ex
    for ex in (
        rng_capture,
        atomic,
        round_trip,
        shard_index,
        param_group,
        batch_position,
        keep_k,
        cadence,
        checksum,
        migration,
    )
}
