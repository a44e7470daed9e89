"""Source text prepended to a child's training script: the n-th ``torch.save`` writes 4 KiB, then SIGKILL.

Shared by the Lightning and Hugging Face integration tests, whose children run a real
trainer; the save to kill is ``sys.argv[2]`` (1-based). A path target is opened and
truncated first, as ``torch.save`` itself would, so a stock writer is torn the same way.
"""

KILL_PATCH = r"""
import os, signal, sys
import torch
_save, calls, kill_at = torch.save, [0], int(sys.argv[2])

class KillMidWrite:
    def __init__(self, f):
        self.f, self.n = f, 0
    def write(self, data):
        self.f.write(data)
        self.n += memoryview(data).nbytes
        if self.n >= 4096:
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return memoryview(data).nbytes
    def flush(self):
        self.f.flush()

def save(obj, f, *a, **k):
    calls[0] += 1
    if calls[0] == kill_at:
        f = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f  # torch.save truncates the same way
        f = KillMidWrite(f)
    return _save(obj, f, *a, **k)

torch.save = save
"""
