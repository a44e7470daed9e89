"""Keep a multi-rank save's ``LEASE`` alive while its ranks upload (rank 0, one small thread).

A cleaner removes an uncommitted ``step-XXXXXXXX/<save_id>/`` prefix once the
``LEASE`` inside has expired: on an object store that is the only sign that its
writer is gone. The single-process writer renews its lease between parts
(:func:`ckpt_lesson.runs.store_commit.upload_save`); a multi-rank save has no
such moment on rank 0, whose DCP threads may wait for minutes while other ranks
upload. So rank 0 renews from a daemon thread, at a third of the lease, from
the first ``LEASE`` until just before ``COMMIT``::

    t=0         LEASE expires_at = 0 + L        (written before any rank starts)
    t=L/3       LEASE expires_at = L/3 + L      (renewed while the ranks upload)
    ...
    commit      stop renewing, check the lease still runs, create COMMIT (which deletes LEASE)

A process killed with SIGKILL takes the thread with it, so the lease of a dead
writer expires at most ``L`` after its last renewal, and its prefix is cleaned
then. A renewal that fails (the store is briefly unreachable) is logged and
tried again; if the lease ran out meanwhile, a cleaner may have removed part of
the upload, so the commit is refused rather than publishing a save with holes.
"""

from __future__ import annotations

import logging
import threading
import time

from ckpt_lesson.errors import CheckpointError
from ckpt_lesson.files.storage import Storage
from ckpt_lesson.runs.store_commit import LEASE_NAME, write_lease

__all__ = ["LeaseRenewer"]

log = logging.getLogger("ckpt_lesson.distributed")

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
        >>> ...  # the ranks upload; the thread keeps the LEASE ahead of its expiry
        >>> lease.stop(); lease.check()  # doctest: +SKIP
    """

    def __init__(self, storage: Storage, attempt: str, lease_seconds: float) -> None:
        self.storage, self.attempt, self.lease_seconds = storage, attempt, float(lease_seconds)
        self.expires_at = write_lease(storage, attempt, self.lease_seconds)
        self._stopped = threading.Event()
        # Held while a renewal is on the wire, so that stop() returns only when no PUT of the
        # LEASE can land any more: commit_attempt deletes it next, and must not see it come back.
        self._writing = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"ckpt-lesson-lease-{attempt}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.lease_seconds * RENEW_FRACTION):
            with self._writing:
                if self._stopped.is_set():
                    return
                try:
                    self.expires_at = write_lease(self.storage, self.attempt, self.lease_seconds)
                except Exception as exc:  # a thread has nobody to raise to: check() reports the outcome
                    log.warning(
                        "%s: could not renew %s (%s); it runs until %.0f",
                        self.attempt,
                        LEASE_NAME,
                        exc,
                        self.expires_at,
                    )

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
            CheckpointError: The last ``LEASE`` written has expired.

        Example:
            >>> lease.check()  # doctest: +SKIP
        """
        late = time.time() - self.expires_at
        if late >= 0:
            raise CheckpointError(
                f"{self.storage.where(self.attempt)}: the {LEASE_NAME} of this save expired {late:.1f} s ago "
                f"(renewals failed, or lease_seconds={self.lease_seconds:g} is shorter than one renewal); "
                "a cleaner may have removed part of it, so it is not committed. Check the connection to "
                "the store, or raise lease_seconds, and save again."
            )
