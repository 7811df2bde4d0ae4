"""Diagnostics of the storage engine.

* :class:`AccessStats` — access-pattern statistics (reuse distances, per-window
  hit ratios per tier) so prefetch and eviction parameters can be tuned from data.
* The refcount-invariant checker (below, in its own section).
"""

from __future__ import annotations

import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from memkv.errors import InvalidInputError, InvariantViolationError

__all__ = [
    "COLD_BUCKET",
    "TIER_NAMES",
    "AccessStats",
    "Leak",
    "WindowRatios",
    "check_refcounts",
    "find_leaks",
    "reuse_bucket",
]

# =============================================================================
# Access-pattern statistics
# =============================================================================

#: Tiers an access can be served from, fastest first (the values of ``tiers.Tier``;
#: spelled out here so diagnostics imports nothing heavy).
TIER_NAMES: tuple[str, ...] = ("hot", "warm", "cold")
_MISS = "miss"

#: Histogram bucket of first accesses, and of keys forgotten because at least
#: ``max_tracked_keys`` distinct keys were seen since their last access.
COLD_BUCKET = "inf"

# The Fenwick tree over access positions starts at this size and is rebuilt (live
# positions renumbered 1..n) whenever positions run out, into twice the live count:
# O(n) every >= n accesses, so O(1) amortised on top of O(log n) per access.
_MIN_TREE_SIZE = 64
_TREE_GROWTH = 2


def reuse_bucket(distance: int | None) -> str:
    """The log2 histogram bucket of a reuse distance.

    ``0``, ``1``, ``2-3``, ``4-7``, ... ; None (never seen, or forgotten) is
    :data:`COLD_BUCKET`.

    Raises:
        InvalidInputError: a negative distance.
    """
    if distance is None:
        return COLD_BUCKET
    if distance < 0:
        raise InvalidInputError(f"reuse distance must be >= 0, got {distance}")
    if distance < 2:
        return str(distance)
    low = 1 << (distance.bit_length() - 1)
    return f"{low}-{2 * low - 1}"


def _bucket_order(bucket: str) -> float:
    return math.inf if bucket == COLD_BUCKET else float(bucket.split("-")[0])


class _Fenwick:
    """Prefix sums over positions 1..size with point updates, O(log size) each."""

    __slots__ = ("_tree",)

    def __init__(self, size: int, ones: list[int] | None = None) -> None:
        tree = [0] * (size + 1)
        for pos in ones or ():
            tree[pos] += 1
        # Linear-time build: push each node's sum to its parent.
        for i in range(1, size + 1):
            parent = i + (i & -i)
            if parent <= size:
                tree[parent] += tree[i]
        self._tree = tree

    @property
    def size(self) -> int:
        return len(self._tree) - 1

    def add(self, pos: int, delta: int) -> None:
        tree = self._tree
        n = len(tree)
        while pos < n:
            tree[pos] += delta
            pos += pos & -pos

    def prefix(self, pos: int) -> int:
        """Sum over positions 1..pos."""
        tree = self._tree
        total = 0
        while pos > 0:
            total += tree[pos]
            pos -= pos & -pos
        return total


@dataclass(frozen=True, slots=True)
class WindowRatios:
    """Where the accesses of one time window were served.

    Attributes:
        start: window start (same clock as the ``now`` passed to ``record``).
        end: window end (exclusive).
        accesses: accesses in the window (>= 1).
        hot: share served from the hot tier.
        warm: share served from the warm tier.
        cold: share served from the cold tier.
        miss: share found in no tier.
    """

    start: float
    end: float
    accesses: int
    hot: float
    warm: float
    cold: float
    miss: float

    def as_dict(self) -> dict[str, float | int]:
        """A JSON-friendly dict."""
        return {
            "start": self.start,
            "end": self.end,
            "accesses": self.accesses,
            "hot": self.hot,
            "warm": self.warm,
            "cold": self.cold,
            "miss": self.miss,
        }


def _positive_float(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidInputError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
    return value


class AccessStats:
    """Reuse distances and per-window hit ratios of a stream of block accesses.

    The *reuse distance* of an access is the number of distinct other keys accessed
    since the previous access of the same key (0 = the same key twice in a row); it
    is exact, computed in O(log n) with a Fenwick tree over access positions that
    holds a 1 at each tracked key's latest position. At most ``max_tracked_keys``
    keys are remembered (least recently accessed forgotten first); a forgotten key
    had a reuse distance of at least ``max_tracked_keys``, and its next access is
    counted in the :data:`COLD_BUCKET` with first accesses. So the histogram is
    exact below ``max_tracked_keys``.

    Hit ratios are kept per time window of ``window_seconds`` (windows with no
    access are omitted), for the latest ``max_windows`` windows; an access older
    than every kept window still counts in the reuse distances and totals.

    Thread-safe (one lock).

    Args:
        window_seconds: length of a hit-ratio window.
        max_windows: windows kept.
        max_tracked_keys: keys whose last access is remembered.

    Raises:
        InvalidInputError: a parameter is not positive.

    Example:
        >>> stats = AccessStats(window_seconds=10)
        >>> for t, key in enumerate("abca"):
        ...     stats.record(key, "hot" if key == "a" else None, now=float(t))
        >>> stats.reuse_distance_histogram()
        {'2-3': 1, 'inf': 3}
    """

    def __init__(
        self,
        window_seconds: float = 60.0,
        max_windows: int = 60,
        max_tracked_keys: int = 1_000_000,
    ) -> None:
        self._window_seconds = _positive_float("window_seconds", window_seconds)
        self._max_windows = _positive_int("max_windows", max_windows)
        self._max_keys = _positive_int("max_tracked_keys", max_tracked_keys)
        self._lock = threading.Lock()
        # key -> position of its latest access, in access order (oldest first).
        self._last: OrderedDict[Hashable, int] = OrderedDict()
        self._tree = _Fenwick(_MIN_TREE_SIZE)
        self._next_pos = 1
        self._histogram: Counter[str] = Counter()
        # window index -> accesses per outcome (tier name or "miss").
        self._windows: dict[int, Counter[str]] = {}
        self._totals: Counter[str] = Counter()
        self._accesses = 0

    def record(self, key: Hashable, tier: str | None, now: float) -> None:
        """Record one access.

        Args:
            key: the block (any hashable).
            tier: where it was found (``"hot"``, ``"warm"``, ``"cold"``), None = miss.
            now: the access time in seconds (any clock, used consistently).

        Raises:
            InvalidInputError: an unhashable key, an unknown tier or a non-finite time.
        """
        if tier is not None and tier not in TIER_NAMES:
            raise InvalidInputError(f"tier must be one of {TIER_NAMES} or None, got {tier!r}")
        if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
            raise InvalidInputError(f"now must be a finite number of seconds, got {now!r}")
        try:
            hash(key)
        except TypeError as e:
            raise InvalidInputError(f"key must be hashable, got {type(key).__name__}") from e
        outcome = _MISS if tier is None else str(tier)
        with self._lock:
            self._accesses += 1
            self._totals[outcome] += 1
            self._histogram[reuse_bucket(self._touch(key))] += 1
            self._count_window(outcome, now)

    def _touch(self, key: Hashable) -> int | None:
        """Move ``key`` to the newest position; return its reuse distance."""
        if self._next_pos > self._tree.size:
            self._renumber()
        pos = self._next_pos
        self._next_pos += 1
        previous = self._last.pop(key, None)
        distance: int | None = None
        if previous is not None:
            # Keys whose latest access came after ``previous``: tracked keys newer
            # than it (the key itself is no longer in the tree after this add).
            self._tree.add(previous, -1)
            distance = self._tree.prefix(pos - 1) - self._tree.prefix(previous)
        self._last[key] = pos
        self._tree.add(pos, 1)
        if len(self._last) > self._max_keys:
            _, oldest = self._last.popitem(last=False)
            self._tree.add(oldest, -1)
        return distance

    def _renumber(self) -> None:
        # Positions only order the accesses: renumber the live ones 1..n, keeping order.
        for new, key in enumerate(self._last, start=1):
            self._last[key] = new
        live = len(self._last)
        self._tree = _Fenwick(max(_MIN_TREE_SIZE, _TREE_GROWTH * live), list(range(1, live + 1)))
        self._next_pos = live + 1

    def _count_window(self, outcome: str, now: float) -> None:
        index = math.floor(now / self._window_seconds)
        window = self._windows.get(index)
        if window is None:
            if len(self._windows) >= self._max_windows and index < min(self._windows):
                return  # older than every kept window
            window = self._windows[index] = Counter()
            if len(self._windows) > self._max_windows:
                del self._windows[min(self._windows)]
        window[outcome] += 1

    def reuse_distance_histogram(self) -> dict[str, int]:
        """Accesses per log2 bucket of reuse distance, smallest first, then ``inf``."""
        with self._lock:
            return {b: self._histogram[b] for b in sorted(self._histogram, key=_bucket_order)}

    def hit_ratios(self) -> list[WindowRatios]:
        """Per kept window with accesses, oldest first: where they were served."""
        with self._lock:
            windows = sorted(self._windows.items())
        return [self._ratios(index, counts) for index, counts in windows]

    def _ratios(self, index: int, counts: Counter[str]) -> WindowRatios:
        total = sum(counts.values())
        return WindowRatios(
            start=index * self._window_seconds,
            end=(index + 1) * self._window_seconds,
            accesses=total,
            hot=counts["hot"] / total,
            warm=counts["warm"] / total,
            cold=counts["cold"] / total,
            miss=counts[_MISS] / total,
        )

    def snapshot(self) -> dict[str, Any]:
        """A JSON-friendly summary: totals, overall ratios, histogram, windows."""
        histogram = self.reuse_distance_histogram()
        windows = self.hit_ratios()
        with self._lock:
            accesses = self._accesses
            totals = dict(self._totals)
            tracked = len(self._last)
        outcomes = (*TIER_NAMES, _MISS)
        return {
            "accesses": accesses,
            "tracked_keys": tracked,
            "max_tracked_keys": self._max_keys,
            "window_seconds": self._window_seconds,
            "counts": {o: totals.get(o, 0) for o in outcomes},
            "ratios": {o: (totals.get(o, 0) / accesses if accesses else 0.0) for o in outcomes},
            "reuse_distance": histogram,
            "windows": [w.as_dict() for w in windows],
        }


# =============================================================================
# Refcount invariants
# =============================================================================
#
# The store keeps, per block, how many sessions hold it (refcount) and how many
# readers have it pinned. Both are derived state: the session chains are the
# truth for refcounts. In debug mode the store re-derives them after every
# mutating operation and raises on the first disagreement, naming the sessions
# involved, so a bookkeeping bug surfaces where it happens rather than as a
# block freed under a reader or a leak found hours later.


@dataclass(frozen=True, slots=True)
class Leak:
    """A block still held when it should not be, and who holds it."""

    key: bytes
    refcount: int
    pins: int
    held_by: tuple[str, ...]  # sessions whose chain holds the block


def find_leaks(blocks: dict[Any, tuple[int, int]], chains: dict[str, list[Any]]) -> list[Leak]:
    """Blocks that are still referenced or pinned, with the sessions that hold them.

    After every session is deleted and every reader is done this must be empty;
    while sessions live it lists what they keep alive (for leak hunting).

    Args:
        blocks: (refcount, pins) per block key.
        chains: block chain per session id.
    """
    holders: dict[Any, list[str]] = {}
    for session_id, chain in chains.items():
        for key in dict.fromkeys(chain):
            holders.setdefault(key, []).append(session_id)
    return [
        Leak(bytes(key), refcount, pins, tuple(holders.get(key, ())))
        for key, (refcount, pins) in blocks.items()
        if refcount or pins
    ]


def check_refcounts(blocks: dict[Any, tuple[int, int]], chains: dict[str, list[Any]]) -> None:
    """Check the refcount invariants; raise on the first violation.

    Invariants:
        * every block's refcount equals the number of sessions whose chain holds it;
        * pins are never negative;
        * a block with refcount 0 and no pins does not exist (it was freed);
        * every block a session holds exists.

    Raises:
        InvariantViolationError: naming the block and the sessions involved.
    """
    expected: Counter[Any] = Counter()
    holders: dict[Any, list[str]] = {}
    for session_id, chain in chains.items():
        for key in dict.fromkeys(chain):
            expected[key] += 1
            holders.setdefault(key, []).append(session_id)
            if key not in blocks:
                raise InvariantViolationError(
                    f"session {session_id!r} holds block {_hex(key)}, which does not exist"
                )
    for key, (refcount, pins) in blocks.items():
        if pins < 0:
            raise InvariantViolationError(f"block {_hex(key)} has {pins} pins")
        if refcount != expected[key]:
            raise InvariantViolationError(
                f"block {_hex(key)} has refcount {refcount} but is held by "
                f"{expected[key]} sessions {holders.get(key, [])}"
            )
        if refcount == 0 and pins == 0:
            raise InvariantViolationError(
                f"block {_hex(key)} is held by nobody and pinned by nobody but was not freed"
            )


def _hex(key: Any) -> str:
    return key.hex() if isinstance(key, bytes) else repr(key)
