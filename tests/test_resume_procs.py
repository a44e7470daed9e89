"""Nothing left running: a stopped resume-test ends every process of the command, and leftovers are reported.

Liveness is read from /proc (a killed process that no one has reaped yet is a zombie: it runs
nothing), so these tests need Linux.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt_lesson.cli import main
from ckpt_lesson.resume_test.procs import (
    ATTEMPT_ENV,
    Stopped,
    end_tagged,
    new_token,
    stop_later,
    stop_now_or_later,
    tagged_processes,
)

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
FAKE = str(Path(__file__).resolve().parent / "fake_train.py")


def alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2] not in "ZX"


def pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def wait_for(predicate, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


def test_processes_are_found_by_their_token_even_in_another_session(tmp_path):
    token = new_token()
    env = {**os.environ, ATTEMPT_ENV: token}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True
    )
    try:
        wait_for(lambda: proc.pid in tagged_processes(token))
        assert tagged_processes(new_token()) == {}
        assert end_tagged(token) == [proc.pid]
        proc.wait(timeout=10)
        assert not alive(proc.pid) and tagged_processes(token) == {}
    finally:
        proc.kill()
        proc.wait()


def test_a_setsid_helper_the_command_leaves_behind_is_reported_and_killed(tmp_path, capsys):
    helpers = tmp_path / "helpers"
    code = main(["resume-test", "--workdir", str(tmp_path / "w"), "--trials", "1", "--kills", "1",
                 "--kill-at", "after-save", "--", sys.executable, FAKE,
                 "--setsid-helper", str(helpers), "--sleep", "0.05"])  # fmt: skip
    out = capsys.readouterr().out
    started = pids(helpers)
    # 50 ms steps: with the fake's default 5 ms, a CI machine under load (two busy loops on two
    # cores) let the last four steps finish before the after-save kill landed: INCONCLUSIVE.
    assert code == 0 and len(started) == 3, out  # the baseline, the killed run, the restart
    # The baseline and the restart ended on their own: their helpers were left behind. The killed
    # run's helper ends with the job when the tool's quarter-second /proc walk had already seen it
    # (as on a machine that dies), and is reported like the others when it had not.
    note = next(line for line in out.splitlines() if "your command left" in line)
    assert re.search(r"left [23] process\(es\) running after it ended \(baseline: pid \d+; ", note), note
    assert "trial 1 run 2: pid" in note  # the restart
    report = json.loads((tmp_path / "w" / "report.json").read_text())
    assert any(n.startswith("your command left") for n in report["notes"])
    wait_for(lambda: not any(alive(p) for p in started), 10)


def test_a_sigterm_to_the_tool_ends_every_process_of_the_command_and_prints_a_partial_report(tmp_path):
    own, children, helpers = tmp_path / "own", tmp_path / "children", tmp_path / "helpers"
    cmd = [sys.executable, "-m", "ckpt_lesson", "resume-test", "--workdir", str(tmp_path / "w"),
           "--trials", "1", "--", sys.executable, FAKE, "--steps", "400", "--sleep", "0.05",
           "--pid-file", str(own),
           "--child-pid-file", str(children), "--setsid-helper", str(helpers)]  # fmt: skip
    tool = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: pids(own) and children.exists() and pids(helpers) and (tmp_path / "w").exists())
        wait_for(lambda: any((tmp_path / "w" / "baseline" / "attempt-1").glob("steps.jsonl")))
        tool.send_signal(signal.SIGTERM)
        out, err = tool.communicate(timeout=60)
    finally:
        tool.kill()
    everyone = pids(own) + [int(children.read_text())] + pids(helpers)
    assert tool.returncode == 128 + signal.SIGTERM
    assert out.startswith("resume-test: STOPPED by SIGTERM during the baseline run (exit 143)")
    assert "Traceback" not in err and "Traceback" not in out
    # The setsid helper was still the command's descendant: it ends with the job, as on a machine
    # that dies, so it is not reported as left behind (that note is for a command that ended).
    assert "left" not in out
    wait_for(lambda: not any(alive(p) for p in everyone), 10)
    assert json.loads((tmp_path / "w" / "report.json").read_text())["verdict"] == "STOPPED"


def test_a_stop_signal_during_cleanup_waits_for_the_cleanup_to_finish():
    finished = []
    with pytest.raises(Stopped) as info:
        with stop_later():
            stop_now_or_later(signal.SIGTERM)  # what the signal handler does
            finished.append(True)  # not cut short
    assert finished == [True] and info.value.signum == signal.SIGTERM
    with pytest.raises(Stopped):
        stop_now_or_later(signal.SIGHUP)  # outside such a block: at once
