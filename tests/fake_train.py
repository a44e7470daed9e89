"""A torch-free stand-in for a training script, for fast tests of resume-test itself.

It "trains" a number with the seeded global ``random`` generator (the stand-in for dropout)
and saves its whole state as JSON, so a correct resume is exact and each
``--mistake`` is exact to predict. It starts in milliseconds, where a torch
script needs seconds.

Layouts: ``files`` writes ``state.json`` atomically (temp file + rename);
``manager`` imitates CheckpointManager's folders (``.staging-step-*`` then a
rename to ``step-XXXXXXXX``). Mistakes: ``in-place`` (writes ``state.json``
over the last one, slowly, so a kill can cut it), ``reseed`` (RNG not restored),
``no-load`` (never loads: restarts from step 0), ``crash-on-resume`` (raises
when a save exists), ``skip`` (resumes one step too far), ``prefetch`` (draws the
next step's number before saving, so a restored RNG is drawn one step ahead),
``hidden-state`` (a carried value, like an LSTM's hidden state, is not saved).

The RNG is ``random``'s global generator, so ``log_step``'s fingerprint sees it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

from ckpt_lesson import log_step

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", default=os.environ.get("CKPT_LESSON_CKPT_DIR"))
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--save-every", type=int, default=4)
parser.add_argument("--layout", choices=("files", "manager", "none"), default="files")
parser.add_argument("--mistake", default="")
parser.add_argument("--sleep", type=float, default=0.005)
parser.add_argument("--print", action="store_true", help="print steps instead of log_step")
parser.add_argument("--ids", action="store_true", help="report sample ids")
parser.add_argument("--handle-term", action="store_true", help="save and exit 75 on SIGTERM")
parser.add_argument("--ignore-term", action="store_true")
parser.add_argument("--fail", type=int, default=0, help="exit with this code at once")
parser.add_argument("--child-pid-file", help="start a sleeping child and write its pid here")
parser.add_argument("--pid-file", help="append this process's pid here")
parser.add_argument("--setsid-helper", help="start a helper in its own session; append its pid here")
parser.add_argument("--ckpt-name", default="state.json", help="the checkpoint file's name (files layout)")
parser.add_argument("--log-file", help="also append a line to this file in the folder every step (a log)")
parser.add_argument("--noise-after", type=int, default=0, help="add unseeded noise to steps after this one")
parser.add_argument("--data", help="an input file the run needs (a relative path finds it in the cwd)")
parser.add_argument("--epoch-steps", type=int, default=0, help="report the step within the epoch")
args = parser.parse_args()

if args.fail:
    sys.exit(args.fail)
if args.data:
    Path(args.data).read_text()  # like a config or a data file: missing, the run cannot start
if args.child_pid_file:
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    Path(args.child_pid_file).write_text(str(child.pid))
if args.pid_file:
    with open(args.pid_file, "a") as f:
        f.write(f"{os.getpid()}\n")
if args.setsid_helper:
    import subprocess

    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    with open(args.setsid_helper, "a") as f:
        f.write(f"{helper.pid}\n")
stop = {"term": False}
if args.handle_term:
    signal.signal(signal.SIGTERM, lambda *a: stop.update(term=True))
if args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

ckpt = Path(args.ckpt_dir)
ckpt.mkdir(parents=True, exist_ok=True)


def latest() -> Path | None:
    if args.layout == "files":
        path = ckpt / args.ckpt_name
        return path if path.exists() else None
    steps = sorted(p for p in ckpt.iterdir() if p.name.startswith("step-"))
    return steps[-1] / "state.json" if steps else None


def save(state: dict) -> None:
    if args.layout == "none":
        return
    data = json.dumps(state).encode()
    if args.mistake == "in-place":
        with open(ckpt / args.ckpt_name, "wb") as f:
            f.write(data[:10])
            f.flush()
            time.sleep(0.1)  # a big checkpoint takes a while: a kill can land here
            f.write(data[10:])
        return
    if args.layout == "files":
        tmp = ckpt / (args.ckpt_name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, ckpt / args.ckpt_name)
        return
    staging = ckpt / f".staging-step-{state['step']:08d}-{os.getpid()}-abcd1234"
    staging.mkdir()
    (staging / "state.json").write_bytes(data)
    os.replace(staging, ckpt / f"step-{state['step']:08d}")


random.seed(3)
state = {"step": 0, "w": 1.0, "rng": None}
found = latest()
if found is not None and args.mistake == "crash-on-resume":
    raise RuntimeError("cannot read the checkpoint")
if found is not None and args.mistake != "no-load":
    state = json.loads(found.read_text())
    if args.mistake != "reseed":
        version, internal, gauss = state["rng"]
        random.setstate((version, tuple(internal), gauss))
    if args.mistake == "skip":
        state["step"] += 1

# prefetch: the next step's draw is taken ahead of time (a loader's prefetched batch); the save
# holds the RNG after that draw but not the draw itself, so a resumed run draws it again.
pending = random.random() if args.mistake == "prefetch" else None
hidden = 0.0  # hidden-state: carried from step to step, never saved
while state["step"] < args.steps:
    time.sleep(args.sleep)
    state["step"] += 1
    if pending is not None:
        draw, pending = pending, random.random()
    else:
        draw = random.random()
    hidden = hidden * 0.5 + draw if args.mistake == "hidden-state" else 0.0
    state["w"] = round(state["w"] * 0.9 + draw + 0.1 * hidden, 12)
    if args.noise_after and state["step"] > args.noise_after:  # unseeded: differs between any two runs
        state["w"] += 1e-9 * (1 + int.from_bytes(os.urandom(2), "little") / 65536)
    step, loss = state["step"], state["w"]
    shown = (step - 1) % args.epoch_steps + 1 if args.epoch_steps else step
    if args.print:
        print(f"step {shown} loss {loss!r}", flush=True)
    else:
        log_step(shown, loss, sample_ids=[step % 5, step % 7] if args.ids else None)
    if args.log_file:
        with open(ckpt / args.log_file, "a") as f:
            f.write(f"{step},{loss}\n")
    state["rng"] = random.getstate()
    if step % args.save_every == 0 or stop["term"]:
        save(state)
    if stop["term"]:
        sys.exit(75)
