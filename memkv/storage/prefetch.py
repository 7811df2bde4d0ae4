"""A first-order Markov prefetcher over observed block accesses.

The store reports every access with :meth:`MarkovPrefetcher.observe`, tagged
with a *stream* (the reader, e.g. the session id), and transitions are learnt
per stream: ``A`` then ``B`` in one session is a transition ``A -> B`` even if
other sessions read in between. ``P(B | A) = count(A -> B) / count(A -> *)``.

:meth:`MarkovPrefetcher.predict` answers "which blocks will be read within the
next ``window`` steps?": for every candidate ``s`` the probability that a walk
from the current block *visits* ``s`` at least once within ``window`` steps
(not just stands on it at step ``window``). It is computed exactly by
enumerating the walks of the sparse successor graph depth-first: a walk's
probability is added to ``s`` the first time the walk reaches ``s``, since
every continuation of that walk has visited ``s``. Walks whose probability
falls below ``min_path_mass`` are cut; each reported probability is then a
lower bound, low by at most the total mass cut (``stats().pruned_mass``
accumulates it). Mass of successors the model dropped or never saw visits
nothing known, so it is never over-counted.

Memory is bounded: at most ``max_successors`` out-edges per state (a new
successor displaces the weakest one, the least recently reinforced among
equals) and at most ``max_tracked_keys`` states (the least recently observed is
forgotten), plus at most ``max_streams`` remembered streams.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from memkv.errors import InvalidInputError
from memkv.storage.config import PrefetchConfig

__all__ = [
    "DEFAULT_MAX_STREAMS",
    "DEFAULT_MIN_PATH_MASS",
    "MarkovPrefetcher",
    "PrefetchStats",
]

K = TypeVar("K", bound=Hashable)

#: Walks less likely than this are not followed: with the default threshold of
#: 0.6 a cut walk could move a probability by at most this, and it keeps one
#: prediction to at most ``window / DEFAULT_MIN_PATH_MASS`` walk steps.
DEFAULT_MIN_PATH_MASS = 1e-3

#: Streams (readers) whose last access is remembered, least recent forgotten.
DEFAULT_MAX_STREAMS = 100_000

# A visit probability is a sum of walk masses: 0.5 + 0.5 may round below 1.0.
_ROUNDING_SLACK = 1e-12

#: Predicted keys remembered to count prefetch hits, per allowed prediction.
_PENDING_PER_PREDICTION = 64


@dataclass(frozen=True, slots=True)
class PrefetchStats:
    """A snapshot of the prefetcher's model and outcomes.

    Attributes:
        states: keys with a state (observed, not forgotten).
        transitions: out-edges kept over all states.
        observations: accesses observed.
        predictions: calls to ``predict``.
        predicted_keys: keys returned by those calls.
        hits: predicted keys that were then observed (while still remembered).
        pruned_mass: total walk probability cut by ``min_path_mass``.
    """

    states: int
    transitions: int
    observations: int
    predictions: int
    predicted_keys: int
    hits: int
    pruned_mass: float

    @property
    def precision(self) -> float:
        """Hits per predicted key (0 before any prediction)."""
        return self.hits / self.predicted_keys if self.predicted_keys else 0.0


@dataclass(slots=True)
class _State(Generic[K]):
    total: int = 0  # transitions observed out of this state, including dropped edges
    successors: dict[K, int] = field(default_factory=dict)  # insertion order = reinforcement


class MarkovPrefetcher(Generic[K]):
    """First-order Markov model of block accesses, learnt per stream.

    Args:
        config: ``lookahead_window``, ``prefetch_threshold``,
            ``max_prefetch_blocks``, ``max_tracked_keys``, ``max_successors``.
        min_path_mass: walks below this probability are cut (0 = exact).
        max_streams: streams whose last access is remembered.

    Raises:
        InvalidInputError: ``min_path_mass`` outside ``[0, 1)`` or ``max_streams < 1``.

    Example:
        >>> from memkv.storage.config import PrefetchConfig
        >>> p = MarkovPrefetcher(PrefetchConfig())
        >>> for key in "ABCABC":
        ...     p.observe(key, stream="session-1")
        >>> p.predict("A")
        [('B', 1.0), ('C', 1.0)]
    """

    def __init__(
        self,
        config: PrefetchConfig,
        *,
        min_path_mass: float = DEFAULT_MIN_PATH_MASS,
        max_streams: int = DEFAULT_MAX_STREAMS,
    ) -> None:
        if not 0.0 <= min_path_mass < 1.0:
            raise InvalidInputError(f"min_path_mass must be in [0, 1), got {min_path_mass!r}")
        if max_streams < 1:
            raise InvalidInputError(f"max_streams must be >= 1, got {max_streams!r}")
        self.config = config
        self._min_mass = min_path_mass
        self._max_streams = max_streams
        self._states: OrderedDict[K, _State[K]] = OrderedDict()  # least recently observed first
        self._preds: dict[K, set[K]] = {}  # reverse edges, so forget() can cut incoming ones
        self._last: OrderedDict[Hashable, K] = OrderedDict()  # stream -> its last key
        self._streams_at: dict[K, set[Hashable]] = {}  # key -> streams whose last it is
        self._pending: OrderedDict[K, None] = OrderedDict()  # predicted, not yet observed
        self._transitions = 0
        self._observations = 0
        self._predictions = 0
        self._predicted_keys = 0
        self._hits = 0
        self._pruned = 0.0

    # -- learning --------------------------------------------------------------

    def observe(self, key: K, stream: Hashable = None) -> None:
        """Record an access of ``key`` by ``stream`` (``None``: one shared stream).

        A repeated access of the same key by the same stream is not a transition.
        """
        self._observations += 1
        if key in self._pending:
            del self._pending[key]
            self._hits += 1
        previous = self._last.get(stream)
        if previous is not None and previous != key:
            source = self._states.get(previous)
            if source is not None:
                self._count(previous, source, key)
        self._set_last(stream, previous, key)
        if key in self._states:
            self._states.move_to_end(key)
        else:
            self._states[key] = _State()
            if len(self._states) > self.config.max_tracked_keys:
                old, state = self._states.popitem(last=False)
                self._drop_edges(old, state)

    def forget(self, key: K) -> None:
        """Forget everything about ``key``: its state, edges into it, streams ending at it.

        Unknown keys are ignored (forgetting is idempotent).
        """
        state = self._states.pop(key, None)
        if state is not None:
            self._drop_edges(key, state)
        for source_key in self._preds.pop(key, set()):
            source = self._states.get(source_key)
            if source is not None and source.successors.pop(key, None) is not None:
                self._transitions -= 1
        for stream in self._streams_at.pop(key, set()):
            del self._last[stream]
        self._pending.pop(key, None)

    # -- prediction ------------------------------------------------------------

    def predict(
        self,
        current: K,
        *,
        window: int | None = None,
        threshold: float | None = None,
        limit: int | None = None,
    ) -> list[tuple[K, float]]:
        """Keys likely to be accessed within ``window`` steps after ``current``.

        Args:
            current: the key just accessed.
            window: steps to look ahead (default ``lookahead_window``).
            threshold: minimum probability of a visit (default ``prefetch_threshold``).
            limit: at most this many keys (default ``max_prefetch_blocks``).

        Returns:
            ``(key, probability)`` pairs with ``probability >= threshold``, most
            likely first (ties: nearest first); empty when ``current`` is unknown.

        Raises:
            InvalidInputError: ``window < 1``, ``threshold`` outside ``(0, 1]``,
                or ``limit < 0``.
        """
        cfg = self.config
        w = cfg.lookahead_window if window is None else window
        th = cfg.prefetch_threshold if threshold is None else threshold
        n = cfg.max_prefetch_blocks if limit is None else limit
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise InvalidInputError(f"window must be an int >= 1, got {w!r}")
        if not 0.0 < th <= 1.0:
            raise InvalidInputError(f"threshold must be in (0, 1], got {th!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInputError(f"limit must be an int >= 0, got {n!r}")
        self._predictions += 1
        if n == 0 or current not in self._states:
            return []
        visits = self._visit_probabilities(current, w)
        # dict order is discovery order (nearest first), which the stable sort keeps for ties
        ranked = sorted(visits.items(), key=lambda kv: -kv[1])
        # A probability is a sum of walk masses; allow for float rounding at the threshold.
        result = [(k, min(p, 1.0)) for k, p in ranked if p >= th - _ROUNDING_SLACK][:n]
        self._predicted_keys += len(result)
        for k, _ in result:
            self._pending[k] = None
            self._pending.move_to_end(k)
        while len(self._pending) > _PENDING_PER_PREDICTION * max(cfg.max_prefetch_blocks, 1):
            self._pending.popitem(last=False)
        return result

    def stats(self) -> PrefetchStats:
        """A snapshot of the model size and of the prediction outcomes."""
        return PrefetchStats(
            states=len(self._states),
            transitions=self._transitions,
            observations=self._observations,
            predictions=self._predictions,
            predicted_keys=self._predicted_keys,
            hits=self._hits,
            pruned_mass=self._pruned,
        )

    def successors(self, key: K) -> dict[K, float]:
        """``P(next | key)`` for each kept successor (empty when unknown)."""
        state = self._states.get(key)
        if state is None or not state.total:
            return {}
        return {s: c / state.total for s, c in state.successors.items()}

    # -- internals -------------------------------------------------------------

    def _count(self, source_key: K, source: _State[K], key: K) -> None:
        source.total += 1
        succ = source.successors
        count = succ.pop(key, None)
        if count is None:
            if len(succ) >= self.config.max_successors:
                # The weakest edge goes; min() returns the first of equals, the least
                # recently reinforced, since reinforcing moves an edge to the end.
                weakest = min(succ, key=succ.__getitem__)
                del succ[weakest]
                self._unlink(source_key, weakest)
                self._transitions -= 1
            count = 0
            self._transitions += 1
            self._preds.setdefault(key, set()).add(source_key)
        succ[key] = count + 1

    def _set_last(self, stream: Hashable, previous: K | None, key: K) -> None:
        if previous is not None:
            self._discard_stream(previous, stream)
        self._last[stream] = key
        self._last.move_to_end(stream)
        self._streams_at.setdefault(key, set()).add(stream)
        if len(self._last) > self._max_streams:
            old_stream, old_key = self._last.popitem(last=False)
            self._discard_stream(old_key, old_stream)

    def _discard_stream(self, key: K, stream: Hashable) -> None:
        streams = self._streams_at.get(key)
        if streams is not None:
            streams.discard(stream)
            if not streams:
                del self._streams_at[key]

    def _unlink(self, source_key: K, dest: K) -> None:
        preds = self._preds.get(dest)
        if preds is not None:
            preds.discard(source_key)
            if not preds:
                del self._preds[dest]

    def _drop_edges(self, key: K, state: _State[K]) -> None:
        for dest in state.successors:
            self._unlink(key, dest)
        self._transitions -= len(state.successors)

    def _visit_probabilities(self, current: K, window: int) -> dict[K, float]:
        """P(visit s within ``window`` steps from ``current``) for every reachable s.

        Walks are extended one step per level (breadth first), so the dict's
        insertion order is nearest first.
        """
        visits: dict[K, float] = {}
        min_mass = self._min_mass
        states = self._states
        # A walk: (where it is, its probability, the nodes it has visited).
        level: list[tuple[K, float, tuple[K, ...]]] = [(current, 1.0, (current,))]
        for _ in range(window):
            next_level: list[tuple[K, float, tuple[K, ...]]] = []
            for node, mass, path in level:
                state = states.get(node)
                if state is None or not state.total:
                    continue  # nothing known after it: its mass visits nothing further
                for succ, count in state.successors.items():
                    q = mass * count / state.total
                    if q < min_mass:
                        self._pruned += q
                        continue
                    if succ in path:
                        next_level.append((succ, q, path))
                    else:
                        visits[succ] = visits.get(succ, 0.0) + q
                        next_level.append((succ, q, (*path, succ)))
            level = next_level
        return visits
