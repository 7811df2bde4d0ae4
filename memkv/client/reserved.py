"""Write reservations, as a client on the gateway's host uses them.

``Client.reserve_slots`` asks the session's device for block-sized slots of its
shared memory; the client copies its blocks straight into them (a vLLM
engine: out of its paged cache) and names them in its append; the device keeps
the bytes where they are. One copy in all, where staging costs two (into the
client's segment, then the device's copy into its own memory).

A device's segment is mapped once per client, writable, its page tables
populated up front (``MAP_POPULATE``): a slot written for the first time then
costs no page faults in the writer.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["DeviceSegments", "SlotReservation", "parse_reservation", "reservation_body"]

_SHM_DIR = "/dev/shm"
#: A reservation is not written into once less than this is left of it: the
#: device gives its slots back when it runs out, and a late write would land on
#: another block's space (detected by that block's checksum, but lost).
WRITE_MARGIN_S = 5.0


class DeviceSegments:
    """Writable mappings of device segments, by name and inode (a device that restarts
    makes a new segment under the same name: its old mapping is dropped)."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[int, mmap.mmap, np.ndarray]] = {}
        self._lock = threading.Lock()

    def view(self, segment: str, nbytes: int) -> np.ndarray:
        """The whole segment as a writable uint8 array.

        Raises:
            FileNotFoundError: no such segment on this host.
            ValueError: an invalid name, or a segment smaller than ``nbytes``.
        """
        if "/" in segment or segment in ("", ".", ".."):
            raise ValueError(f"invalid segment name {segment!r}")
        path = os.path.join(_SHM_DIR, segment)
        inode = os.stat(path).st_ino
        with self._lock:
            cached = self._maps.get(segment)
            if cached is not None and cached[0] == inode and cached[2].size >= nbytes:
                return cached[2]
            fd = os.open(path, os.O_RDWR)
            try:
                if os.fstat(fd).st_size < nbytes:
                    raise ValueError(f"segment {segment!r} is smaller than {nbytes} bytes")
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mapped = mmap.mmap(fd, nbytes, flags=flags)
            finally:
                os.close(fd)
            array = np.frombuffer(mapped, dtype=np.uint8)
            self._maps[segment] = (inode, mapped, array)
            return array

    def close(self) -> None:
        with self._lock:
            self._maps.clear()  # each mapping closes once no array views it


@dataclass(frozen=True)
class SlotReservation:
    """Slots a device reserved for this client's next append of a session.

    ``slots[i]`` is where block i goes (a writable uint8 view of ``slot_bytes``);
    an append whose blocks are views of them names them instead of sending them.
    """

    reservation_id: str
    segment: str
    offsets: tuple[int, ...]
    slot_bytes: int
    expires_at: float  # time.monotonic()
    array: np.ndarray  # the device's whole segment, writable

    @classmethod
    def from_json(cls, doc: dict[str, Any], segments: DeviceSegments) -> SlotReservation:
        started = time.monotonic()
        array = segments.view(str(doc["segment"]), int(doc["segment_bytes"]))
        offsets = tuple(int(o) for o in doc["offsets"])
        slot_bytes = int(doc["slot_bytes"])
        if any(o < 0 or o + slot_bytes > array.size for o in offsets):
            raise ValueError("a reserved slot lies outside its segment")
        return cls(str(doc["id"]), str(doc["segment"]), offsets, slot_bytes,
                   started + float(doc["ttl_s"]), array)

    @property
    def writable(self) -> bool:
        """Whether there is time left to fill the slots (see ``WRITE_MARGIN_S``)."""
        return time.monotonic() < self.expires_at - WRITE_MARGIN_S

    def slot(self, i: int) -> np.ndarray:
        """Slot ``i``, writable (``slot_bytes`` long)."""
        return self.array[self.offsets[i] : self.offsets[i] + self.slot_bytes]

    def run(self) -> np.ndarray | None:
        """Every slot as one view, where they lie back to back in order (one copy per
        run of blocks fills them); None where they do not."""
        first = self.offsets[0]
        if self.offsets != tuple(range(first, first + len(self.offsets) * self.slot_bytes,
                                       self.slot_bytes)):
            return None
        return self.array[first : first + len(self.offsets) * self.slot_bytes]

    def staged_ref(self, array: np.ndarray) -> dict[str, Any] | None:
        """How an append names ``array`` when it starts at one of the slots (None: not)."""
        if not array.flags.c_contiguous or array.nbytes > self.slot_bytes:
            return None
        offset = int(array.ctypes.data) - int(self.array.ctypes.data)
        if offset not in self.offsets:
            return None
        return {"segment": self.segment, "offset": offset, "reservation": self.reservation_id}


def reservation_body(blocks: int, tokens: Sequence[int] | None, ttl_s: float) -> dict[str, Any]:
    """The JSON of ``POST /v1/sessions/{id}/reservations``."""
    body: dict[str, Any] = {"blocks": blocks, "ttl_s": ttl_s}
    if tokens is not None:
        body["tokens"] = [int(t) for t in tokens]
    return body


def parse_reservation(doc: dict[str, Any], segments: DeviceSegments) -> SlotReservation | None:
    """The gateway's answer as a reservation this process can write into (None: none was
    made, or it is of another host, or its segment cannot be mapped here)."""
    from memkv.shm.same_node import shm_identity

    if not doc.get("id"):
        logger.debug("no write reservation: %s", doc.get("reason"))
        return None
    if doc.get("host") != shm_identity():
        return None  # let it run out: its slots are of no use here
    try:
        return SlotReservation.from_json(doc, segments)
    except (OSError, KeyError, TypeError, ValueError) as e:
        logger.info("memkv write reservation unusable (%s): staging instead", e)
        return None
