"""A save's ``LEASE`` on an object store: written first, renewed while it uploads, checked before ``COMMIT``.

Why a save has a lease is told in :mod:`~ckpt_lesson.runs.store_commit`. Every writer
(:func:`~ckpt_lesson.runs.store_commit.upload_save`, and rank 0 of a multi-rank save)
holds one :class:`LeaseRenewer` from the first ``LEASE`` until just before ``COMMIT``.
It renews from a daemon thread at a third of the lease, so one long part upload (or
rank 0's DCP threads waiting for the other ranks) never lets it run out while the
writer is alive::

    t=0         LEASE expires_at = 0 + L        (written before any part)
    t=L/3       LEASE expires_at = L/3 + L      (renewed while the parts upload)
    ...
    commit      stop renewing, check the lease still runs, create COMMIT (which deletes LEASE)

A lease that ran out stays dead. When the whole process was stalled (paused,
swapped out, a frozen VM) its thread wakes as late as the upload, and a renewal
then would write a fresh ``LEASE`` into a prefix a cleaner may already have
emptied; so a renewal that starts, or lands, after the expiry it was meant to
extend marks the lease *lapsed* instead, and :meth:`LeaseRenewer.check` refuses
the commit. A process killed with SIGKILL takes the thread with it, so a dead
writer's prefix is cleaned at most ``L`` after its last renewal. A renewal that
fails (the store briefly unreachable) is logged and tried again at the next tick.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.storage import Storage
from ckpt_lesson.runs.commit import log

__all__ = ["LEASE_NAME", "LeaseRenewer"]

LEASE_NAME = "LEASE"
#: Renew when this fraction of the lease has passed: two renewals may fail before it runs out.
RENEW_FRACTION = 1 / 3


class LeaseRenewer:
    """Write ``attempt/LEASE`` now, then renew it every ``lease_seconds / 3`` until :meth:`stop`.

    Args:
        storage: The run's store.
        attempt: The save's prefix, ``step-XXXXXXXX/<save_id>``.
        lease_seconds: How long each renewal promises this writer stays alive.

    Raises:
        LoadEnvironmentError: The first ``LEASE`` could not be written (nothing
            was uploaded yet; no thread was started).

    Example:
        >>> lease = LeaseRenewer(store, "step-00000040/5be0c1", 900)  # doctest: +SKIP
        >>> ...  # the parts upload; the thread keeps the LEASE ahead of its expiry
        >>> lease.stop(); lease.check()  # doctest: +SKIP
    """

    def __init__(self, storage: Storage, attempt: str, lease_seconds: float) -> None:
        self.storage, self.attempt, self.lease_seconds = storage, attempt, float(lease_seconds)
        self.expires_at = self._write()
        #: When the lease was found run out (a renewal came too late); it is never renewed after that.
        self.lapsed_at: float | None = None
        self._stopped = threading.Event()
        # Held while a renewal is on the wire, so that stop() returns only when no PUT of the
        # LEASE can land any more: the commit deletes it next, and must not see it come back.
        self._writing = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"ckpt-lesson-lease-{attempt}", daemon=True)
        self._thread.start()

    def _write(self) -> float:
        """Write (or renew) ``attempt/LEASE``: alive until the expiry returned (``time.time()`` seconds)."""
        expires_at = time.time() + self.lease_seconds
        lease = {"writer": f"{socket.gethostname()}:{os.getpid()}", "expires_at": expires_at}
        self.storage.put_bytes(f"{self.attempt}/{LEASE_NAME}", json.dumps(lease).encode())
        return expires_at

    def _run(self) -> None:
        while not self._stopped.wait(self.lease_seconds * RENEW_FRACTION):
            with self._writing:
                if self._stopped.is_set():
                    return
                if time.time() >= self.expires_at:  # woke too late (the process was stalled)
                    self.lapsed_at = time.time()
                    return
                try:
                    renewed = self._write()
                except Exception as exc:  # a thread has nobody to raise to: check() reports the outcome
                    log.warning(
                        "%s: could not renew %s (%s); it runs until %.0f",
                        self.attempt,
                        LEASE_NAME,
                        exc,
                        self.expires_at,
                    )
                    continue
                if time.time() >= self.expires_at:  # landed after the old expiry: a cleaner may have been
                    self.lapsed_at = time.time()
                    return
                self.expires_at = renewed

    def stop(self) -> None:
        """Stop renewing; when this returns, no renewal is in flight or will start. Idempotent."""
        self._stopped.set()
        with self._writing:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join()

    def check(self) -> None:
        """Refuse to commit once the lease has run out: a cleaner may have removed objects of this save.

        Raises:
            CheckpointError: The last ``LEASE`` written has expired, or a renewal came too late.

        Example:
            >>> lease.check()  # doctest: +SKIP
        """
        now = time.time()
        if now < self.expires_at and self.lapsed_at is None:
            return
        raise CheckpointError(
            f"{self.storage.where(self.attempt)}: the {LEASE_NAME} of this save expired "
            f"{now - self.expires_at:.1f} s ago (the writer was stalled, renewals failed, or "
            f"lease_seconds={self.lease_seconds:g} is shorter than one renewal); a cleaner may have removed "
            "part of it, so it is not committed and the previous save stays the latest. Check the "
            "connection to the store (or what paused this process), raise lease_seconds, and save again."
        )
