"""The append path: one turn's blocks onto the session's device, then into the table.

The device stores the blocks first (deduplicated against what it holds);
only then does the table record them, so a block is never referenced before
it is stored. While the put is in flight its blocks are kept out of every
archive delete (:meth:`Collector.protect`); appends of one session are
serialised, those of different sessions run side by side.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from msgspec.structs import asdict as msgspec_asdict

from memkv.errors import ClosedError, ConflictError, InvalidInputError
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.members import StoredBlocks
from memkv.protocol.messages import ChainUpdate
from memkv.protocol.services import (
    AppendAnswer,
    AppendTurn,
    BlockCut,
    LayoutSpec,
    ReserveSlots,
    SlotsReserved,
)
from memkv.router.collector import Collector
from memkv.router.members import Members
from memkv.router.peers import ShardPeers
from memkv.router.sessions import SessionRecord
from memkv.router.state import RouterState

__all__ = ["MAX_RESERVED_SLOTS", "Appends"]

#: Slots one write reservation may ask for (a 4096-token prompt of 16-token
#: blocks is 256; each is a block's size, bounded again by the device).
MAX_RESERVED_SLOTS = 4096


@dataclass(slots=True)
class _SessionLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class Appends:
    """Every session's appends, for one router shard (``owner``).

    Args:
        durable: makes the journal durable when called with True (group commit).
    """

    def __init__(self, state: RouterState, members: Members, collector: Collector,
                 peers: ShardPeers, owner: str,
                 durable: Callable[[bool], Awaitable[None]]) -> None:
        self._state = state
        self._members = members
        self._collector = collector
        self._peers = peers
        self._owner = owner
        self._durable = durable
        self._session_locks: dict[str, _SessionLock] = {}
        self.taken = False  # whether any append was taken since this process started

    async def put(self, request: AppendTurn, blocks: list[Any]) -> AppendAnswer:
        """Store a turn's blocks on the session's device (blocks: payloads, refs or
        staged descriptors; :class:`AppendTurn` says what the header carries).

        Raises:
            ConflictError: the session is not the one the caller hashed for
                (``expect``: deleted and created again), or ``turn`` is not the next.
            CapacityError: the append would take the tenant over its quota.
        """
        session_id = request.session_id
        async with self.holding(session_id):
            record = self._state.get(session_id)
            expect = request.expect
            if expect is not None and (
                LayoutSpec.of(record.layout) != expect.layout
                or record.namespace != expect.namespace
            ):
                raise ConflictError(
                    f"session {session_id!r} has layout {record.layout.to_dict()} in namespace "
                    f"{record.namespace!r}, the request was made for "
                    f"{msgspec_asdict(expect.layout)} in {expect.namespace!r}"
                )
            return await self._put(request, blocks)

    async def reserve(self, request: ReserveSlots) -> SlotsReserved:
        """A write reservation on the session's device for a writer on ``request.node``
        (placing a new session as its first append would); none, with the reason,
        where that device is on another node or has no shared-memory room."""
        session_id = request.session_id
        record = self._state.get(session_id)
        if not 0 < request.count <= MAX_RESERVED_SLOTS:
            raise InvalidInputError(
                f"reserve 1..{MAX_RESERVED_SLOTS} slots, got {request.count}")
        device_id = self._state.place(session_id, list(request.chain))
        if device_id not in self._members.devices:
            raise ClosedError(f"session {session_id!r} is being recovered; retry")
        node = self._state.node_of.get(device_id, "")
        if not node or not (node.startswith(request.node) or request.node.startswith(node)):
            return SlotsReserved(reason=f"session {session_id!r} lives on device {device_id} "
                                        f"of another node")
        grant = await self._members.call(device_id, session_id, lambda d: d.reserve_slots(
            request.count, record.layout.block_nbytes(), request.ttl_s))
        if grant is None:
            return SlotsReserved(reason=f"device {device_id} has no shared-memory room for "
                                        f"{request.count} blocks now")
        return SlotsReserved(
            reservation_id=grant.reservation_id, device_id=grant.device_id,
            node_id=grant.node_id, segment=grant.segment, segment_bytes=grant.segment_bytes,
            slot_bytes=grant.slot_bytes, offsets=grant.offsets, ttl_s=grant.ttl_s)

    @asynccontextmanager
    async def holding(self, session_id: str) -> AsyncIterator[None]:
        """The session's append lock: appends (and a drain's move) one at a time.

        One lock per session while someone holds or waits for it; idle sessions
        keep none (thousands of them would each hold one).
        """
        entry = self._session_locks.setdefault(session_id, _SessionLock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0 and self._session_locks.get(session_id) is entry:
                del self._session_locks[session_id]

    async def _put(self, request: AppendTurn, blocks: list[Any]) -> AppendAnswer:
        session_id = request.session_id
        token_ids = request.tokens()
        chain_hint = list(request.chain) if request.chain is not None else None
        record = self._state.get(session_id)
        if request.turn is not None and self._state.sessions.check_turn(
            session_id, request.turn, chain_hint, len(token_ids)
        ):
            return _unchanged(record)
        chain = (
            chain_hint
            if chain_hint is not None
            else [bytes(k) for k in chain_hashes(token_ids, record.layout, record.namespace)]
        )
        if not blocks and request.start_block == len(chain) and list(record.chain) == chain:
            # A turn by reference that the session holds already (an engine that loaded
            # it, or held it in its own cache): nothing changes, nothing is journaled.
            self._state.touch(session_id)
            return _unchanged(record)
        update = self._state.sessions.plan_append(
            session_id, len(token_ids), chain, request.start_block)
        if request.quota is not None:
            quota = request.quota.limits()
            self._state.check_quota(session_id, max_bytes=quota[1], update=update,
                                   elsewhere=await self._peers.usage_elsewhere(session_id, quota))
        self.taken = True
        device_id = self._state.place(session_id, chain)
        if device_id not in self._members.devices:
            raise ClosedError(f"session {session_id!r} is being recovered; retry")
        checksums = list(request.checksums) if request.checksums is not None else None
        with self._collector.protect(update.chain):
            stored, update = await self._apply_put(
                session_id, device_id, update, blocks, checksums, record.durable, token_ids,
                chain, request.start_block,
            )
            garbage = self._state.record_put(session_id, update)
        await self._durable(record.durable)
        await self._collector.collect(garbage)
        return AppendAnswer(
            chain=tuple(bytes(k) for k in update.chain),
            turn=self._state.get(session_id).turn,
            new_blocks=stored.new_blocks,
            deduplicated_blocks=stored.deduplicated_blocks,
            released_blocks=stored.released_blocks,
        )

    async def hold(self, session_id: str, tokens: int, chain: Sequence[bytes],
                   cut: BlockCut | None) -> AppendAnswer:
        """A turn made of blocks the session's device holds already: a fork's first,
        a rewind. ``chain`` covers ``tokens``; every block is the device's but the last
        when ``cut`` says how the device makes it. The caller holds the session's lock.

        Raises:
            PrefixNotStoredError: a block is no longer on the device (the session it
                came from moved or dropped it meanwhile: retry).
        """
        record = self._state.get(session_id)
        start = len(chain) - (cut is not None)
        update = self._state.sessions.plan_append(session_id, tokens, list(chain), start)
        device_id = self._state.place(session_id, chain)
        if device_id not in self._members.devices:
            raise ClosedError(f"session {session_id!r} is being recovered; retry")
        blocks = [cut] if cut is not None else []
        with self._collector.protect(update.chain):
            stored = await self._members.call(
                device_id, session_id,
                lambda d: d.put(update, blocks, None, record.durable, self._owner,
                                self._state.blocks.cursor(device_id)))
            if stored.events is not None:
                self._state.blocks.apply(device_id, stored.events)
            garbage = self._state.record_put(session_id, update)
        await self._durable(record.durable)
        await self._collector.collect(garbage)
        return AppendAnswer(
            chain=tuple(bytes(k) for k in update.chain),
            turn=self._state.get(session_id).turn,
            new_blocks=stored.new_blocks,
            deduplicated_blocks=stored.deduplicated_blocks,
            released_blocks=stored.released_blocks,
        )

    async def _apply_put(
        self,
        session_id: str,
        device_id: str,
        update: ChainUpdate,
        blocks: list[Any],
        checksums: list[int] | None,
        durable: bool,
        token_ids: Sequence[int] | np.ndarray,
        chain: list[bytes],
        start_block: int,
    ) -> tuple[StoredBlocks, ChainUpdate]:
        """The device's put of one append; planned again once if the device restarted."""
        planned_on = self._state.devices[device_id].incarnation
        try:
            stored = await self._members.call(
                device_id, session_id,
                lambda d: d.put(update, blocks, checksums, durable, self._owner,
                                self._state.blocks.cursor(device_id)),
            )
        except InvalidInputError:
            # Blocks the append builds on missing: the device may have restarted
            # since it was last asked. Then the session was recovered (adopted
            # from the archive, or lost: BlockLostError) and the append is planned
            # again; otherwise the request itself was wrong.
            await self._members.check(device_id, force=True)
            if self._state.devices[device_id].incarnation == planned_on:
                raise  # the same process as planned on: the request was wrong
            self._state.get(session_id)  # lost in the recovery: BlockLostError
            replanned = self._state.sessions.plan_append(
                session_id, len(token_ids), chain, start_block
            )
            stored = await self._members.call(
                device_id, session_id,
                lambda d: d.put(replanned, blocks, checksums, durable, self._owner,
                                self._state.blocks.cursor(device_id)),
            )
            update = replanned
        if stored.events is not None:
            self._state.blocks.apply(device_id, stored.events)
        return stored, update


def _unchanged(record: SessionRecord) -> AppendAnswer:
    """The answer to an append that changed nothing (a retry, or a turn held already)."""
    return AppendAnswer(chain=tuple(bytes(k) for k in record.chain), turn=record.turn,
                        new_blocks=0, deduplicated_blocks=0, released_blocks=0, replayed=True)
