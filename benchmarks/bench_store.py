"""What the object-store protocol costs over a plain s3fs upload and download of the same bytes.

Run from the repository root::

    python benchmarks/bench_store.py              # a 32 MiB checkpoint, 5 rounds
    python benchmarks/bench_store.py --mib 256 --rounds 7

A local moto S3 server (``python -m moto.server`` on 127.0.0.1, its own process) serves both sides,
so the network is the loopback and the ratio isolates our overhead: lease,
hashing while streaming, digest check, manifest and the conditional ``COMMIT``
on the way up; marker and manifest checks, concurrent ranged GETs hashed in
order, and either the write to a local cache folder (``fetch_verified``, what
a restore through the manager did before it kept parts in memory) or nothing
but memory (``read_verified``) on the way down. The baseline is
``fs.put_file`` / ``fs.cat_file`` of the same ``checkpoint.pt`` (``cat_file``
already fetches a large object as concurrent ranges).

The last row is the whole restore a user calls: ``restore_latest`` on a
``StoreCheckpointManager`` (listing, marker, manifest, the verified download
into memory, the resume contract, the archive checks and the weights-only
load, applied to a model and optimizer) against ``cat_file`` +
``torch.load(weights_only=True)`` + ``load_state_dict`` of the same bytes.
Each round runs every case, in rotating order, on fresh keys. Prints a
markdown table with the machine and the load average.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import s3fs
import torch

from ckpt_lesson.files.storage_fsspec import FsspecStorage
from ckpt_lesson.runs.manager import CheckpointManager, StoreCheckpointManager
from ckpt_lesson.runs.store_commit import upload_save
from ckpt_lesson.runs.store_restore import fetch_verified, read_verified


def _live(mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of about ``mib`` MiB and its optimizer: what is saved, and what a restore fills."""
    model = torch.nn.Linear(1024, mib * 256, bias=False)  # 1024 * 256 float32 = 1 MiB per unit
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _stage(folder: Path, mib: int) -> Path:
    """One real local save (CheckpointManager protocol) of a model of about ``mib`` MiB."""
    from ckpt_lesson.files.checkpoint import TrainState

    model, opt = _live(mib)
    with CheckpointManager(folder, every_steps=1, keep_last=1000) as mgr:
        return Path(mgr.save(model, opt, None, TrainState(step=1)))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(host: str, port: int, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"moto server did not start on {host}:{port} within {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    host, port = "127.0.0.1", _free_port()
    # Its own process, as a real store is another machine: in-process, the server's threads would
    # compete with the client for the GIL and tax whichever side does more Python work.
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for(host, port)
    options = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
    fs = s3fs.S3FileSystem(**options)
    fs.call_s3("create_bucket", Bucket="bench")
    work = Path(tempfile.mkdtemp(prefix="bench-store-"))
    try:
        local = _stage(work / "run", args.mib)
        part = local / "checkpoint.pt"
        size = part.stat().st_size
        names = ("put_file", "upload+commit", "cat_file", "fetch+verify", "read_verified")
        names += ("cat+load", "restore_latest")
        model, opt = _live(args.mib)
        times: dict[str, list[float]] = {k: [] for k in names}
        for round_ in range(args.rounds):
            prefix = f"bench/r{round_}-{uuid.uuid4().hex[:8]}"
            store = FsspecStorage(f"s3://{prefix}", options)

            def ours_up(store: FsspecStorage = store) -> None:
                upload_save(store, local, 1, algo="xxh3_128", lease_seconds=600)

            def plain_up(prefix: str = prefix) -> None:
                fs.put_file(str(part), f"{prefix}/plain/checkpoint.pt")

            def ours_down(store: FsspecStorage = store, round_: int = round_) -> None:
                fetch_verified(store, 1, work / f"cache-{round_}")

            def plain_down(prefix: str = prefix) -> None:
                fs.cat_file(f"{prefix}/plain/checkpoint.pt")

            def ours_memory(store: FsspecStorage = store) -> None:
                read_verified(store, 1)

            # Built before the clock starts: its start-up (bucket checks, cleaning) is not the restore.
            mgr = StoreCheckpointManager(f"s3://{prefix}", storage_options=options, every_steps=1)

            def ours_restore(mgr: StoreCheckpointManager = mgr) -> None:
                if mgr.restore_latest(model, opt, None) is None:  # a timing of nothing would flatter us
                    raise SystemExit(f"restore_latest found no committed save under {mgr.url}")

            def plain_restore(prefix: str = prefix) -> None:
                data = fs.cat_file(f"{prefix}/plain/checkpoint.pt")
                payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                model.load_state_dict(payload["model"])
                opt.load_state_dict(payload["optimizer"])

            down = [("fetch+verify", ours_down), ("cat_file", plain_down), ("read_verified", ours_memory)]
            restore = [("restore_latest", ours_restore), ("cat+load", plain_restore)]
            groups = [[("upload+commit", ours_up), ("put_file", plain_up)], down, restore]
            for group in groups:
                shift = round_ % len(group)
                for name, fn in group[shift:] + group[:shift]:  # interleaved, rotating order
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            mgr.close()
            shutil.rmtree(work / f"cache-{round_}", ignore_errors=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"machine: {platform.node()} ({platform.machine()}, {os.cpu_count()} cores), "
              f"load average {os.getloadavg()[0]:.2f}; moto server process on the loopback")  # fmt: skip
        print(f"checkpoint.pt: {size / 2**20:.1f} MiB; {args.rounds} interleaved rounds; medians\n")
        print("| direction | plain s3fs | ours | ratio |")
        print("|---|---|---|---|")
        rows = (("up", "put_file", "upload+commit"), ("down, to a cache folder", "cat_file", "fetch+verify"),
                ("down, into memory", "cat_file", "read_verified"),
                ("restore_latest (down into memory + load)", "cat+load", "restore_latest"))  # fmt: skip
        for label, plain, ours in rows:
            ratio = med[ours] / med[plain]
            print(f"| {label} | {med[plain]:.3f} s ({plain}) | {med[ours]:.3f} s ({ours}) | {ratio:.2f}x |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
