"""``chaos --store URL --ranks 2``: SIGKILL ranks of multi-rank saves to a bucket (moto server, 2 gloo ranks).

The campaign runs in a child process that finds the bucket through the
``AWS_*`` environment, as on a training machine: its ranks are forked from a
forkserver that child starts, so they inherit that environment too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _s3_server import Bucket

from ckpt_lesson import cli

_CAMPAIGN = """
import json, sys
from ckpt_lesson.faults.rank_chaos import RankKill, run_rank_campaign
kills = [
    RankKill("before_publish", "others", publish="marker"),  # rank 0 commits alone: the save survives
    RankKill("before_publish", "all", publish="marker"),  # manifest uploaded, no COMMIT: step 2
]
result = run_rank_campaign(kills, world=2, workdir=sys.argv[1], store=sys.argv[2], keep=True)
print(json.dumps({"ok": result.ok, "table": result.table(),
                  "chosen": [[r.get("step") for r in o.restored] for o in result.outcomes],
                  "predicted": [o.predicted for o in result.outcomes]}))
"""


def _child(bucket: Bucket, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **bucket.env(), "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=240)


def test_killing_ranks_saving_to_a_bucket_before_and_after_the_commit_marker_gives_no_wrong_choice(
    s3_bucket: Bucket, tmp_path
) -> None:
    url = s3_bucket.url("rank-chaos")
    done = _child(s3_bucket, "-c", _CAMPAIGN, str(tmp_path), url)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["predicted"] == [4, 2]
    assert found["chosen"] == [[4, 4], [2, 2]], found["table"]
    assert found["ok"], found["table"]
    assert f"saves went to           {url} (local folders were scratch)" in found["table"]
    # The dead writers' upload (manifest and all) was there, with no COMMIT naming it, until the
    # restoring manager found its lease expired and removed it.
    [root] = tmp_path.glob("ckpt-rank-chaos-*")
    killed = json.loads((root / "run-0001" / "restored-rank0.json").read_text())
    assert [name.startswith(".uncommitted-step-00000004-") for name in killed["staging_before"]] == [True]
    assert killed["staging_after"] == []
    keys = s3_bucket.fs().find(f"{s3_bucket.name}/rank-chaos/run-0001")
    assert keys and not any("/step-00000004/" in k for k in keys)  # kept (keep=True), step 4 all gone


def test_the_chaos_command_runs_ranks_against_a_bucket_and_removes_what_it_wrote(s3_bucket: Bucket) -> None:
    url = s3_bucket.url("cli-chaos")
    done = _child(s3_bucket, "-m", "ckpt_lesson", "chaos", "--store", url, "--ranks", "2", "--kills", "1")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert ["wrong", "choices", "0"] in lines and ["verdict", "PASS"] in lines
    assert s3_bucket.fs().find(f"{s3_bucket.name}/cli-chaos") == []


def test_chaos_store_with_ranks_refuses_publish_by_rename_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["chaos", "--store", "s3://bucket/run", "--ranks", "2", "--publish", "rename"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a bucket has no atomic rename" in err
