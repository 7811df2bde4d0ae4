"""Leases on pinned blocks: a reader copies them out of shared memory until it lets go.

A plain class embedded in the device actor. A lease pins its blocks in the
store; it ends when the reader releases it or when its time runs out (a
reader that died must not pin memory for ever). Expired leases are swept on
every grant and release, so no timer thread is needed.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Lease", "LeaseTable"]


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    keys: tuple[bytes, ...]
    expires_at: float
    #: Who may release it (a client's tenant); None: whoever holds the id.
    owner: str | None = None


class LeaseTable:
    """Leases by id.

    Args:
        unpin: called with a lease's keys when it ends (released or expired).
        clock: monotonic seconds (a fake in tests).
    """

    def __init__(
        self,
        unpin: Callable[[Sequence[bytes]], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._unpin = unpin
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.granted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, keys: Sequence[bytes], ttl_s: float, owner: str | None = None) -> Lease:
        """A new lease on ``keys`` (already pinned by the caller) for ``ttl_s`` seconds.

        ``owner``: only a release naming the same owner ends it (a client lease
        is released through any gateway worker, each checking its caller's tenant).
        """
        self.sweep()
        lease = Lease(uuid.uuid4().hex, tuple(keys), self._clock() + ttl_s, owner)
        with self._lock:
            self._leases[lease.lease_id] = lease
            self.granted += 1
        return lease

    def release(self, lease_id: str, owner: str | None = None) -> bool:
        """End a lease. True if it was still valid; False if it had expired (or never was).

        A reader that gets False must discard what it copied: the blocks may
        have moved while it read. A lease with an owner is released only by
        that owner: for anyone else it answers False and stays.
        """
        now = self._clock()
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.owner is not None and lease.owner != owner:
                lease = None  # another tenant's lease is as unknown as a missing one
            if lease is not None:
                del self._leases[lease_id]
        if lease is None:
            self.sweep()
            return False
        self._unpin(lease.keys)
        valid = now <= lease.expires_at
        if not valid:
            self.expired += 1
        self.sweep()
        return valid

    def sweep(self) -> int:
        """Unpin every lease whose time has run out. Returns how many."""
        now = self._clock()
        with self._lock:
            gone = [lease for lease in self._leases.values() if now > lease.expires_at]
            for lease in gone:
                del self._leases[lease.lease_id]
        for lease in gone:
            self._unpin(lease.keys)
        self.expired += len(gone)
        return len(gone)
