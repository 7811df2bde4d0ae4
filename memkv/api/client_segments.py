"""Blocks a same-host client staged in its own shared memory, as the gateway sees them.

A client on the gateway's host (a vLLM engine saving its KV) writes each block
once, from its paged cache into its staging segment (:func:`memkv.shm.staging.client_staging`),
and its append names the bytes (``staged``: segment, offset) instead of sending
them. The gateway maps the segment read-only, checks each block's key and
CRC32 there as it checks a sent block, and hands the device a
:class:`~memkv.protocol.payload.StagedBlock`: the device copies the bytes into
its arena. The client reuses the space once the append is answered.

Only segments named like a client's are read: a staged block can never name a
device's pool or another gateway's staging. A client's segment name carries
128 random bits, so a client on another host cannot name one; a client on
this host can read ``/dev/shm`` anyway, which is why same-host paths are for
hosts whose processes are trusted (as same-node reads are). A segment that is
not on this host answers :class:`~memkv.errors.WrongNodeError`: the client
sends the bytes instead.

A block may also name a slot of a device's own segment that the device reserved
for this client (a write reservation, ``staged.reservation``): the gateway
checks it as any staged block, and the device adopts the slot as the block's
copy, after checking that the slot is one the reservation holds.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

from memkv.errors import WrongNodeError
from memkv.periodic import Periodic
from memkv.protocol.payload import StagedBlock
from memkv.protocol.wire import WireError
from memkv.shm.ownership import warm_segment_name
from memkv.shm.same_node import SegmentMaps
from memkv.shm.staging import CLIENT_STAGE_PREFIX

__all__ = ["ClientSegments"]

_SHM_DIR = "/dev/shm"
#: How often mappings of segments that went away are let go (on the next staged block).
PRUNE_INTERVAL_S = 10.0
#: Every segment a device (or a staging) of memkv makes is named under this.
DEVICE_SEGMENT_PREFIX = warm_segment_name("")


class ClientSegments:
    """Read-only mappings of the client staging segments appends name."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._maps = SegmentMaps()
        self._clock = clock
        self._pruned_at = clock()
        # An idle gateway lets go too (the last engine's saves may be the last appends).
        self._pruning = Periodic(self._prune_round, PRUNE_INTERVAL_S, "client segment pruning")

    def __len__(self) -> int:
        """Segments mapped now."""
        return len(self._maps)

    def prune(self) -> int:
        """Let go of the mappings of segments whose client went (the file is gone, or was
        made again): a mapping would keep a dead engine's 1 GiB of staging alive."""
        self._pruned_at = self._clock()
        return self._maps.prune(lambda name, incarnation: self._incarnation(name) == incarnation)

    async def _prune_round(self) -> None:
        if self._clock() - self._pruned_at >= PRUNE_INTERVAL_S:
            self.prune()

    def resolver(self, reservation: str) -> Callable[[str, int, int], memoryview]:
        """How a block staged under ``reservation`` ("": none) is found: in a client's
        staging segment, or (with a reservation) in a device's, in a slot the device
        reserved, which the device checks against the reservation when it adopts it."""
        if not reservation:
            return self.resolve
        return functools.partial(self.resolve, device_slot=True)

    def resolve(self, segment: str, offset: int, nbytes: int,
                device_slot: bool = False) -> memoryview:
        """The ``nbytes`` at ``offset`` of client segment ``segment`` (``device_slot``: of
        a device's segment, the bytes a write reservation's slot holds).

        Raises:
            WireError: not a client staging segment's name (a device's, for a slot),
                or bytes outside it.
            WrongNodeError: no such segment on this host.
        """
        if device_slot:
            if not segment.startswith(DEVICE_SEGMENT_PREFIX) \
                    or segment.startswith(CLIENT_STAGE_PREFIX) or "/" in segment:
                raise WireError(f"a reserved slot must lie in a device's segment "
                                f"({DEVICE_SEGMENT_PREFIX}*), got {segment!r:.120}")
        elif not segment.startswith(CLIENT_STAGE_PREFIX) or "/" in segment:
            raise WireError(f"a staged block must name a client staging segment "
                            f"({CLIENT_STAGE_PREFIX}*), got {segment!r:.120}")
        if self._clock() - self._pruned_at >= PRUNE_INTERVAL_S:
            self.prune()
        size, incarnation = self._describe(segment)
        if offset + nbytes > size:
            raise WireError(f"staged bytes {offset}+{nbytes} lie outside segment {segment!r} "
                            f"of {size} bytes")
        view = self._maps.view(segment, size, incarnation)
        self._start_pruning()
        return view[offset : offset + nbytes].data

    def _start_pruning(self) -> None:
        try:
            self._pruning.ensure_running()
        except RuntimeError:
            pass  # no event loop in this thread: pruned on the next blocks instead

    def staged_block(self, key: bytes, dtype: str, shape: tuple[int, ...], segment: str,
                     offset: int, nbytes: int, node_id: str,
                     reservation: str = "") -> StagedBlock:
        """What a device on this node needs to copy the block out of the segment (or,
        with a ``reservation``, to adopt its own slot)."""
        size, incarnation = self._describe(segment)
        return StagedBlock(key, dtype, shape, segment, size, incarnation, offset, nbytes,
                           node_id, reservation)

    @staticmethod
    def _stat(segment: str) -> os.stat_result | None:
        try:
            return os.stat(os.path.join(_SHM_DIR, segment))
        except FileNotFoundError:
            return None

    def _incarnation(self, segment: str) -> str | None:
        # The inode tells a segment created again under the same name from the one mapped.
        stat = self._stat(segment)
        return None if stat is None else f"{stat.st_ino}"

    def _describe(self, segment: str) -> tuple[int, str]:
        stat = self._stat(segment)
        if stat is None:
            raise WrongNodeError(f"staging segment {segment!r} is not on this gateway's host: "
                                 "send the blocks' bytes")
        return stat.st_size, f"{stat.st_ino}"

    def close(self) -> None:
        self._pruning.cancel()
        self._maps.close()
