"""Prefetch trigger 3: while a device's hot tier is under-used, bring its hottest
idle sessions' heads back into it (the other two triggers are a turn's input
ending, in the router, and block N being read, in the device's read-ahead)."""

from __future__ import annotations

import logging

from memkv.errors import MemkvError
from memkv.periodic import Periodic
from memkv.router.members import Members
from memkv.router.state import RouterState

__all__ = ["BackgroundPrefetch"]

logger = logging.getLogger(__name__)


class BackgroundPrefetch:
    """One round every ``interval_s`` while the router runs.

    Args:
        hot_idle_fraction: prefetch only while a device's hot-tier use is below this.
        head_blocks: how many blocks of each session's head a round brings back.
    """

    def __init__(self, state: RouterState, members: Members, *, interval_s: float,
                 hot_idle_fraction: float, head_blocks: int) -> None:
        self.state = state
        self.members = members
        self.interval_s = interval_s
        self.hot_idle_fraction = hot_idle_fraction
        self.head_blocks = head_blocks
        self.prefetched = 0  # blocks, over the router's life
        self._rounds = Periodic(self.round, interval_s, "background prefetch")

    def ensure_running(self) -> None:
        self._rounds.ensure_running()

    def cancel(self) -> None:
        self._rounds.cancel()

    async def input_ended(self, device_id: str, session_id: str) -> int:
        """A turn's input has ended: prefetch the session's head on its device, then
        what the Markov model expects after its last block (e.g. another session
        that usually follows this one). Returns the blocks moved up."""
        chain = list(self.state.get(session_id).chain)
        head = chain[: self.head_blocks]
        moved = await self.members.call(device_id, session_id, lambda d: d.prefetch(head))
        if chain:
            moved += await self.members.call(
                device_id, session_id, lambda d: d.prefetch_predicted(chain[-1]))
        return int(moved)

    async def round(self) -> int:
        """One pass over the devices; returns the blocks prefetched."""
        moved = 0
        for device_id, device in list(self.members.devices.items()):
            try:
                stats = await device.stats()
                self.state.update_load(device_id, stats.hot_usage)
                # What the device holds, stored through any shard (placement reads it).
                self.state.blocks.apply(
                    device_id, await device.block_events(self.state.blocks.cursor(device_id)))
                if stats.incarnation != self.state.devices[device_id].incarnation:
                    await self.members.check(device_id, force=True)
                    continue
                if stats.hot_usage >= self.hot_idle_fraction:
                    continue
                for session_id in self.state.background_candidates(device_id, limit=4):
                    head = self.state.get(session_id).chain[: self.head_blocks]
                    moved += int(await device.prefetch(head))
            except MemkvError as e:  # MemberGoneError among them
                # A device restarting or a session deleted meanwhile: the next
                # foreground call recovers it; background work just skips a round.
                logger.info("background prefetch skipped %s: %s", device_id, e)
        self.prefetched += moved
        return moved
