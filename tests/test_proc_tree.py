"""Finding the processes a command started in sessions of their own, and signalling only those."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ckpt_lesson.resume_test.proc_tree import ProcessTree, descendants

# A parent that starts a child in a new session (as torchrun starts its workers), prints the
# child's pid, and waits.
PARENT = (
    "import subprocess, sys, time\n"
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
    "print(c.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def start_parent():
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, start_new_session=True)
    child = int(proc.stdout.readline())
    return proc, child


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_child_in_its_own_session_is_a_descendant_and_survives_a_kill_of_the_group_alone():
    proc, child = start_parent()
    try:
        assert child in descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert alive(child)  # the orphan trains on: what resume-test must not allow
    finally:
        os.kill(child, signal.SIGKILL)


def test_the_tree_kills_the_child_outside_the_group_after_the_group_is_gone():
    proc, child = start_parent()
    try:
        tree = ProcessTree(proc.pid)
        tree.refresh()
        assert list(tree.known) == [child]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert tree.signal(signal.SIGKILL) == [child]
        for _ in range(200):
            if not alive(child):
                break
            time.sleep(0.01)
        assert not alive(child)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_the_tree_leaves_members_of_the_group_to_the_group_signal():
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); print(1, flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        proc.stdout.readline()
        tree = ProcessTree(proc.pid)
        tree.refresh()
        assert descendants(proc.pid) and tree.known == {}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_known_pid_that_now_names_another_process_is_not_signalled():
    tree = ProcessTree(os.getpid())
    tree.known = {os.getpid(): "not-a-start-time"}
    assert tree.signal(signal.SIGKILL) == []
