"""Which tier each block copy enters and leaves, queued for a publisher.

The tier ladder (:mod:`memkv.storage.pool_ladder`) notes every copy a block gains
on a tier (admitted, demoted into, promoted into, written cold) and every copy it
loses (demoted or promoted out of, freed), under the pool's lock; a publisher in
the device process (:mod:`memkv.device.kv_events`) takes them in batches, off
that lock, and sends them as vLLM's KV events (:mod:`memkv.protocol.kv_events`).
The queue is bounded: a publisher that falls behind loses the oldest changes,
and its next batch starts with ``AllBlocksCleared`` (its subscribers forget this
device's blocks, which come back as they are stored again) rather than a
silently wrong picture.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple

from memkv.protocol.enums import Tier

__all__ = ["TierChange", "TierEventLog"]

#: Changes kept for the publisher at most.
MAX_QUEUED = 1_000_000


class TierChange(NamedTuple):
    stored: bool  # False: removed
    tier: Tier
    key: bytes
    parent: bytes | None
    block_tokens: int


class TierEventLog:
    """The queue between a pool's tier ladder and a publisher (thread-safe)."""

    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        self._lock = threading.Lock()
        self._changes: deque[TierChange] = deque()
        self._max = max_queued
        self._overflowed = False
        self.dropped = 0  # changes lost to a publisher that fell behind

    def stored(self, key: bytes, parent: bytes | None, tier: Tier, block_tokens: int) -> None:
        self._put(TierChange(True, tier, bytes(key), None if parent is None else bytes(parent),
                             block_tokens))

    def removed(self, key: bytes, tier: Tier) -> None:
        self._put(TierChange(False, tier, bytes(key), None, 0))

    def _put(self, change: TierChange) -> None:
        with self._lock:
            if len(self._changes) >= self._max:
                self.dropped += len(self._changes)
                self._changes.clear()
                self._overflowed = True
            self._changes.append(change)

    def take(self) -> tuple[bool, list[TierChange]]:
        """``(cleared, changes)``: the changes since the last take, oldest first, and
        whether some were lost before them (the subscribers must start over)."""
        with self._lock:
            changes, self._changes = list(self._changes), deque()
            cleared, self._overflowed = self._overflowed, False
        return cleared, changes
