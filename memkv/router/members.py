"""The devices a router directs, and what it does when one restarts or is lost.

A device that restarts comes back empty (a new incarnation): each of its
sessions is adopted again from what some tier still holds (the archive), or
truncated to the prefix that survives, or marked lost. :class:`Members` notices
a restart by the changed incarnation in a ping (at most once a second per
device) or by :class:`~memkv.errors.MemberGoneError` on a call, and recovers
once however many callers notice it together.

A device whose node died is lost for good (Ray cannot place it elsewhere:
:class:`~memkv.errors.MemberLostError`). The router forgets it and moves its
sessions to the devices left, each adopted from the archive the lost device
wrote to (another device that uses that archive is preferred): ``archive``-mode
sessions come back whole, ``memory``-mode ones keep what reached the archive
or answer 410 with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_delay,
    wait_fixed,
)

from memkv.errors import (
    BlockLostError,
    ClosedError,
    MemberGoneError,
    MemberLostError,
    plain_message,
)
from memkv.protocol.enums import SessionState
from memkv.protocol.layout import block_token_count
from memkv.protocol.members import BlockStore, DeviceInfo, Directory, Holder
from memkv.router.sessions import SessionRecord
from memkv.router.state import RouterState

__all__ = ["DEVICE_CHECK_INTERVAL_S", "DEVICE_RECOVERY_TIMEOUT_S", "Members"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# How long the router waits for a restarted device to answer before giving up.
DEVICE_RECOVERY_TIMEOUT_S = 120.0
# A device that answered a ping this recently is not pinged again per request.
DEVICE_CHECK_INTERVAL_S = 1.0
_RECOVERY_POLL_S = 0.2

#: Deletes archived blocks no session serves any more (the router's collector).
Collect = Callable[[list[bytes]], Awaitable[None]]


class Members:
    """The router's devices, each by its cluster-wide name.

    Args:
        state: the session table the recoveries change.
        owner: the router shard whose block references these are.
        collect: deletes archived blocks a truncated session no longer serves.
    """

    def __init__(self, state: RouterState, owner: str, collect: Collect) -> None:
        self.state = state
        self.owner = owner
        self._collect = collect
        self.devices: dict[str, BlockStore] = {}
        # device -> the archive it writes to, from its pings (not journaled: a
        # restarted router pings every device again).
        self.archive_of: dict[str, str] = {}
        self.lost: dict[str, str] = {}  # device -> why it is gone, for errors and stats
        self._checked: dict[str, float] = {}  # device -> when it last answered a ping
        self._recovering: dict[str, asyncio.Future[None]] = {}

    async def call(
        self, device_id: str, session_id: str | None,
        call: Callable[[BlockStore], Awaitable[_T]],
    ) -> _T:
        """``call(device)``; if the device died meanwhile it is recovered and called again.

        After a recovery the session may have been marked lost; it is checked
        again so the caller gets BlockLostError rather than an unknown session.
        """
        await self.check(device_id)
        device_id = self._serving(device_id, session_id)
        try:
            return await call(self.devices[device_id])
        except MemberGoneError:
            await self.check(device_id, force=True)
            device_id = self._serving(device_id, session_id)
            return await call(self.devices[device_id])

    async def follow_block_events(self) -> None:
        """Read every live device's block changes since the index's cursor (a device
        gone meanwhile is skipped: its recovery re-places what it held)."""
        for device_id, device in list(self.devices.items()):
            try:
                events = await device.block_events(self.state.blocks.cursor(device_id))
            except MemberGoneError:
                continue
            self.state.blocks.apply(device_id, events)

    def add(self, device_id: str, device: BlockStore, info: DeviceInfo) -> None:
        """A device that answered ``info`` joins (or joins again)."""
        self.devices[device_id] = device
        self.archive_of[device_id] = info.archive
        self.state.node_of[device_id] = info.node
        self.lost.pop(device_id, None)
        self.state.add_device(device_id, info.incarnation)
        self._checked[device_id] = time.monotonic()

    def _serving(self, device_id: str, session_id: str | None) -> str:
        """The device that serves the session now: ``device_id``, unless that one was
        lost meanwhile and the session moved (BlockLostError when it could not)."""
        record = self.state.get(session_id) if session_id is not None else None
        if device_id in self.devices:
            return device_id
        if record is not None and record.device_id in self.devices:
            assert record.device_id is not None
            return record.device_id
        raise ClosedError(
            f"device {device_id} is gone ({self.lost.get(device_id, 'no longer known')}) "
            f"and no device is left to take its sessions; retry once one joins"
        )

    async def check(self, device_id: str, *, force: bool = False) -> None:
        """Recover the device's sessions if its process was restarted since we last looked.

        A device answered within the last DEVICE_CHECK_INTERVAL_S is not pinged
        again (a ping per request costs a round trip); a restart in between
        surfaces as MemberGoneError on the caller's own call, and callers then
        report it (``force``).
        """
        pending = self._recovering.get(device_id)
        if pending is not None:
            await pending
            return
        if device_id not in self.devices:
            return  # lost meanwhile: its sessions moved (callers look again)
        if not force and time.monotonic() - self._checked.get(device_id, -1e9) < (
            DEVICE_CHECK_INTERVAL_S
        ):
            return
        try:
            info = await self._answer(device_id)
        except MemberLostError as e:
            await self._once(device_id, self._lose(device_id, plain_message(e)))
            return
        self._checked[device_id] = time.monotonic()
        self.archive_of[device_id] = info.archive
        if info.incarnation != self.state.devices[device_id].incarnation:
            await self._once(device_id, self._recover(device_id, info.incarnation))

    async def _once(self, device_id: str, recovery: Awaitable[None]) -> None:
        """Run ``recovery`` while other callers who notice the same device wait for it."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._recovering[device_id] = future
        try:
            await recovery
            future.set_result(None)
        except BaseException as e:
            future.set_exception(e)
            raise
        finally:
            del self._recovering[device_id]

    async def _answer(self, device_id: str) -> DeviceInfo:
        """The device's ping, once Ray has restarted it if it died (MemberLostError
        at once when its node is gone: nothing will restart it)."""
        try:
            return await self.devices[device_id].ping()
        except MemberLostError:
            raise
        except MemberGoneError:
            return await self.wait_for_restart(device_id)

    async def wait_for_restart(self, device_id: str) -> DeviceInfo:
        """The device's answer once Ray has restarted it (MemberGoneError past the timeout)."""
        device = self.devices[device_id]
        async for attempt in AsyncRetrying(
            # A lost device (its node is gone) will not answer: stop at once.
            retry=retry_if_exception_type(MemberGoneError)
            & retry_if_not_exception_type(MemberLostError),
            stop=stop_after_delay(DEVICE_RECOVERY_TIMEOUT_S),
            wait=wait_fixed(_RECOVERY_POLL_S),
            reraise=True,
        ):
            with attempt:
                return await device.ping()
        raise AssertionError("unreachable: AsyncRetrying reraises")  # pragma: no cover

    async def reattach(self, directory: Directory) -> None:
        """A restarted router: find the journal's devices again by name.

        A device that still answers keeps its blocks: its references are set
        again from the table (an append the router died before recording
        leaves none behind). A device that is gone (the machine restarted: new
        actors, new names) is forgotten; its sessions move to the devices that
        register next, from the archive (:meth:`rehome_orphans`).
        """
        for name in list(self.state.known_devices):
            device = directory.device(name)
            if device is None:
                # No such actor any more (its node died and Ray gave it up, or a new
                # cluster): lost, so a reader that saw it fail asks for the route again.
                self.lost[name] = f"device {name} is gone"
                self.state.forget_device(name)
                continue
            self.devices[name] = device
            try:
                info = await self._answer(name)
            except MemberLostError as e:
                # Its node died with the router's: its sessions go to the others.
                del self.devices[name]
                self.lost[name] = plain_message(e)
                self.state.forget_device(name)
                continue
            self.add(name, device, info)
            await self.resync(name)

    async def resync(self, device_id: str) -> None:
        """Set a device's block references from the table; sessions it cannot serve are lost."""
        records = [r for r in self.state.sessions_on(device_id) if r.chain and not r.lost]
        holders = [
            Holder(r.layout, list(r.chain), block_token_count(r.layout, r.tokens), r.active,
                   r.priority, r.exact_only)
            for r in records
        ]
        device = self.devices[device_id]
        for i in await device.resync(holders, self.owner):
            reason = (
                f"device {device_id} no longer has all of its blocks and the archive lacks some"
            )
            if await self.serve_what_survives(device, records[i], reason):
                self.state.record_state(records[i].session_id, SessionState.ARCHIVED)

    async def rehome_orphans(self, archive: str | None = None) -> None:
        """Sessions whose device is gone for good go to a live one, from the archive.

        Args:
            archive: the archive the gone device wrote to: a device that reads the
                same one is preferred (it can adopt the blocks from there).
        """
        # (A draining device takes no session: it is about to go.)
        takers = [d for d in self.devices if self.state.is_live(d)] or list(self.devices)
        if not takers:
            return
        for record in list(self.state.sessions):
            if record.device_id is None or record.device_id in self.devices or record.lost:
                continue
            target = min(takers, key=lambda d: (
                self.archive_of.get(d) != archive, self.state.devices[d].sessions, d))
            if not record.chain:
                self.state.move(record.session_id, target)
                continue
            reason = (
                f"its device {record.device_id} is gone and the archive lacks some of its "
                f"blocks"
            )
            if not await self.serve_what_survives(self.devices[target], record, reason):
                continue
            self.state.move(record.session_id, target)
            self.state.record_state(record.session_id, SessionState.ARCHIVED)

    def retire(self, device_id: str, why: str) -> None:
        """A device that left on purpose (drained): forgotten, its sessions moved already."""
        self.archive_of.pop(device_id, None)
        self.devices.pop(device_id, None)
        self._checked.pop(device_id, None)
        self.lost[device_id] = why
        self.state.forget_device(device_id)

    async def _lose(self, device_id: str, why: str) -> None:
        """A device whose node died: forget it; its sessions move to the devices left."""
        logger.error(
            "device %s is lost (%s); its sessions move to the other devices, from the archive",
            device_id, why,
        )
        archive = self.archive_of.pop(device_id, None)
        del self.devices[device_id]
        self._checked.pop(device_id, None)
        self.lost[device_id] = why
        self.state.forget_device(device_id)
        started = time.monotonic()
        await self.rehome_orphans(archive)
        logger.warning(
            "sessions of device %s re-placed in %.2f s", device_id, time.monotonic() - started
        )

    async def _recover(self, device_id: str, incarnation: str) -> None:
        """A device restarted empty: re-adopt its sessions from the archive, or mark them lost."""
        logger.warning("device %s restarted; recovering its sessions from the archive", device_id)
        self.state.devices[device_id].incarnation = incarnation
        # What the old process held went with it: nothing is held there until the new
        # one's log is read (a match must not offer blocks no tier has).
        self.state.blocks.forget(device_id)
        device = self.devices[device_id]
        for record in self.state.sessions_on(device_id):
            if record.lost or not record.chain:
                continue
            reason = (
                f"device {device_id} restarted before all of the session's blocks reached "
                f"the archive"
            )
            if await self.serve_what_survives(device, record, reason):
                self.state.record_state(record.session_id, SessionState.ARCHIVED)

    async def serve_what_survives(
        self, device: BlockStore, record: SessionRecord, reason: str
    ) -> bool:
        """Have ``device`` hold what is left of ``record``'s chain: the longest prefix
        some tier still has (the engine recomputes the rest), or nothing.

        Returns:
            False when not even the first block survives (the session is lost: 410).
        """
        try:
            held = await device.adopt(
                record.layout, list(record.chain), block_token_count(record.layout, record.tokens),
                record.priority.value, record.exact_only, self.owner, True,
            )
        except BlockLostError as e:
            self.state.mark_lost(record.session_id, f"{reason} ({plain_message(e)})")
            return False
        if held < len(record.chain):
            tokens = record.tokens
            # Blocks after the first missing one that the archive has are garbage
            # now (no session serves past the gap).
            await self._collect(
                self.state.truncate(
                    record.session_id,
                    held,
                    f"{reason}: blocks {held}..{len(record.chain) - 1} of {len(record.chain)} "
                    f"are lost",
                )
            )
            logger.warning(
                "session %s keeps %d of its %d tokens (%s)",
                record.session_id, record.tokens, tokens, reason,
            )
        return True
