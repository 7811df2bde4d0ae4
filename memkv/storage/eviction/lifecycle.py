"""Retention by the sessions' lifecycle: a block is kept for the soonest session that
will read it again, by what the sessions said of themselves.

A block stream cannot tell an agent paused for a minute-long tool from one that
has finished: both stop reading. The session lifecycle can (``memkv.pause``,
``memkv.final``, a response ending in tool calls; docs/front-door.md), and this
policy ranks blocks by it:

- a turn of a session (:meth:`start_turn`) makes the session *active*: it will
  read its blocks again within ``active_horizon_ms`` (an agent thinking);
- a turn that ends with a pause (:meth:`end_turn` with ``pause_ms``) says when the
  session is back; the hint is bounded by ``max_pause_ms`` (a TTL: a session
  that said "an hour" and never came back is not kept longer);
- a final turn ends the session: its blocks are kept only for other sessions.

A block's predicted next read is the soonest of its live holders' (active: the
last read plus the horizon; paused: the time it said it is back); a block no
live session holds is read never, as far as anyone said. The victim is the block
read latest (Belady's rule on predicted times), the least recently read first
among equals: blocks of finished sessions and one-shot reads go first, then
those of the sessions paused longest, then active ones by when each is expected
back (an agent that read a moment ago is back a moment later than one that read
earlier).

Blocks inserted or read outside a turn (no session) have no holder. Costs: a
heap with lazy invalidation; a turn's end rescores the session's blocks, each
at the cost of its holders.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from memkv.errors import InvalidInputError

__all__ = ["LifecyclePolicy"]

K = TypeVar("K", bound=Hashable)


@dataclass
class _Session(Generic[K]):
    keys: set[K] = field(default_factory=set)
    back_at: float | None = None  # None: active (reading again within the horizon)


@dataclass
class _Block(Generic[K]):
    last: float
    holders: set[Hashable] = field(default_factory=set)
    score: float = math.inf
    version: int = 0
    pins: int = 0


class LifecyclePolicy(Generic[K]):
    """An :class:`~memkv.storage.eviction.policy.EvictionPolicy` driven by session turns.

    Args:
        active_horizon_ms: how soon an active session reads its blocks again.
        max_pause_ms: the longest pause a hint is believed for.
    """

    def __init__(self, *, active_horizon_ms: float = 10_000.0,
                 max_pause_ms: float = 3_600_000.0) -> None:
        self.active_horizon_ms = active_horizon_ms
        self.max_pause_ms = max_pause_ms
        self._blocks: dict[K, _Block[K]] = {}
        self._sessions: dict[Hashable, _Session[K]] = {}
        self._heap: list[tuple[float, float, int, int, K]] = []
        self._tie = 0
        self._current: Hashable | None = None

    # -- the lifecycle -------------------------------------------------------------------

    def start_turn(self, session: Hashable, now: float) -> None:
        """A turn of ``session`` begins: it is active, and the blocks inserted or read
        until :meth:`end_turn` are its."""
        self._sessions.setdefault(session, _Session()).back_at = None
        self._current = session

    def end_turn(self, session: Hashable, now: float, *, pause_ms: float | None = None,
                 final: bool = False) -> None:
        """The turn ended: the session is active still (no hint), paused for about
        ``pause_ms``, or done (``final``)."""
        if pause_ms is not None and (pause_ms < 0 or math.isnan(pause_ms)):
            raise InvalidInputError(f"pause_ms must be >= 0, got {pause_ms}")
        self._current = None
        state = self._sessions.get(session)
        if state is None:
            return
        if final:
            del self._sessions[session]
            for key in state.keys:
                block = self._blocks.get(key)
                if block is not None:
                    block.holders.discard(session)
                    self._rescore(key, block)
            return
        state.back_at = None if pause_ms is None else now + min(pause_ms, self.max_pause_ms)
        for key in state.keys:
            block = self._blocks.get(key)
            if block is not None:
                self._rescore(key, block)

    def _next_read(self, holder: Hashable, block: _Block[K]) -> float:
        state = self._sessions.get(holder)
        if state is None:
            return math.inf
        if state.back_at is None:
            return block.last + self.active_horizon_ms
        return state.back_at

    def _rescore(self, key: K, block: _Block[K]) -> None:
        score = min((self._next_read(h, block) for h in block.holders), default=math.inf)
        block.score = score
        block.version += 1
        self._tie += 1
        heapq.heappush(self._heap, (-score, block.last, self._tie, block.version, key))

    def _touch(self, key: K, block: _Block[K], now: float) -> None:
        block.last = now
        if self._current is not None:
            block.holders.add(self._current)
            self._sessions[self._current].keys.add(key)
        self._rescore(key, block)

    # -- EvictionPolicy ---------------------------------------------------------------

    def insert(self, key: K, now: float, parent: K | None = None) -> None:
        if key in self._blocks:
            raise InvalidInputError(f"insert: key {key!r} is already tracked; use access()")
        block: _Block[K] = _Block(last=now)
        self._blocks[key] = block
        self._touch(key, block, now)

    def access(self, key: K, now: float) -> None:
        block = self._blocks.get(key)
        if block is None:
            raise InvalidInputError(f"access: key {key!r} is not tracked; insert() it first")
        self._touch(key, block, now)

    def remove(self, key: K) -> None:
        block = self._blocks.pop(key, None)
        if block is None:
            return
        for holder in block.holders:
            state = self._sessions.get(holder)
            if state is not None:
                state.keys.discard(key)

    def pin(self, key: K) -> None:
        self._blocks[key].pins += 1

    def unpin(self, key: K) -> None:
        block = self._blocks[key]
        block.pins -= 1
        if block.pins == 0:
            self._rescore(key, block)

    def pop_victim(self, now: float) -> K | None:
        skipped: list[tuple[float, float, int, int, K]] = []
        victim: K | None = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            key, version = entry[4], entry[3]
            block = self._blocks.get(key)
            if block is None or block.version != version:
                continue  # stale: the block was rescored or left
            if block.pins:
                skipped.append(entry)
                continue
            victim = key
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if victim is not None:
            self.remove(victim)
        if len(self._heap) > 4 * len(self._blocks) + 1024:
            self._compact()
        return victim

    def _compact(self) -> None:
        self._heap = [e for e in self._heap
                      if (b := self._blocks.get(e[4])) is not None and b.version == e[3]]
        heapq.heapify(self._heap)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self) -> Iterable[K]:
        return self._blocks.keys()
