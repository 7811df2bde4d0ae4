"""Replay a Mooncake-style request trace through memkv's eviction policies.

Each line of the trace is one request: ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, the request's prompt blocks in chain order.
The replay uses memkv's own policy classes (:func:`memkv.storage.eviction.make_policy`)
with **prefix semantics**: a request hits only its leading run of cached blocks
(the first miss ends the hits, since a reader needs the whole prefix); then
every block of the request is accessed, or inserted under the previous block
as its parent, evicting until the cache is back within capacity. The hit ratio
is hit blocks / requested blocks. ``now`` is the trace timestamp, advanced by a
tiny sub-step per block so that times are strictly increasing.

``memkv bench eviction`` runs it beside the reference policies and writes the
table; this module is the replay itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from memkv.storage.eviction import EvictionPolicy
from memkv.storage.prefetch import MarkovPrefetcher

__all__ = [
    "PrefetchReplayResult",
    "ReplayResult",
    "Request",
    "distinct_blocks",
    "load_trace",
    "replay",
    "replay_prefetching",
]


#: Time added per block when the trace clock does not move (ms). Far below the
#: trace's 1 ms resolution yet ~2000 float ulps at the trace's largest timestamps.
SUBSTEP_MS = 1e-6


@dataclass(frozen=True, slots=True)
class Request:
    """One trace request: when (ms) and which prompt blocks, in chain order."""

    timestamp: float
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What one policy achieved at one capacity."""

    policy: str
    capacity: int
    hit_blocks: int
    requested_blocks: int
    evictions: int
    seconds: float

    @property
    def hit_ratio(self) -> float:
        """Hit blocks / requested blocks (0 for an empty trace)."""
        return self.hit_blocks / self.requested_blocks if self.requested_blocks else 0.0


def load_trace(path: Path) -> list[Request]:
    """Parse a JSONL trace (``timestamp`` and ``hash_ids`` per line; other fields ignored)."""
    requests: list[Request] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                requests.append(Request(float(row["timestamp"]), tuple(row["hash_ids"])))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a trace request ({e})") from e
    return requests


def distinct_blocks(requests: Iterable[Request]) -> int:
    """How many different blocks the trace names."""
    seen: set[int] = set()
    for r in requests:
        seen.update(r.hash_ids)
    return len(seen)


def replay(
    requests: Sequence[Request], capacity: int, policy: EvictionPolicy[int], name: str = ""
) -> ReplayResult:
    """Run ``requests`` through ``policy`` with room for ``capacity`` blocks.

    Args:
        requests: the trace, in time order.
        capacity: blocks the cache may hold (>= 1).
        policy: an empty policy; it is driven through its public interface only.
        name: label of the result.

    Returns:
        Hits (leading cached run of each request), requested blocks, evictions.

    Raises:
        ValueError: ``capacity < 1``.
    """
    return replay_prefetching(requests, capacity, policy, None, name).result


@dataclass(frozen=True, slots=True)
class PrefetchReplayResult:
    """A replay with a prefetcher: the hits, and what the prefetches did."""

    result: ReplayResult
    prefetched: int  # blocks brought into the cache by a prediction
    used: int  # of those, read (as part of a hit) before they were evicted
    wasted: int  # evicted unread, or still unread at the end

    @property
    def accuracy(self) -> float:
        """Prefetched blocks read / prefetched blocks (0 with none prefetched)."""
        return self.used / self.prefetched if self.prefetched else 0.0


def replay_prefetching(
    requests: Sequence[Request],
    capacity: int,
    policy: EvictionPolicy[int],
    prefetcher: MarkovPrefetcher[int] | None,
    name: str = "",
    *,
    per_conversation: bool = False,
) -> PrefetchReplayResult:
    """:func:`replay`, with ``prefetcher`` (or none) learning the accesses.

    After each request the prefetcher predicts from its last block (memkv's
    first trigger: a turn's input has ended) and the predicted blocks that are
    not cached are brought in, as the archive would promote them, taking room
    like any other block. A prefetched block counts as used if a later
    request's leading hit run reads it before it is evicted.

    ``per_conversation``: the prefetcher learns one stream per conversation (a
    request's second block names it: the first is the shared system prompt), as
    memkv learns one per session; else one stream for the whole trace.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    hits = requested = evictions = 0
    prefetched = used = 0
    pending: set[int] = set()  # prefetched, not read yet
    now = float("-inf")
    start = time.perf_counter()

    def insert(b: int, parent: int | None) -> None:
        nonlocal evictions
        policy.insert(b, now, parent)
        while len(policy) > capacity:
            victim = policy.pop_victim(now)
            if victim is None:
                break
            evictions += 1
            pending.discard(victim)

    for req in requests:
        blocks = req.hash_ids
        requested += len(blocks)
        for b in blocks:
            if b not in policy:
                break
            hits += 1
            if b in pending:
                pending.discard(b)
                used += 1
        parent: int | None = None
        for b in blocks:
            now = max(req.timestamp, now + SUBSTEP_MS)
            if b in policy:
                policy.access(b, now)
            else:
                insert(b, parent)
            if prefetcher is not None:
                prefetcher.observe(b, blocks[1] if per_conversation and len(blocks) > 1 else None)
            parent = b
        if prefetcher is not None and blocks:
            for b, _ in prefetcher.predict(blocks[-1]):
                if b not in policy:
                    now = now + SUBSTEP_MS
                    insert(b, None)
                    if b in policy:
                        pending.add(b)
                        prefetched += 1
    result = ReplayResult(name, capacity, hits, requested, evictions,
                          time.perf_counter() - start)
    return PrefetchReplayResult(result, prefetched, used, prefetched - used)
