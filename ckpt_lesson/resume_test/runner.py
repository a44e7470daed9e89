"""Running the user's command: one attempt at a time, watched, and killed on cue.

Each attempt is started in its own session (``start_new_session``), so the
kill reaches the whole process group: a command like ``bash -c "python
train.py"`` or a script with DataLoader workers dies entirely, as it would
when a machine is taken away. With ``--signal TERM`` the group first gets
``SIGTERM`` (the notice a spot machine or a scheduler sends) and, after the
grace period, ``SIGKILL``: that exercises the script's preemption path.

While an attempt runs, one loop reads its step reports, watches its
checkpoint folder, asks the :class:`~plan.KillTrigger` whether this is
the moment, and sleeps until something changes. Right after a kill it looks
at what the dead process left behind: saves that do not verify, staging
folders, files cut short.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.side_files import open_beside
from ckpt_lesson.resume_test.damage import damage_after_kill, newest_save, newest_store_save
from ckpt_lesson.resume_test.machine import lose_machine, machine_for, store_urls
from ckpt_lesson.resume_test.names import NameFilter
from ckpt_lesson.resume_test.outside import OpenWrites
from ckpt_lesson.resume_test.plan import KillTarget, KillTrigger, TrialPlan
from ckpt_lesson.resume_test.proc_tree import ProcessTree
from ckpt_lesson.resume_test.procs import ATTEMPT_ENV, Stopped, end_tagged, new_token, stop_later
from ckpt_lesson.resume_test.steps import StepPattern, StepReader, StepRecord
from ckpt_lesson.resume_test.watch import MANAGER, NONE, FolderWatcher, SaveBurst, Snapshot, Waker
from ckpt_lesson.runs.steplog import CKPT_DIR_ENV, STEP_LOG_ENV

#: A path part that names a temporary file or folder: `x.tmp`, `x.tmp-123`, `tmp-checkpoint-8`, `x.partial`.
_TEMP_PART = re.compile(r"(^|[.\-_])(tmp|temp|partial)([.\-_]|$)", re.IGNORECASE)

__all__ = ["Attempt", "Kill", "RunSpec", "TrialRun", "run_attempt", "run_trial"]

SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}
#: Longest sleep of the watch loop: how late a process exit or a timeout is noticed.
TICK_SECONDS = 0.02


@dataclass(frozen=True)
class RunSpec:
    """How to start the command; the same for the baseline and every restart."""

    command: tuple[str, ...]
    cwd: Path
    env: dict[str, str]
    pattern: StepPattern | None = None
    signal: str = "KILL"
    grace: float = 10.0
    timeout: float = 300.0
    ckpt_globs: tuple[str, ...] = ()
    #: ``--lose-machine``: each restart on a fresh "machine" (see machine.py).
    lose_machine: bool = False
    #: Makes ``{run_id}`` unique per invocation; the working folder's copy; the tool's workdir.
    session_id: str = ""
    image: Path | None = None
    workdir: Path | None = None


@dataclass
class Kill:
    """One kill as it happened (see :class:`~plan.KillTarget` for the plan)."""

    kind: str
    target_step: int
    point: str
    mid_save: bool
    last_step: int | None
    signal: str
    forced: bool = False
    held_save: bool = False
    exit_code: int | None = None
    damaged: list[dict[str, Any]] = field(default_factory=list)
    #: The newest published save at the kill (a CheckpointManager folder, else the store named in the
    #: command): what a restart resumes from.
    newest: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Attempt:
    """One process: what it reported, how it ended, what it left behind."""

    index: int
    folder: Path
    started: float
    ended: float = 0.0
    exit_code: int | None = None
    records: list[StepRecord] = field(default_factory=list)
    kill: Kill | None = None
    timed_out: bool = False
    save_steps: list[int] = field(default_factory=list)
    layout: str = NONE
    bad_lines: int = 0
    #: Processes of this run still running after it ended (left its group, or outlived it): killed.
    left_running: list[int] = field(default_factory=list)
    #: The watcher could see only part of the checkpoint folder (too big): why, for the report.
    watch_warning: str | None = None
    #: On a new machine (--lose-machine): files it held open for writing outside the tool's workdir.
    outside_writes: list[str] = field(default_factory=list)

    @property
    def stdout(self) -> Path:
        return self.folder / "stdout.log"

    @property
    def stderr(self) -> Path:
        return self.folder / "stderr.log"

    def last_stderr_line(self) -> str:
        """The last non-empty line of stderr (the exception, usually), shortened to one line."""
        try:
            text = self.stderr.read_bytes()[-4096:].decode("utf-8", errors="replace")
        except OSError:
            return ""
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return lines[-1][:200] if lines else ""


@dataclass
class TrialRun:
    """One trial: its plan, its attempts in order, and how it ended (finished/crashed/timeout)."""

    plan: TrialPlan
    folder: Path
    attempts: list[Attempt] = field(default_factory=list)
    status: str = "finished"


def _launch(spec: RunSpec, argv: list[str], env: dict[str, str], folder: Path) -> subprocess.Popen[bytes]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    # Opened like every side file (side_files.py): no symlink followed, no FIFO waited on.
    with (
        os.fdopen(open_beside(folder / "stdout.log", flags), "wb") as out,
        os.fdopen(open_beside(folder / "stderr.log", flags), "wb") as err,
    ):
        try:
            return subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=spec.cwd,
                start_new_session=True,
            )  # fmt: skip
        except FileNotFoundError:
            raise CheckpointError(
                f"command not found: {argv[0]!r}; check the spelling or give its path (it goes after --)."
            ) from None
        except PermissionError:
            raise CheckpointError(f"{argv[0]!r} is not executable; run it through its interpreter.") from None
        except OSError as exc:
            raise CheckpointError(f"could not start {argv[0]!r}: {exc.strerror or exc}.") from None


def _signal_group(proc: subprocess.Popen[bytes], sig: int, tree: ProcessTree | None = None) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    # torchrun's workers live in sessions of their own: a KILL of the group misses them, but a machine
    # that dies takes them too. A TERM is left to the launcher to pass on (torchrun does), as a
    # platform's notice to the job would be; a second TERM would kill a worker that handles the first.
    if tree is not None and sig == signal.SIGKILL:
        tree.signal(sig)


def run_attempt(
    spec: RunSpec,
    folder: Path,
    ckpt_dir: Path,
    *,
    index: int,
    target: KillTarget | None = None,
    layout: str = NONE,
) -> Attempt:
    """Run the command once, killing it at ``target`` (if any); returns what happened.

    Args:
        spec: The command and its settings.
        folder: Where this attempt's logs go (created).
        ckpt_dir: The checkpoint folder (shared by the attempts of one trial).
        index: 1 for the first process of a run, 2 for its first restart, ...
        target: Where to kill it; ``None`` lets it run to the end.
        layout: What the baseline showed the checkpoint folder to be.

    Raises:
        CheckpointError: The command cannot be started.

    Example:
        >>> a = run_attempt(spec, Path("w/b/attempt-1"), Path("w/b/ckpt"), index=1)  # doctest: +SKIP
        >>> a.exit_code, len(a.records)  # doctest: +SKIP
        (0, 40)
    """
    folder.mkdir(parents=True, exist_ok=True)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    spec = machine_for(spec, folder, ckpt_dir, index)  # {run_id}; --lose-machine: a fresh machine
    steps_file = folder / "steps.jsonl"
    token = new_token()  # marks every descendant, also those that leave the group (see procs)
    env = {**spec.env, CKPT_DIR_ENV: str(ckpt_dir), STEP_LOG_ENV: str(steps_file), "PYTHONUNBUFFERED": "1",
           ATTEMPT_ENV: token}  # fmt: skip
    argv = [arg.replace("{ckpt_dir}", str(ckpt_dir)) for arg in spec.command]
    waker = Waker()
    waker.watch(folder)
    names = NameFilter(spec.ckpt_globs)
    watcher = FolderWatcher(ckpt_dir, layout=layout, waker=waker, names=names)
    reader = StepReader(folder / "stdout.log" if spec.pattern else steps_file, spec.pattern)
    trigger = KillTrigger(target, layout) if target is not None else None
    attempt = Attempt(index, folder, time.time())
    proc = _launch(spec, argv, env, folder)
    tree = ProcessTree(proc.pid)
    new_machine = spec.lose_machine and index > 1 and spec.workdir is not None
    writes = OpenWrites(proc.pid, spec.workdir) if new_machine else None
    deadline = time.monotonic() + spec.timeout
    term_sent: float | None = None
    saving = False  # a staging folder exists, or (generic folder) files changed since the last step
    burst = SaveBurst()  # generic folder: the files changed since the last step report
    last_step: int | None = None
    bursts: list[tuple[int, set[str]]] = []  # generic folder: (step, files changed) of each save
    try:
        while True:
            # Read before polling: the iteration that sees the command gone still polls once more,
            # so a save it published right before exiting (a final save) is counted, not dropped.
            done = proc.poll() is not None
            tree.refresh()
            if writes is not None:
                writes.poll()
            events = watcher.poll()
            records = reader.poll()
            moved_in = _relative(waker.take_moved_in(), ckpt_dir)
            for e in events:
                if e.kind == "published" and e.step is not None:
                    attempt.save_steps.append(e.step)
            activity = {e.name for e in events if e.kind == "activity"}
            step_now = _last(records, last_step)
            # Within one poll the order of step reports and file changes is unknown. Changes while
            # a save was already under way are its tail (the last bytes, the rename), even when a
            # step report arrived in the same poll; otherwise a script reports a step, then saves.
            if records:  # a step report ends a generic save: the script is training again
                # ... unless what was open was only a log, written before any checkpoint file had
                # shown which names are saves: then these changes are a save of their own.
                only_logs = names.active and not any(names.is_checkpoint(n) for n in burst.names)
                if burst.names and not only_logs:
                    activity = _written_after(activity, watcher.files(), burst, records[0].t)
                burst = SaveBurst()
            if activity:
                if not burst.names:
                    attempt.save_steps.append(0 if step_now is None else step_now)
                    bursts.append((attempt.save_steps[-1], set()))
                bursts[-1][1].update(activity)
                burst.add(activity, watcher)
            burst.renamed |= moved_in
            events = [e for e in events if e.kind != "activity" or e.name in activity]
            saving = watcher.staging_present() if watcher.layout == MANAGER else bool(burst.names)
            if trigger is not None and attempt.kill is None and not done:
                hit = trigger.check(events, records, step_now, saving=saving)
                if hit is not None:
                    _signal_group(proc, SIGNALS[spec.signal], tree)
                    term_sent = time.monotonic() if spec.signal == "TERM" else None
                    attempt.kill = Kill(
                        target.kind, target.step, hit.point, hit.mid_save,
                        step_now, spec.signal, held_save=_holds_save(watcher),
                    )  # fmt: skip
            attempt.records.extend(records)
            last_step = step_now
            if done:
                break
            now = time.monotonic()
            if term_sent is not None and now - term_sent > spec.grace and attempt.kill is not None:
                attempt.kill.forced = True
                _signal_group(proc, signal.SIGKILL, tree)
                term_sent = None
            if now > deadline and not attempt.timed_out:
                attempt.timed_out = True
                _signal_group(proc, signal.SIGKILL, tree)
            wait = TICK_SECONDS if trigger is None else min(TICK_SECONDS, trigger.seconds_until_due() or 1.0)
            waker.wait(wait)
    except Stopped as stop:  # the partial report shows this run too (the cleanup below still runs)
        stop.attempt = attempt
        raise
    finally:
        with stop_later():  # a stop signal now would leave the command running: it waits
            killed = attempt.kill is not None or attempt.timed_out
            if proc.poll() is None:  # the tool itself is being stopped (a signal): leave nothing running
                # Everything the command started goes with it, as on a machine that dies: walk /proc
                # now, so a process started since the last walk is part of the job, not "left behind".
                tree.refresh(now=True)
                _signal_group(proc, signal.SIGKILL, tree)
                proc.wait()
                killed = True
            # Whatever is still running now was left behind by the command (a group we killed is only
            # dying, and not counted): found by its token, killed and reported.
            attempt.left_running = end_tagged(token, spare_group=proc.pid if killed else None)
            _signal_group(proc, signal.SIGKILL)  # without /proc: at least the group
            waker.wait(0.0)  # the last renames the dead process made
            burst.renamed |= _relative(waker.take_moved_in(), ckpt_dir)
            waker.close()
    attempt.ended = time.time()
    attempt.exit_code = proc.returncode
    attempt.records.extend(reader.poll(final=True))
    attempt.bad_lines = reader.bad_lines
    watcher.poll()
    attempt.layout = watcher.layout
    attempt.watch_warning = watcher.warning
    attempt.outside_writes = sorted(writes.found) if writes is not None else []
    if attempt.layout != MANAGER and names.active:
        # Log files written before the first checkpoint file appeared looked like saves: not any more.
        attempt.save_steps = [
            step for step, touched in bursts if any(names.is_checkpoint(n) for n in touched)
        ]
    if attempt.kill is not None:
        attempt.kill.exit_code = proc.returncode
        attempt.kill.damaged = damage_after_kill(ckpt_dir, watcher, burst)
        attempt.kill.newest = newest_save(ckpt_dir) if watcher.layout == MANAGER else None
        stores = store_urls(spec.command, spec.env) if attempt.kill.newest is None else []
        if stores:  # a run that saves to a bucket: the restart resumes from the store's newest
            attempt.kill.newest = newest_store_save(stores[0])
    return attempt


def _relative(paths: set[str], root: Path) -> set[str]:
    prefix = str(root) + os.sep
    return {p[len(prefix) :] for p in paths if p.startswith(prefix)}


def _written_after(names: set[str], files: Snapshot, burst: SaveBurst, t: float) -> set[str]:
    """The files among ``names`` that a new save wrote: not the tail of ``burst``, the save under way.

    Under load one poll can hold a save's tail, the next step reports and the next save (seen in
    CI: an HF run's final save was dated as the tail of the save before it, and lost). The save
    under way ended before the first of those reports (``t``), so a file it never had (a new
    inode) last written after ``t`` belongs to a new save. A file rewritten in place keeps its
    inode and stays the tail: that ambiguity is the old rule's, no worse.
    """
    after = int(t * 1e9)
    return {
        n
        for n in names
        if n in files and not n.endswith("/") and files[n][2] not in burst.first_name and files[n][1] > after
    }


def _last(records: list[StepRecord], default: int | None) -> int | None:
    return records[-1].step if records else default


def _holds_save(watcher: FolderWatcher) -> bool:
    if watcher.layout == MANAGER:
        return bool(watcher.published_steps())
    # A temporary file (Lightning's `.epoch=0-step=6.ckpt.tmp-...`, HF's `tmp-checkpoint-8/`) is a save
    # in progress, not one a restart could load: a kill during the first save leaves only such files.
    return any(not _in_progress(name) for name in watcher.checkpoint_files())


def _in_progress(name: str) -> bool:
    """Whether a file of a plain folder belongs to a save still being written (a hidden or temp name)."""
    return any(part.startswith(".") or _TEMP_PART.search(part) for part in name.split("/"))


def run_trial(spec: RunSpec, folder: Path, plan: TrialPlan, *, layout: str) -> TrialRun:
    """Run one trial: start, kill at each planned point, restart, until the command ends.

    A kill is always followed by a restart; an exit on its own ends the trial
    (``"finished"`` on 0, ``"crashed"`` otherwise: a supervisor would restart a
    crashed job, and it would crash the same way); a timeout ends it too.

    Example:
        >>> trial = run_trial(spec, Path("w/trial-01"), plan, layout="manager")  # doctest: +SKIP
        >>> trial.status, [a.kill.point for a in trial.attempts if a.kill]  # doctest: +SKIP
        ('finished', ['right after step-00000020 was published'])
    """
    trial = TrialRun(plan, folder)
    targets = list(plan.targets)
    while True:
        target = targets.pop(0) if targets else None
        index = len(trial.attempts) + 1
        attempt = run_attempt(
            spec, folder / f"attempt-{index}", folder / "ckpt", index=index, target=target, layout=layout
        )
        trial.attempts.append(attempt)
        if attempt.kill is not None and spec.lose_machine:
            lose_machine(folder / "ckpt", attempt, spec)  # the disk goes with the machine
        if attempt.timed_out:
            trial.status = "timeout"
            return trial
        if attempt.kill is not None:
            continue
        trial.status = "finished" if attempt.exit_code == 0 else "crashed"
        return trial
