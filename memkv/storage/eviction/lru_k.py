"""Prefix-aware LRU-K with exact victim selection.

LRU-K score
-----------
A block keeps its last ``k`` access times ``t_1 > t_2 > ... > t_j`` (``j <= k``)
and scores ``s(now) = sum_i 1 / max(now - t_i, MIN_AGE)``; the lowest score is
evicted first. Two blocks' order under ``s`` drifts with ``now`` (one accessed
twice long ago can overtake one accessed once a while ago), so no single
time-invariant heap key reproduces it.

Exact victim selection without an O(n) scan
-------------------------------------------
Each *term* of the score, ``1 / max(now - t_i, MIN_AGE)``, is non-decreasing in
``t_i`` for every ``now``, so sorting blocks by ``t_i`` sorts them by their
i-th term at *every* instant: that order is time-invariant. The score is the
sum of the terms, a monotone aggregate, which is the setting of Fagin's
Threshold Algorithm (TA; Fagin, Lotem & Naor, PODS 2001). Candidates are
grouped by how many times ``j`` they hold (group ``j`` keeps ``j`` sorted lists,
list ``i`` ordered by ``t_i``), and a group is searched by reading its lists in
parallel from the oldest end. Every block met is scored exactly; after row
``d`` the threshold ``tau_d = sum_i term(row d of list i)`` bounds from below
the score of every block not yet met (it sits deeper in *every* list, so each
of its terms is at least the row's). The search stops as soon as the best
exact score is ``<= tau_d``. The result is therefore the exact argmin of the
design's score, not an approximation. Group 1 is answered by its first entry;
a group whose first-row threshold cannot beat the best already found is
skipped. The work is the TA depth, which is small when the lists agree (old
blocks are old in every list, the common case); its worst case is the group
size, with instance optimality among algorithms that read sorted lists. Each
access moves a key between groups: ``O(k log n)`` sorted-list updates.

Prefix awareness
----------------
A reader needs the whole prefix of a chain, so evicting a block whose
descendants stay cached makes them useless. ``insert(key, now, parent)``
links the block under its parent; only blocks with no cached children
(leaves) are candidates while any unpinned leaf exists, and interior blocks go
only when every leaf is pinned. A child that arrives before its parent is
linked when the parent is inserted.

Two refinements, each measured on the Mooncake trace by
``memkv/bench/trace_replay.py``:

* **Retained history ("ghost")**, as in the original LRU-K: the access times of
  recently evicted or removed keys are kept in a bounded FIFO and restored when
  the key comes back, so a block evicted between two turns of a conversation
  does not restart as a one-access block.
* **Superseded tails**: when a block gets a new child while its previous newest
  child is still a single-access leaf, that older child is demoted and goes
  before every other leaf (oldest first). In memkv this is exactly a session's
  partial last block: its hash changes when the session grows, so the old one
  will not be read again by its session. An access clears the mark.
* **Chain inheritance** (``inherit``): a block that extends its parent's chain
  (the parent has no other child, or only a never-hit leaf it supersedes)
  starts with the parent's older access times, so a returning conversation's
  new tail is valued like the rest of its chain, not as a one-access block.
* **Adaptive recency guard** (``recency_guard``): plain LRU-K keeps finished
  multi-turn chains too long once the cache is large (below LRU at 20% of the
  trace). The guard evicts the least recent leaf first when its last access is
  older than ``factor x lifetime``, where lifetime is LRU's (age of the n-th most
  recent distinct-key access, n = tracked keys); otherwise the exact LRU-K argmin
  decides. ``factor`` adapts ARC-style from ghost hits: a comeback of a key the
  guard evicted raises it (towards plain LRU-K, :data:`GUARD_MAX`), a comeback
  of a key the score evicted while LRU would still have held it lowers it
  (towards prefix-aware LRU, 1). ``recency_guard=False`` is the plain score.

Measured (hit ratio at 2/5/10/20% of distinct blocks; LRU .0787/.1954/.2784/.3446):
plain LRU-K .0881/.2144/.2917/.3399; default (guard + inheritance)
.0820/.2050/.2849/.3466 -- above LRU at every size, paying part of the small-cache gain.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic

from sortedcontainers import SortedList

from memkv.errors import InvalidInputError
from memkv.storage.eviction.policy import K, _already_tracked, _not_pinned, _still_pinned, _unknown

__all__ = ["DEFAULT_GHOST_FLOOR", "MIN_AGE", "LRUKPolicy", "lru_k_score"]

#: Smallest age used in the LRU-K score: guards ``now == t_i`` (and a clock that
#: steps back), in the caller's time unit. Far below any real inter-access gap.
MIN_AGE = 1e-9

#: Ghost entries kept at least, whatever the peak number of tracked keys was, so
#: a small tier still remembers a useful amount of history.
DEFAULT_GHOST_FLOOR = 1024

#: Multiplicative step of the recency guard's factor on each informative ghost
#: hit (ARC-style feedback; small so one comeback cannot swing the policy).
GUARD_STEP = 0.05

#: Largest recency-guard factor: past it the guard never fires before the
#: score does, i.e. the policy is plain LRU-K.
GUARD_MAX = 8.0


def lru_k_score(times: tuple[float, ...], now: float) -> float:
    """The LRU-K score of a block: ``sum(1 / max(now - t_i, MIN_AGE))`` over its times.

    Args:
        times: the block's last access times (any order).
        now: the current time, in the same unit.

    Returns:
        The score; higher means more worth keeping.
    """
    s = 0.0
    for t in times:
        age = now - t
        s += 1.0 / (age if age > MIN_AGE else MIN_AGE)
    return s


class _ScoreIndex:
    """Keys ordered for exact argmin of the LRU-K score by the Threshold Algorithm.

    Keys are identified by an int ``uid``. Group ``j`` (``1 <= j <= k``) holds keys
    with ``j`` recorded times in ``j`` sorted lists of ``(t_i, uid)``; list ``i``
    is ordered by the i-th most recent time.
    """

    __slots__ = ("_groups", "_times")

    def __init__(self, k: int) -> None:
        self._groups: list[list[SortedList]] = [
            [SortedList() for _ in range(j)] for j in range(1, k + 1)
        ]
        self._times: dict[int, tuple[float, ...]] = {}

    def __len__(self) -> int:
        return len(self._times)

    def add(self, uid: int, times: tuple[float, ...]) -> None:
        self._times[uid] = times
        for lst, t in zip(self._groups[len(times) - 1], times, strict=True):
            lst.add((t, uid))

    def discard(self, uid: int) -> None:
        times = self._times.pop(uid)
        for lst, t in zip(self._groups[len(times) - 1], times, strict=True):
            lst.remove((t, uid))

    def least_recent(self) -> tuple[float, int] | None:
        """``(t_1, uid)`` of the key whose latest access is the oldest, or None if empty."""
        oldest: tuple[float, int] | None = None
        for lists in self._groups:
            if lists and lists[0] and (oldest is None or lists[0][0] < oldest):
                oldest = lists[0][0]
        return oldest

    def argmin(self, now: float) -> tuple[int, float] | None:
        """``(uid, score)`` of the lowest exact score, or None if empty.

        Ties go to the key met first (oldest times, then oldest insertion).
        """
        # The hot loop of eviction: terms are inlined (no max()/sum() calls), with
        # exactly the arithmetic of lru_k_score so that scores compare equal.
        best_uid = -1
        best = float("inf")
        times_of = self._times
        for lists in self._groups:
            if not lists[0]:
                continue
            # Lower bound of the whole group: the sum of its lists' oldest terms.
            floor = 0.0
            for lst in lists:
                age = now - lst[0][0]
                floor += 1.0 / (age if age > MIN_AGE else MIN_AGE)
            if floor >= best:
                continue
            seen: set[int] = set()
            for row in zip(*lists, strict=True):
                tau = 0.0
                for t, uid in row:
                    age = now - t
                    tau += 1.0 / (age if age > MIN_AGE else MIN_AGE)
                    if uid in seen:
                        continue
                    seen.add(uid)
                    s = 0.0
                    for ti in times_of[uid]:
                        age = now - ti
                        s += 1.0 / (age if age > MIN_AGE else MIN_AGE)
                    if s < best:
                        best, best_uid = s, uid
                # Every key not met yet lies deeper in every list: its score >= tau.
                if best <= tau:
                    break
        return None if best_uid < 0 else (best_uid, best)


class _Rule(enum.Enum):
    """Which rule chose a victim (the recency guard learns from comebacks)."""

    SUPERSEDED = enum.auto()
    GUARD = enum.auto()
    SCORE = enum.auto()


class _Pool(enum.Enum):
    """Which candidate set an entry is filed in."""

    NONE = enum.auto()  # pinned: never a victim
    SUPERSEDED = enum.auto()  # a leaf replaced by a newer sibling: first to go
    LEAF = enum.auto()  # no cached children (or prefix awareness off)
    INTERIOR = enum.auto()  # has cached children: only when every leaf is pinned


@dataclass(slots=True)
class _Entry(Generic[K]):
    key: K
    uid: int
    times: tuple[float, ...]  # most recent first, at most k
    parent: K | None
    children: set[K] = field(default_factory=set)  # cached children
    newest_child: K | None = None
    pins: int = 0
    hit: bool = False  # accessed since it was inserted
    superseded: bool = False
    pool: _Pool = _Pool.NONE


class LRUKPolicy(Generic[K]):
    """Prefix-aware LRU-K with exact victim selection (see the module docstring).

    Args:
        k: access times remembered per block (``EvictionConfig.k``).
        prefix_aware: prefer leaves of the chain forest; if False every unpinned
            key is a candidate and ``parent`` is ignored.
        ghost_capacity: how many evicted/removed keys keep their history for a
            comeback. ``None``: as many as the most keys ever tracked at once (at
            least :data:`DEFAULT_GHOST_FLOOR`), LRU-K's classic retained-information
            period of about one cache lifetime; ``0`` disables it.
        inherit: a block extending its parent's chain starts with the parent's
            older access times (module docstring).
        recency_guard: the adaptive recency guard (module docstring); False
            gives the plain exact LRU-K score.

    Raises:
        InvalidInputError: ``k < 1`` or a negative ``ghost_capacity``.

    Example:
        >>> p = LRUKPolicy(k=2)
        >>> p.insert("hot", 0.0); p.access("hot", 1.0); p.insert("cold", 1.5)
        >>> p.pop_victim(10.0)   # 1/10 + 1/9 for "hot" beats 1/8.5 for "cold"
        'cold'
    """

    def __init__(
        self,
        k: int = 3,
        *,
        prefix_aware: bool = True,
        ghost_capacity: int | None = None,
        inherit: bool = True,
        recency_guard: bool = True,
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidInputError(f"k must be an int >= 1, got {k!r}")
        if ghost_capacity is not None and ghost_capacity < 0:
            raise InvalidInputError(f"ghost_capacity must be >= 0 or None, got {ghost_capacity!r}")
        self._k = k
        self._prefix_aware = prefix_aware
        self._ghost_capacity = ghost_capacity
        self._inherit = inherit and prefix_aware
        self._guard = recency_guard
        self._guard_factor = 1.0 + GUARD_STEP
        self._recency: SortedList = SortedList()  # t_1 of tracked and ghost keys
        self._by_recency: set[K] = set()  # ghost keys the guard evicted
        self._by_score: set[K] = set()  # ghost keys the score evicted though LRU kept them
        self._lifetime = 0.0
        self._entries: dict[K, _Entry[K]] = {}
        self._by_uid: dict[int, _Entry[K]] = {}
        self._uids = itertools.count()
        # Children inserted while their parent was not tracked: parent -> children.
        self._orphans: dict[K, set[K]] = {}
        self._ghost: OrderedDict[K, tuple[float, ...]] = OrderedDict()
        self._peak = 0
        self._leaves = _ScoreIndex(k)
        self._interior = _ScoreIndex(k)
        self._superseded: SortedList = SortedList()  # (t_1, uid), oldest first

    # -- public API ------------------------------------------------------------

    @property
    def k(self) -> int:
        """Access times remembered per block."""
        return self._k

    def insert(self, key: K, now: float, parent: K | None = None) -> None:
        """Track a newly cached block; restores its history if it is in the ghost.

        Args:
            key: the block.
            now: the current time (counts as an access).
            parent: the previous block of its chain, if known.

        Raises:
            InvalidInputError: ``key`` is already tracked (use :meth:`access`), or
                ``parent == key``.
        """
        if key in self._entries:
            raise _already_tracked(key)
        if parent is not None and parent == key:
            raise InvalidInputError(f"insert: key {key!r} cannot be its own parent")
        if not self._prefix_aware:
            parent = None
        history = self._ghost.pop(key, ())
        if history:
            self._recency.remove(history[0])
            # A comeback proves its eviction wrong: trust the other rule a bit more.
            if key in self._by_recency:
                self._guard_factor = min(GUARD_MAX, self._guard_factor * (1 + GUARD_STEP))
            elif key in self._by_score:
                self._guard_factor = max(1.0, self._guard_factor / (1 + GUARD_STEP))
            self._by_recency.discard(key)
            self._by_score.discard(key)
        if self._inherit and parent is not None:
            pe = self._entries.get(parent)
            if pe is not None and self._continues(pe):
                history = self._merge(history, pe.times[1:])
        entry: _Entry[K] = _Entry(key, next(self._uids), self._push(history, now), parent)
        self._entries[key] = entry
        self._recency.add(entry.times[0])
        self._by_uid[entry.uid] = entry
        self._peak = max(self._peak, len(self._entries))
        waiting = self._orphans.pop(key, None)
        if waiting:
            entry.children = waiting
        if parent is not None:
            pe = self._entries.get(parent)
            if pe is None:
                self._orphans.setdefault(parent, set()).add(key)
            else:
                self._adopt(pe, key)
        self._file(entry)

    def access(self, key: K, now: float) -> None:
        """Record a hit on ``key`` at ``now``.

        Raises:
            InvalidInputError: ``key`` is not tracked.
        """
        entry = self._get("access", key)
        self._unfile(entry)
        self._recency.remove(entry.times[0])
        entry.times = self._push(entry.times, now)
        self._recency.add(entry.times[0])
        entry.hit = True
        entry.superseded = False
        self._file(entry)

    def remove(self, key: K) -> None:
        """Forget ``key`` (its history goes to the ghost).

        Raises:
            InvalidInputError: ``key`` is not tracked, or is pinned (unpin it first).
        """
        entry = self._get("remove", key)
        if entry.pins:
            raise _still_pinned(key, entry.pins)
        self._drop(entry)

    def pin(self, key: K) -> None:
        """Protect ``key`` from eviction until as many :meth:`unpin` calls.

        Raises:
            InvalidInputError: ``key`` is not tracked.
        """
        entry = self._get("pin", key)
        entry.pins += 1
        if entry.pins == 1:
            self._unfile(entry)

    def unpin(self, key: K) -> None:
        """Drop one pin of ``key``.

        Raises:
            InvalidInputError: ``key`` is not tracked, or is not pinned.
        """
        entry = self._get("unpin", key)
        if entry.pins == 0:
            raise _not_pinned(key)
        entry.pins -= 1
        if entry.pins == 0:
            self._file(entry)

    def pop_victim(self, now: float) -> K | None:
        """Forget and return the victim, or ``None`` when every key is pinned (or none is tracked).

        Order: superseded leaves (oldest first), then the leaf with the lowest
        LRU-K score, then, only if every leaf is pinned, the interior block with
        the lowest score.
        """
        uid: int | None = None
        by = _Rule.SUPERSEDED
        if self._superseded:
            uid = self._superseded[0][1]
        elif (stale := self._stale(now)) is not None:
            uid, by = stale, _Rule.GUARD
        else:
            for index in (self._leaves, self._interior):
                found = index.argmin(now)
                if found is not None:
                    uid, by = found[0], _Rule.SCORE
                    break
        if uid is None:
            return None
        entry = self._by_uid[uid]
        self._drop(entry)
        if self._guard and entry.key in self._ghost:
            if by is _Rule.GUARD:
                self._by_recency.add(entry.key)
            elif by is _Rule.SCORE and now - entry.times[0] < self._lifetime:
                self._by_score.add(entry.key)
        return entry.key

    def score(self, key: K, now: float) -> float:
        """The LRU-K score of ``key`` at ``now`` (see :func:`lru_k_score`).

        Raises:
            InvalidInputError: ``key`` is not tracked.
        """
        return lru_k_score(self._get("score", key).times, now)

    def ghost_size(self) -> int:
        """Keys whose history is retained after they left."""
        return len(self._ghost)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    # -- internals -------------------------------------------------------------

    def _get(self, op: str, key: K) -> _Entry[K]:
        entry = self._entries.get(key)
        if entry is None:
            raise _unknown(op, key)
        return entry

    def _stale(self, now: float) -> int | None:
        """The recency guard's victim: the least recent leaf, if older than factor x lifetime."""
        n = len(self._entries)
        if not self._guard or n == 0:
            return None
        # LRU's lifetime: age of the n-th most recent access among distinct keys.
        self._lifetime = now - self._recency[-n]
        oldest = self._leaves.least_recent()
        if oldest is not None and now - oldest[0] > self._guard_factor * self._lifetime:
            return oldest[1]
        return None

    def _continues(self, parent: _Entry[K]) -> bool:
        """Whether a new child of ``parent`` extends its chain rather than branching off it."""
        children = parent.children
        if not children:
            return True
        if len(children) > 1:
            return False
        only = self._entries[next(iter(children))]
        return not only.hit and not only.children

    def _merge(self, a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
        if not a:
            return b
        if not b:
            return a
        return tuple(sorted({*a, *b}, reverse=True)[: self._k - 1])

    def _push(self, times: tuple[float, ...], now: float) -> tuple[float, ...]:
        return (float(now), *times[: self._k - 1])

    def _pool_of(self, entry: _Entry[K]) -> _Pool:
        if entry.pins:
            return _Pool.NONE
        if not self._prefix_aware:
            return _Pool.LEAF
        if entry.children:
            return _Pool.INTERIOR
        return _Pool.SUPERSEDED if entry.superseded else _Pool.LEAF

    def _file(self, entry: _Entry[K]) -> None:
        pool = self._pool_of(entry)
        entry.pool = pool
        if pool is _Pool.LEAF:
            self._leaves.add(entry.uid, entry.times)
        elif pool is _Pool.INTERIOR:
            self._interior.add(entry.uid, entry.times)
        elif pool is _Pool.SUPERSEDED:
            self._superseded.add((entry.times[0], entry.uid))

    def _unfile(self, entry: _Entry[K]) -> None:
        pool = entry.pool
        if pool is _Pool.LEAF:
            self._leaves.discard(entry.uid)
        elif pool is _Pool.INTERIOR:
            self._interior.discard(entry.uid)
        elif pool is _Pool.SUPERSEDED:
            self._superseded.remove((entry.times[0], entry.uid))
        entry.pool = _Pool.NONE

    def _refile(self, entry: _Entry[K]) -> None:
        if self._pool_of(entry) is not entry.pool:
            self._unfile(entry)
            self._file(entry)

    def _adopt(self, parent: _Entry[K], key: K) -> None:
        """Link ``key`` under ``parent``; demote the sibling it supersedes."""
        previous = parent.newest_child
        if previous is not None and previous in parent.children:
            sibling = self._entries[previous]
            # A single-access leaf followed by a new sibling is a replaced partial tail.
            if not sibling.children and not sibling.hit and not sibling.superseded:
                sibling.superseded = True
                self._refile(sibling)
        parent.newest_child = key
        parent.superseded = False  # it was extended after all
        parent.children.add(key)
        if len(parent.children) == 1:
            self._refile(parent)

    def _drop(self, entry: _Entry[K]) -> None:
        """Forget ``entry``: unlink it from the chain forest and keep its history in the ghost."""
        self._unfile(entry)
        del self._entries[entry.key]
        del self._by_uid[entry.uid]
        if entry.parent is not None:
            pe = self._entries.get(entry.parent)
            if pe is not None:
                pe.children.discard(entry.key)
                if pe.newest_child == entry.key:
                    pe.newest_child = None
                if not pe.children:
                    self._refile(pe)
            else:
                waiting = self._orphans.get(entry.parent)
                if waiting is not None:
                    waiting.discard(entry.key)
                    if not waiting:
                        del self._orphans[entry.parent]
        if entry.children:
            # They wait for this block to come back (or to be removed themselves).
            self._orphans[entry.key] = entry.children
        self._remember(entry.key, entry.times)

    def _remember(self, key: K, times: tuple[float, ...]) -> None:
        cap = self._ghost_capacity
        if cap is None:
            cap = max(self._peak, DEFAULT_GHOST_FLOOR)
        if cap == 0:
            self._recency.remove(times[0])
            return
        self._ghost[key] = times
        self._ghost.move_to_end(key)
        while len(self._ghost) > cap:
            gk, old = self._ghost.popitem(last=False)
            self._recency.remove(old[0])
            self._by_recency.discard(gk)
            self._by_score.discard(gk)
