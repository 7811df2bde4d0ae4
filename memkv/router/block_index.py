"""Which blocks each device holds, as the devices' own block pools say.

A router shard does not count where blocks are: it follows each device's
change log (:class:`~memkv.protocol.events.BlockEvents`), answered with every
append it sends there and asked of every device by the background loop, so
blocks stored through other shards count too. Placement's prefix affinity
reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

from memkv.protocol.events import BlockEvents

__all__ = ["BlockIndex"]


class BlockIndex:
    """Per device: the blocks its pool holds, and the cursor of its log read so far."""

    def __init__(self) -> None:
        self._cursors: dict[str, tuple[str, int]] = {}
        self._held: dict[str, set[bytes]] = {}

    def cursor(self, device_id: str) -> tuple[str, int]:
        """``(epoch, position)`` to ask ``device_id``'s log from (a new device: from 0)."""
        return self._cursors.get(device_id, ("", 0))

    def apply(self, device_id: str, events: BlockEvents) -> None:
        """The device's changes since this index's cursor (a snapshot replaces all).

        Answers of concurrent calls arrive in any order: one that ends where
        the index already is (or before), or that belongs to an epoch the index
        has moved past, is skipped. One that starts before the cursor is applied
        whole: it holds each key's state as of its end, the newer state.
        """
        epoch, position = self.cursor(device_id)
        if events.epoch == epoch and events.end <= position:
            return
        if events.epoch != epoch and not events.snapshot:
            return  # of a process the index no longer follows
        if events.snapshot:
            self._held[device_id] = set()
        held = self._held.setdefault(device_id, set())
        held.difference_update(events.removed)
        held.update(events.stored)
        self._cursors[device_id] = (events.epoch, events.end)

    def forget(self, device_id: str) -> None:
        """A device gone for good: nothing is held there any more."""
        self._cursors.pop(device_id, None)
        self._held.pop(device_id, None)

    def held(self, device_id: str) -> frozenset[bytes]:
        return frozenset(self._held.get(device_id, ()))

    def holds(self, device_id: str, key: bytes) -> bool:
        return bytes(key) in self._held.get(device_id, ())

    def depth(self, device_id: str, chain: Sequence[bytes]) -> int:
        """How many leading blocks of ``chain`` the device holds."""
        held = self._held.get(device_id, set())
        depth = 0
        for key in chain:
            if bytes(key) not in held:
                break
            depth += 1
        return depth
