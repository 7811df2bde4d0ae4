"""Appends staged in shared memory that the node's devices can map: no object store.

Without staging, each block of an append crosses into Ray's object store
(``ray.put``: a copy and ~3 ms of object bookkeeping for 4 MiB) before the
device copies it into its arena. With staging the gateway reads the request
body into a slot of its own shared-memory segment, hands the device a
:class:`~memkv.protocol.payload.StagedBlock` (segment, offset, length) through
the router, and the device copies the bytes from there into its arena: one
copy on each side, no object store. The slot is reused once the append has
been answered (the device has copied by then).

Only devices on the gateway's node can map the segment, so the gateway stages
an append only when its session's device is local; a device elsewhere
refuses a staged block (:class:`~memkv.errors.WrongNodeError`) and the
gateway sends that session's appends through the object store from then on.

The segment is named like a device's (``memkv-warm-gateway-stage-*``) and
held by the same lock file, so a device or writer starting on the node
reclaims it if its writer died without unlinking it.
"""

from __future__ import annotations

import logging
import mmap
import threading
import uuid
from collections.abc import Iterable
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from memkv.protocol.payload import BlockPayload, StagedBlock
from memkv.shm.ownership import SegmentOwnership, reclaim_orphans, warm_segment_name
from memkv.storage.buddy import BuddyAllocator

__all__ = [
    "CLIENT_STAGE_PREFIX",
    "STAGING_UNIT_BYTES",
    "PutStaging",
    "StagingSlot",
    "client_staging",
    "staging_for",
    "staging_node",
]

logger = logging.getLogger(__name__)

#: Allocation unit of the staging segment: an append body is rounded up to a
#: power of two of these (a 4 MiB block with its frame headers takes 8 MiB).
STAGING_UNIT_BYTES = 64 << 10


class StagingSlot:
    """One append body's space in the segment, filled front to back by its frames."""

    def __init__(self, staging: PutStaging, offset: int, nbytes: int) -> None:
        self._staging = staging
        self.offset = offset
        self.nbytes = nbytes
        self._used = 0
        self._released = False
        #: The device call reading this slot, while it runs (the slot outlives it).
        self.in_flight: Any = None

    def take(self, nbytes: int) -> memoryview | None:
        """The next ``nbytes`` of the slot, writable (None: the slot is full)."""
        if self._released or self._used + nbytes > self.nbytes:
            return None
        start = self.offset + self._used
        self._used += nbytes
        return self._staging.array[start : start + nbytes].data

    def release(self) -> None:
        """Give the space back (idempotent). Only once no reader needs the bytes."""
        if not self._released:
            self._released = True
            self._staging.free(self.offset)


#: Names of the segments clients stage their appends in (:func:`client_staging`).
CLIENT_STAGE_PREFIX = warm_segment_name("client-stage-")


class PutStaging:
    """A staging segment (the gateway's, or a same-host client's) and its allocator.

    Args:
        capacity_bytes: segment size; appends beyond what is free go through
            the object store instead (never wait for space).
        role: the segment's name before its incarnation.
    """

    def __init__(self, capacity_bytes: int, role: str = "gateway-stage") -> None:
        reclaim_orphans()  # segments of writers that died without unlinking them
        # A client's segment name is a capability (a gateway reads the blocks an
        # append names in it): long enough not to be guessed from another host.
        self.incarnation = uuid.uuid4().hex if role == "client-stage" else uuid.uuid4().hex[:12]
        self.segment = warm_segment_name(f"{role}-{self.incarnation}")
        self._ownership = SegmentOwnership(self.segment)
        self._shm = SharedMemory(name=self.segment, create=True, size=capacity_bytes)
        self.array = np.ndarray((capacity_bytes,), dtype=np.uint8, buffer=self._shm.buf)
        self._base = self.array.ctypes.data
        self._buddy = BuddyAllocator(capacity_bytes, STAGING_UNIT_BYTES)
        self._lock = threading.Lock()
        self.capacity_bytes = capacity_bytes
        self.staged_bytes = 0  # appended bytes that went through staging, for stats

    def prefault(self) -> None:
        """Touch every page now, so the first append into it pays no page faults."""
        self.array[:: mmap.PAGESIZE] = 0

    def lease(self, nbytes: int) -> StagingSlot | None:
        """Space for a body of ``nbytes``, or None when there is not that much free."""
        if nbytes <= 0 or nbytes > self._buddy.max_alloc_bytes:
            return None
        with self._lock:
            offset = self._buddy.alloc(nbytes)
        return None if offset is None else StagingSlot(self, offset, nbytes)

    def free(self, offset: int) -> None:
        with self._lock:
            self._buddy.free(offset)

    def offset_of(self, array: np.ndarray) -> int:
        """Where ``array`` (a view of this segment) starts in it."""
        offset = int(array.ctypes.data) - self._base
        if not 0 <= offset <= self.capacity_bytes - array.nbytes:
            raise ValueError("the array is not a view of the staging segment")
        return offset

    def describe(self, payloads: Iterable[BlockPayload], node_id: str) -> list[StagedBlock] | None:
        """What a device needs to copy ``payloads`` out of this segment; None where one
        of them is not in it (read into a buffer of its own)."""
        out = []
        for p in payloads:
            try:
                offset = self.offset_of(p.data)
            except ValueError:
                return None
            out.append(StagedBlock(p.key, p.dtype, tuple(p.data.shape), self.segment,
                                   self.capacity_bytes, self.incarnation, offset, p.nbytes,
                                   node_id))
        return out

    def close(self) -> None:
        """Unmap and unlink the segment (after every append has been answered)."""
        del self.array
        self._shm.close()
        self._shm.unlink()
        self._ownership.release()


def client_staging(capacity_bytes: int) -> PutStaging | None:
    """A staging segment for a client on a gateway's host (:mod:`memkv.client`): its
    appends then name blocks in it instead of sending their bytes. None where
    shared memory is not to be had."""
    units = -(-max(capacity_bytes, 1) // STAGING_UNIT_BYTES)
    try:
        return PutStaging(units * STAGING_UNIT_BYTES, role="client-stage")
    except OSError as e:  # /dev/shm too small or absent
        logger.warning("no client staging (%s): appends send their blocks' bytes", e)
        return None


def staging_node() -> str:
    """This process's Ray node: only devices there can map its staging segment."""
    import ray

    return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else ""


def staging_for(devices: Iterable[Any], nbytes: int, role: str = "gateway-stage"
                ) -> PutStaging | None:
    """A staging segment of ``nbytes`` when one of ``devices`` runs on this node, else
    None: nothing elsewhere could map it. ``devices``: what answers ``node()`` with an
    answer to take (``memkv.actors.handles``' reader or member handles)."""
    if nbytes <= 0:
        return None
    import ray

    if not ray.is_initialized():
        return None
    handles = list(devices)
    if not handles or staging_node() not in [answer.result() for answer in
                                              [d.node() for d in handles]]:
        return None
    try:
        return PutStaging(nbytes, role=role)
    except OSError as e:  # /dev/shm too small or absent
        logger.warning("no append staging (%s): appends go through Ray's object store", e)
        return None
