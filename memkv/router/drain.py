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
happens only when an archive dies during the drain. A device the drain moves
a session to that dies meanwhile is recovered or forgotten (its sessions
re-placed as for any lost device) and the session goes to another.

The same move, the other way, **rebalances** a device that joins: sessions
come to it from the devices with the most until loads are even (idle and cold
ones first).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from memkv.errors import ConflictError, InvalidInputError, MemberGoneError
from memkv.protocol.layout import block_token_count
from memkv.protocol.stats import DrainReport
from memkv.router.appends import Appends
from memkv.router.members import Members
from memkv.router.state import RouterState

__all__ = ["DRAIN_BATCH_BLOCKS", "DrainReport", "Drainer", "Moved"]

logger = logging.getLogger(__name__)

#: Blocks archived per device call while draining (each call is fsynced).
DRAIN_BATCH_BLOCKS = 256
#: Sessions a device that joins takes from the others at most (per join).
REBALANCE_MAX_SESSIONS = 1024
#: Devices tried for one session before the drain gives up (each that fails is
#: recovered or forgotten first).
TARGET_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Moved:
    """One session moved (or not) off a device."""

    target: str
    served: bool  # False: not even its first block survived (lost, 410)
    tokens_lost: int = 0
    nbytes: int = 0  # logical KV bytes moved
    archived: int = 0  # blocks archived first


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
        archived = await self._archive_all(device_id)
        moved = lost = tokens_lost = nbytes = 0
        moved_to: dict[str, int] = {}
        for record in self.state.sessions_on(device_id):
            done = await self.move_session(device_id, record.session_id,
                                           lambda: self._target(device_id), "was drained")
            if done is None:
                continue  # deleted, or moved, meanwhile
            archived += done.archived
            if not done.served:
                lost += 1
                continue
            moved += 1
            moved_to[done.target] = moved_to.get(done.target, 0) + 1
            tokens_lost += done.tokens_lost
            nbytes += done.nbytes
        self.members.retire(device_id, "drained")
        report = DrainReport(device=device_id, sessions_moved=moved, sessions_lost=lost,
                             tokens_lost=tokens_lost, blocks_archived=archived,
                             bytes_moved=nbytes, seconds=round(time.monotonic() - started, 3),
                             moved_to=moved_to)
        logger.warning("drained device %s: %s", device_id, report)
        return report

    async def rebalance(self, device_id: str, *, limit: int = REBALANCE_MAX_SESSIONS) -> int:
        """Move sessions to ``device_id`` (a device that joined) from the devices with
        the most, until no live device has more than one session more than it (or
        ``limit`` moved). Idle sessions go first, the coldest of them first: a
        session in a turn pays the move's latency. Returns how many moved."""
        moved = 0
        while moved < limit and self.state.is_live(device_id):
            live = [d for d in self.members.devices if self.state.is_live(d)]
            busiest = max(live, key=lambda d: (self.state.devices[d].sessions, d))
            if self.state.devices[busiest].sessions - self.state.devices[device_id].sessions <= 1:
                break
            movable = [r for r in self.state.sessions_on(busiest) if r.chain and not r.lost]
            if not movable:
                break
            record = min(movable, key=lambda r: (r.active, r.hotness, r.session_id))
            done = await self.move_session(busiest, record.session_id, lambda: device_id,
                                           "was rebalanced")
            if done is None or not done.served:
                break
            moved += 1
        if moved:
            logger.warning("rebalanced %d sessions to device %s", moved, device_id)
        return moved

    async def move_session(self, source: str, session_id: str, pick: Callable[[], str],
                           why: str) -> Moved | None:
        """Move one session off ``source`` to the device ``pick`` names, under its append
        lock: its memory-only blocks archived first, the chain adopted there from the
        archives, the table moved, ``source``'s references let go. None when the
        session is gone or no longer on ``source``.

        Raises:
            ConflictError: no device took it in TARGET_ATTEMPTS tries.
        """
        async with self.appends.holding(session_id):
            current = self.state.sessions.lookup(session_id)
            if current is None or current.device_id != source:
                return None
            if not current.chain or current.lost:
                target = pick()
                self.state.move(session_id, target)
                return Moved(target=target, served=True)
            archived = await self._archive_all(source)
            tokens, chain, active = current.tokens, list(current.chain), current.active
            reason = f"its device {source} {why} and the archive lacks some blocks"
            for attempt in range(TARGET_ATTEMPTS):
                target = pick()
                try:
                    served = await self.members.serve_what_survives(
                        self.members.devices[target], current, reason)
                    break
                except MemberGoneError:
                    # The device it was moving to died: the router recovers it (a
                    # restart) or forgets it (its node is gone), and the session goes
                    # to the device then picked.
                    logger.warning("moving %s off %s: target %s failed (attempt %d)",
                                   session_id, source, target, attempt + 1)
                    await self.members.check(target, force=True)
            else:
                raise ConflictError(f"session {session_id!r} found no device to move to off "
                                    f"{source} in {TARGET_ATTEMPTS} attempts; it stays there")
            if not served:
                return Moved(target=target, served=False, archived=archived)
            self.state.move(session_id, target)
            try:
                await self.members.devices[source].release(chain, active, self.members.owner)
            except (MemberGoneError, KeyError):
                pass  # gone meanwhile: its references went with it
            return Moved(
                target=target, served=True, tokens_lost=tokens - current.tokens,
                nbytes=sum(current.layout.block_nbytes(n)
                           for n in block_token_count(current.layout, current.tokens)),
                archived=archived)

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
