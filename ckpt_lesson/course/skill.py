"""The lesson as a one-page recipe, generated from the package's own constants.

A hand-written summary drifts: someone adds an RNG source or a schema, the
code changes, the doc does not. Here every list in the recipe (buckets,
payload keys, RNG sources, schemas, migrations, temp-file marker, footer
magic, shard-index names, error classes) is read from the package at render
time, so changing a constant changes the recipe.

The output is deterministic (no dates, no paths, no hashes) so that the
committed ``outputs/skill-checkpoint-save-resume.md`` only changes when the
package does.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

import ckpt_lesson.errors as errors
from ckpt_lesson.files import shard_index, sharded
from ckpt_lesson.files.apply import Restored
from ckpt_lesson.files.atomic import TEMP_MARKER, atomic_write_bytes
from ckpt_lesson.files.checkpoint import BUCKETS, TrainState, build_payload
from ckpt_lesson.files.hashing import DEFAULT_ALGO
from ckpt_lesson.files.integrity import FOOTER_MAGIC
from ckpt_lesson.files.rng import RNG_SOURCES
from ckpt_lesson.files.schema import CURRENT_SCHEMA, KNOWN_SCHEMAS, MIGRATIONS
from ckpt_lesson.runs.data_position import resumable

__all__ = ["SKILL_FILE_NAME", "render_skill_markdown", "write_skill_markdown"]

SKILL_FILE_NAME = "skill-checkpoint-save-resume.md"

# What each payload key is for. Keys come from a real build_payload() call;
# one without a line here is still listed (as "see the code"), never dropped.
_KEY_NOTES = {
    "schema": "names the layout; readers migrate older ones and refuse unknown ones",
    "model": "`model.state_dict()`",
    "optimizer": "`optimizer.state_dict()`: AdamW's moments and step counts",
    "scheduler": "`scheduler.state_dict()` (or `None` for a run without one)",
    "state": "step, epoch, batch_in_epoch and the loss history",
    "rng": "every random generator, as tensors and plain values",
    "wall_saved_at": "save time (seconds since the epoch), for humans and retention",
    "extras": "your own plain-Python values",
    "env": "torch / NumPy / Python versions, device type, world size",
    "data": "dataset fingerprint and batch-order seed, to refuse a resume on different data",
}
_RNG_NOTES = {
    "python": "`random.getstate()` (augmentation, sampling in user code)",
    "numpy": "NumPy's global generator, its key array as a list (the weights-only loader refuses ndarrays)",
    "torch_cpu": "`torch.get_rng_state()`: dropout masks, `torch.rand*`",
    "torch_cuda": "one state per CUDA device (empty on CPU)",
}


def _tiny_payload_keys() -> list[str]:
    # A real payload from a parameter-free model: the keys are exactly what
    # save_checkpoint writes, and nothing consumes a random number.
    param = torch.nn.Parameter(torch.zeros(1))
    payload = build_payload(torch.nn.Module(), torch.optim.SGD([param], lr=0.1), None, TrainState())
    return list(payload)


def _sharded_section() -> list[str]:
    example = _example_index()
    return [
        "A sharded checkpoint is a directory: model weights spread over shard files, each with the "
        f"optimizer state of its own parameters, every other bucket in `{shard_index.META_NAME}`, and "
        f"`{shard_index.INDEX_NAME}` (schema `{shard_index.SHARDED_SCHEMA}`) listing each file's keys, "
        "optimizer-state ids, size, hash algorithm and digest.",
        "",
        f"- Layouts: {_codes(shard_index.LAYOUTS)}.",
        f"- Write every shard and `{shard_index.META_NAME}` atomically first (in parallel threads: the "
        f"writes and hashes release the GIL), `{shard_index.INDEX_NAME}` last: "
        "**its presence is the commit**. A directory without it is a save that never finished.",
        "- Never rewrite a finished checkpoint in place; save each step into a new directory.",
        "- On load, check every file's size and digest against the index, every shard's keys against "
        "its entry, and every path (no absolute paths, no `..`, no symlink out of the directory) "
        "before merging anything.",
        "",
        "The index of a 2-shard save of a `Linear(2, 1)` (sizes and hashes elided):",
        "",
        "```json",
        example,
        "```",
    ]


def _own_loop_section() -> list[str]:
    """Section 0: the state API in a training loop of one's own, with the data position."""
    # Real objects, so a renamed field or key changes the recipe: a DataLoader built without
    # a shuffle draws nothing, and state_dict() does not iterate.
    position = sorted(resumable(torch.utils.data.DataLoader(range(2), batch_size=1), seed=0).state_dict())
    fields = [f for f in Restored.__dataclass_fields__ if not f.startswith("_")]
    return [
        "## 0. In your own training loop",
        "",
        "The state is a mapping of named parts. Objects with `state_dict()` (model, optimizer, "
        "scheduler, `GradScaler`, the loader's position) are restored in place; plain values come back "
        f"in `restored.values` (a `Restored`: {_codes(fields)}). A shuffled `DataLoader` needs its "
        "position saved: it draws each epoch's order from the global generator when the epoch "
        "starts, so a restored generator does not bring a mid-epoch order back.",
        "",
        "```python",
        "import ckpt_lesson as cl",
        "",
        "train_loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=2)",
        'mgr = cl.CheckpointManager("runs/exp1", keep_last=3, every_steps=100)',
        "state = dict(model=model, optimizer=opt, scheduler=scheduler, loader=cl.resumable(train_loader))",
        "restored = mgr.restore_latest(state)   # None on a first run; verified, in place, RNG too",
        "step = restored.step if restored else 0",
        "for epoch in range(train_loader.epoch, epochs):   # the epoch in progress at the save",
        "    for x, y in train_loader:                     # its remaining batches, then whole epochs",
        "        ...  # one optimizer step",
        "        step += 1",
        "        if mgr.should_save(step):",
        "            mgr.save(step, state)",
        "    scheduler.step()",
        "```",
        "",
        f"- `cl.resumable(loader)` adapts the loader in place and saves {_codes(position)}: each epoch's "
        "shuffle, worker seeds and per-batch augmentation seeds derive from (seed, epoch), and a restore "
        "skips the consumed batches as sampler indices: no sample is read twice. Any sampler, a "
        "`batch_sampler`, `DistributedSampler`, `drop_last`, workers; an `IterableDataset` is refused "
        "(it needs a position of its own: torchdata's `StatefulDataLoader`, saved as a part as it is).",
        "- `restore_latest(state)`: every saved object must be in `state` (the live object, built as in "
        "the saving run); saved values need no placeholder (all come back in `restored.values`); every "
        "name in `state` must be in the save. Anything else is refused by name before anything "
        "changes; `strict=False` ignores parts present on one side only.",
        "- A loop that prefetches its next batch captures the RNG before the prefetch: "
        "`snap = cl.capture_rng_state()`, then `mgr.save(step, state, rng=snap)`.",
        "",
    ]


def _example_index() -> str:
    # Rendered from a real save, so the example cannot drift from the writer.
    with torch.random.fork_rng(devices=[]):
        model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tempfile.TemporaryDirectory(prefix="ckpt-skill-") as tmp:
        sharded.save_sharded_checkpoint(model, opt, None, TrainState(), Path(tmp) / "ckpt", num_shards=2)
        index = json.loads((Path(tmp) / "ckpt" / shard_index.INDEX_NAME).read_text(encoding="utf-8"))
    for entry in [*index.get("shards", []), index.get("meta", {})]:
        entry.update({k: f"<{k}>" for k in ("bytes", "digest", "sha256") if k in entry})
    seal = index.get("record_digest")
    if isinstance(seal, dict):  # the index's own checksum changes with every save's bytes
        seal["digest"] = "<digest of the index without this field>"
    return json.dumps(index, indent=2)


def _codes(items: Any) -> str:
    return ", ".join(f"`{x}`" for x in items)


def _error_rows() -> list[str]:
    rows = []
    for name in errors.__all__:
        doc = (getattr(errors, name).__doc__ or "").strip().splitlines()
        rows.append(f"| `{name}` | {doc[0] if doc else ''} |")
    return rows


def render_skill_markdown() -> str:
    """Render the "Checkpoint save and resume" recipe from the package's constants.

    Returns:
        Markdown text, identical on every call with the same package version.

    Example:
        >>> text = render_skill_markdown()
        >>> "Checkpoint save and resume" in text
        True
    """
    keys = _tiny_payload_keys()
    # Each registered step lifts a payload by one version: the next schema in KNOWN_SCHEMAS.
    migrations = [
        f"`{src}` -> `{KNOWN_SCHEMAS[KNOWN_SCHEMAS.index(src) + 1]}` by `{fn.__name__}`"
        for src, fn in MIGRATIONS.items()
    ]
    lines = [
        "---",
        "name: checkpoint-save-resume",
        "description: Save PyTorch training state so that a killed run resumes bit-for-bit; write it "
        "atomically, load it safely. Generated from the ckpt_lesson package.",
        "---",
        "",
        "# Checkpoint save and resume",
        "",
        "Generated by `ckpt_lesson.render_skill_markdown()` from the package's constants; "
        "regenerate it (`python -m ckpt_lesson demo --out outputs` writes it to `outputs/`) instead of "
        "editing it.",
        "",
        "Use it when a training job can be interrupted (spot / pre-emptible machines, time limits, "
        "crashes) and must continue as if nothing happened.",
        "",
        *_own_loop_section(),
        f"## 1. What a checkpoint holds (schema `{CURRENT_SCHEMA}`)",
        "",
        f"A resume needs every bucket: {_codes(BUCKETS)}. Drop one and the run continues plausibly "
        "but not identically. The full payload's top-level keys:",
        "",
        "| key | what |",
        "| --- | --- |",
        *[
            f"| `{k}` | {_KEY_NOTES.get(k, 'see `ckpt_lesson.files.checkpoint.build_payload`')} |"
            for k in keys
        ],
        "",
        "Keep every value a tensor or a plain Python value, so `torch.load(weights_only=True)` reads it.",
        "",
        "## 2. Write atomically and durably",
        "",
        "1. `torch.save` into a uniquely named temp file in the *target's own directory* "
        f"(`.NAME{TEMP_MARKER}PID-XXXX`): a rename across file systems is a copy, not atomic.",
        "2. Hash the bytes while they are written and store the digest in the zip comment "
        f"(`{FOOTER_MAGIC.decode()}{DEFAULT_ALGO}:<hex>`); `torch.load` does not check the archive's CRCs. "
        f"`{DEFAULT_ALGO}` detects damage at memory speed; pick `sha256` or `blake3` when a digest "
        "is pinned somewhere trusted (a record beside the data stops accidents, not attackers).",
        "3. Flush and `os.fsync` the file.",
        "4. `os.replace(temp, target)`: other processes see the old file or the new one, never half.",
        "5. `os.fsync` the directory, so the rename survives a power loss.",
        "",
        f"Files whose name starts with `.` and contains `{TEMP_MARKER}` are leftovers of an "
        "interrupted save: never load them as checkpoints.",
        "",
        "## 3. Capture every random generator",
        "",
        *[f"- `{s}`: {_RNG_NOTES.get(s, 'see `ckpt_lesson.files.rng`')}" for s in RNG_SOURCES],
        "",
        "Seeding at the top of the script is not restoring: after a resume the generators must be "
        "where they were at the save, not where the seed put them.",
        "",
        "## 4. Sharded checkpoints",
        "",
        *_sharded_section(),
        "",
        "## 5. Load rules",
        "",
        "- Verify first: size and digest (footer, index or manifest) before the unpickler sees a byte.",
        "- Always `torch.load(..., weights_only=True)`, passed explicitly; never the full unpickler.",
        "- Refuse paths that escape the checkpoint directory (absolute, `..`, outside symlinks).",
        "- Check shapes, optimizer groups and scheduler presence before changing anything, then "
        "restore all buckets, the RNG last.",
        "- Fail with a `CheckpointError` that names the file, the cause and the fix; never `assert` "
        "(`python -O` strips asserts).",
        "",
        "| error | meaning |",
        "| --- | --- |",
        *_error_rows(),
        "",
        "## 6. Schemas and migrations",
        "",
        f"Known schemas, oldest first: {_codes(KNOWN_SCHEMAS)}; new saves write `{CURRENT_SCHEMA}`. "
        "Older payloads are lifted one step at a time by pure functions in a registry "
        "(`ckpt_lesson.files.schema.MIGRATIONS`):",
        "",
        *[f"- {m}" for m in migrations],
        "",
        "An unknown or newer schema is refused, never guessed from the keys present.",
        "",
        "## 7. The resume, in code",
        "",
        "```python",
        "import ckpt_lesson as cl",
        "",
        "cl.seed_everything(seed)                      # same construction as the saved run",
        "data = cl.SyntheticRegression(seed=seed)",
        "model = cl.make_model()",
        "opt, sched = cl.make_optimizer_and_scheduler(model, total_steps=total_steps)",
        "state = cl.load_checkpoint(path, model, opt, sched)   # verifies, then restores every bucket",
        "cl.train(model, opt, sched, state, data, until_step=total_steps, seed=seed)",
        "```",
        "",
        "## 8. Prove it",
        "",
        "Kill a run with SIGKILL after a save, resume it in a fresh process and compare every loss "
        "with an uninterrupted run: on CPU the difference is exactly 0.0 and the batches are the same. "
        "Two negative controls (RNG not restored, fresh optimizer) must diverge. "
        "`python -m ckpt_lesson demo` runs exactly this; `python -m ckpt_lesson --help` lists the "
        "other commands.",
        "",
    ]
    return "\n".join(lines)


def write_skill_markdown(path: str | os.PathLike[str]) -> Path:
    """Write :func:`render_skill_markdown`'s text to ``path`` atomically; returns the path.

    Raises:
        CheckpointError: The directory does not exist.

    Example:
        >>> write_skill_markdown("outputs/skill-checkpoint-save-resume.md")  # doctest: +SKIP
    """
    path = Path(path)
    atomic_write_bytes(render_skill_markdown().encode("utf-8"), path)
    return path
