"""Draining a device that is leaving: its sessions move to the others with nothing lost.

A node is about to go (a KubeRay scale-down, maintenance): before it does,
every session of its devices must be served from elsewhere. For each device:

1. It stops taking new sessions (placement skips it).
2. Every block it holds only in memory gets a durable cold copy, on
   ``archive.replicas`` archives (``archive_held``, in batches; reads go on
   from the memory copies meanwhile).
3. Session by session, under the session's append lock (no turn lands
   half-moved): blocks appended since step 2 are archived too, another device
   adopts the chain from the archives, the table moves the session there (a
   read asks for its route again and finds the new device), and the leaving
   device lets go of its references.
4. The device is retired: forgotten by the table, so nothing is ever placed on
   it again; its node may go.

A session whose blocks the archives lack after step 3 keeps its longest
prefix (reported as lost tokens): with every block archived first, that
happens only when an archive dies during the drain.
"""

from __future__ import annotations

import logging
import time

from memkv.errors import ConflictError, InvalidInputError, MemberGoneError
from memkv.protocol.layout import block_token_count
from memkv.protocol.stats import DrainReport
from memkv.storage.router.appends import Appends
from memkv.storage.router.members import Members
from memkv.storage.router.state import RouterState

__all__ = ["DRAIN_BATCH_BLOCKS", "DrainReport", "Drainer"]

logger = logging.getLogger(__name__)

#: Blocks archived per device call while draining (each call is fsynced).
DRAIN_BATCH_BLOCKS = 256
#: Devices tried for one session before the drain gives up (each that fails is
#: recovered or forgotten first).
TARGET_ATTEMPTS = 3


class Drainer:
    """Drains devices of one router shard's table."""

    def __init__(self, state: RouterState, members: Members, appends: Appends) -> None:
        self.state = state
        self.members = members
        self.appends = appends

    async def drain(self, device_id: str) -> DrainReport:
        """Move every session of ``device_id`` to the other devices, then retire it.

        Raises:
            InvalidInputError: no such device.
            ConflictError: no other device could take its sessions.
        """
        if device_id not in self.members.devices:
            if device_id in self.members.lost:
                raise InvalidInputError(f"device {device_id} is already gone "
                                        f"({self.members.lost[device_id]})")
            raise InvalidInputError(f"unknown device {device_id!r}")
        if not self._takers(device_id):
            raise ConflictError(f"device {device_id} is the only one left: no device could "
                                f"take its sessions (add one, then drain)")
        started = time.monotonic()
        self.state.set_draining(device_id)
        device = self.members.devices[device_id]
        archived = await self._archive_all(device_id)
        moved = lost = tokens_lost = nbytes = 0
        moved_to: dict[str, int] = {}
        for record in self.state.sessions_on(device_id):
            async with self.appends.holding(record.session_id):
                current = self.state.sessions.lookup(record.session_id)
                if current is None or current.device_id != device_id:
                    continue  # deleted, or moved, meanwhile
                if not current.chain or current.lost:
                    self.state.move(current.session_id, self._target(device_id))
                    continue
                archived += await self._archive_all(device_id)
                tokens = current.tokens
                chain, active = list(current.chain), current.active
                reason = f"its device {device_id} was drained and the archive lacks some blocks"
                for attempt in range(TARGET_ATTEMPTS):
                    target = self._target(device_id)
                    try:
                        served = await self.members.serve_what_survives(
                            self.members.devices[target], current, reason)
                        break
                    except MemberGoneError:
                        # The device it was moving to died: the router recovers it (a
                        # restart) or forgets it (its node is gone), and the session
                        # goes to the device that is then the emptiest.
                        logger.warning("drain of %s: target %s failed (attempt %d)",
                                       device_id, target, attempt + 1)
                        await self.members.check(target, force=True)
                else:
                    raise ConflictError(
                        f"drain of {device_id}: session {current.session_id!r} found no "
                        f"device to move to in {TARGET_ATTEMPTS} attempts; it stays here")
                if not served:
                    lost += 1
                    continue
                tokens_lost += tokens - current.tokens
                self.state.move(current.session_id, target)
                moved += 1
                moved_to[target] = moved_to.get(target, 0) + 1
                nbytes += sum(current.layout.block_nbytes(n) for n in
                              block_token_count(current.layout, current.tokens))
                try:
                    await device.release(chain, active, self.members.owner)
                except MemberGoneError:
                    pass  # gone meanwhile: its references went with it
        self.members.retire(device_id, "drained")
        report = DrainReport(device=device_id, sessions_moved=moved, sessions_lost=lost,
                             tokens_lost=tokens_lost, blocks_archived=archived,
                             bytes_moved=nbytes, seconds=round(time.monotonic() - started, 3),
                             moved_to=moved_to)
        logger.warning("drained device %s: %s", device_id, report)
        return report

    def _takers(self, device_id: str) -> list[str]:
        return [d for d in self.members.devices if d != device_id and self.state.is_live(d)]

    def _target(self, device_id: str) -> str:
        """The device with the fewest sessions that may take one.

        Raises:
            ConflictError: none is left (every other device died meanwhile).
        """
        takers = self._takers(device_id)
        if not takers:
            raise ConflictError(f"no device is left to take the sessions of {device_id}")
        return min(takers, key=lambda d: (self.state.devices[d].sessions, d))

    async def _archive_all(self, device_id: str) -> int:
        """Archive every block the device holds only in memory; returns how many."""
        device = self.members.devices[device_id]
        total = 0
        while True:
            written, left = await device.archive_held(DRAIN_BATCH_BLOCKS)
            total += written
            if not left:
                return total
