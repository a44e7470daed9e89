"""The two child processes of the kill-and-resume demo, and the parent's side of talking to them.

Kept apart from :mod:`ckpt_lesson.course.demo` so that the code a child runs is small
and easy to audit: a child gets its whole config as one JSON argument
(seed, step counts, the checkpoint path; never the baseline's losses), and
reports back only through files it writes atomically.

* The *interrupted* child trains to ``interrupt_at``, saves, writes a ready
  file, keeps training, and waits to be SIGKILLed.
* The *resumer* builds its objects, blocks on stdin until the parent says
  ``go`` (sent only after the first child is dead), loads the checkpoint,
  trains to the end and writes its losses and sample ids.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ckpt_lesson.course.training import (
    SyntheticRegression,
    make_model,
    make_optimizer_and_scheduler,
    seed_everything,
    train,
)
from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.atomic import atomic_write_json
from ckpt_lesson.files.checkpoint import TrainState, load_checkpoint, save_checkpoint
from ckpt_lesson.files.sharded import load_sharded_checkpoint, save_sharded_checkpoint

__all__ = [
    "CHILD_TIMEOUT_S",
    "COURSE_SIZES",
    "build_run",
    "child_main",
    "kill_after_save",
    "release_resumer",
    "spawn_child",
]

#: How long the parent waits for a child's save or a resumer's result.
CHILD_TIMEOUT_S = 180.0
_CHILD_CODE = "from ckpt_lesson.course.demo_worker import child_main; child_main()"
#: The course's model and data sizes: what ``python -m ckpt_lesson demo``, notebook 05
#: and the negative controls run (256 samples in 16 batches of 16).
COURSE_SIZES = {"in_dim": 8, "hidden": 32, "out_dim": 1, "batch_size": 16, "batches_per_epoch": 16}


def build_run(
    seed: int, total_steps: int, sizes: dict[str, int] | None = None
) -> tuple[SyntheticRegression, Any, Any, Any]:
    """The one construction used by the baseline, both children and the controls.

    ``sizes`` has the keys of :data:`COURSE_SIZES` (the default); the dataset
    holds exactly ``batch_size * batches_per_epoch`` samples.
    """
    z = COURSE_SIZES if sizes is None else sizes
    seed_everything(seed)
    n = z["batch_size"] * z["batches_per_epoch"]
    data = SyntheticRegression(n=n, in_dim=z["in_dim"], seed=seed, out_dim=z["out_dim"])
    model = make_model(z["in_dim"], z["hidden"], z["out_dim"])
    optimizer, scheduler = make_optimizer_and_scheduler(model, total_steps=total_steps)
    return data, model, optimizer, scheduler


def spawn_child(config: dict[str, Any], err: Any, *, stdin: int | None = None) -> subprocess.Popen[bytes]:
    """Start ``python -c 'child_main()'`` with ``config`` as its one argument; stderr goes to ``err``.

    ``PYTHONPATH`` points at this package's checkout, so the child runs the
    same code as the parent even without an installed package.
    """
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-c", _CHILD_CODE, json.dumps(config)]
    return subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.DEVNULL, stderr=err, env=env)


def _stderr_tail(f: Any, limit: int = 2000) -> str:
    f.seek(0)
    return f.read().decode("utf-8", "replace")[-limit:].strip() or "(no stderr)"


def kill_after_save(proc: subprocess.Popen[bytes], ready: Path, err: Any, step: int) -> int:
    """Wait for the child's "saved" signal, then SIGKILL it; returns its exit status."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None:
            raise CheckpointError(
                f"the interrupted child exited ({proc.returncode}) before saving step {step}; "
                f"its stderr ends with:\n{_stderr_tail(err)}"
            )
        if time.monotonic() > deadline:
            raise CheckpointError(f"the interrupted child did not save within {CHILD_TIMEOUT_S:.0f} s.")
        time.sleep(0.01)
    # The checkpoint is durable now and the child is busy training past it.
    # Kill it the way a pre-emption would: no cleanup, no warning.
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    returncode = proc.wait()
    ready.unlink()
    if returncode != -signal.SIGKILL:
        raise CheckpointError(
            f"the interrupted child ended with status {returncode}, not -SIGKILL: it was not killed "
            f"mid-run, so the demo proves nothing. Its stderr ends with:\n{_stderr_tail(err)}"
        )
    return returncode


def release_resumer(proc: subprocess.Popen[bytes], out: Path, err: Any, target: Path) -> dict[str, Any]:
    """Tell the waiting resumer to go, wait for it, read its losses."""
    try:
        proc.communicate(b"go\n", timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise CheckpointError(f"the resumed child did not finish within {CHILD_TIMEOUT_S:.0f} s.") from exc
    if proc.returncode != 0:
        raise CheckpointError(
            f"the resumed child failed (exit {proc.returncode}) resuming from {target}; "
            f"its stderr ends with:\n{_stderr_tail(err)}"
        )
    result = json.loads(out.read_text(encoding="utf-8"))
    out.unlink()
    return result


def child_main() -> None:
    """Entry point of both children; the config arrives as JSON in ``sys.argv[1]``."""
    config = json.loads(sys.argv[1])
    seed, total_steps, ckpt = int(config["seed"]), int(config["total_steps"]), config["ckpt"]
    sizes = {k: int(v) for k, v in config.get("sizes", COURSE_SIZES).items()}
    data, model, optimizer, scheduler = build_run(seed, total_steps, sizes)
    bs = sizes["batch_size"]
    if config["role"] == "interrupted":
        state = TrainState()
        train(
            model,
            optimizer,
            scheduler,
            state,
            data,
            until_step=int(config["interrupt_at"]),
            seed=seed,
            batch_size=bs,
        )
        contract = {"fingerprint": data.fingerprint(), "order_seed": seed}
        if config["sharded"]:
            save_sharded_checkpoint(
                model, optimizer, scheduler, state, ckpt, num_shards=int(config["num_shards"]), data=contract
            )
        else:
            save_checkpoint(model, optimizer, scheduler, state, ckpt, data=contract)
        atomic_write_json({"step": state.step}, config["ready"])
        # Carry on as a real job would, then idle until the parent's SIGKILL.
        # Should the parent itself die first, we are re-parented: leave then,
        # rather than idle forever as an orphan.
        train(model, optimizer, scheduler, state, data, until_step=total_steps, seed=seed, batch_size=bs)
        while os.getppid() == int(config["parent"]):
            time.sleep(0.05)
    elif config["role"] == "resume":
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("demo resumer: the parent did not say go; exiting without loading.")
        if config["sharded"]:
            state = load_sharded_checkpoint(ckpt, model, optimizer, scheduler)
        else:
            state = load_checkpoint(ckpt, model, optimizer, scheduler)
        start, before = state.step, list(state.losses)
        records = train(
            model, optimizer, scheduler, state, data, until_step=total_steps, seed=seed, batch_size=bs
        )
        result = {
            "start_step": start,
            "losses_before": before,
            "losses": [r.loss for r in records],
            "sample_ids": [list(r.sample_ids) for r in records],
        }
        atomic_write_json(result, config["out"])
    else:
        raise SystemExit(f"unknown demo child role {config['role']!r}")
