"""Plain least-recently-used eviction: the baseline every measurement compares with."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic

from memkv.storage.eviction.policy import K, _already_tracked, _not_pinned, _still_pinned, _unknown

__all__ = ["LRUPolicy"]


class LRUPolicy(Generic[K]):
    """Plain least-recently-used, the baseline: O(1) per operation.

    ``parent`` is accepted for interface compatibility and ignored. A pinned key
    leaves the recency order and re-enters it as most recent when its last pin
    is dropped (a pinned block is one being read, i.e. used).

    Example:
        >>> p = LRUPolicy()
        >>> p.insert("a", 1.0); p.insert("b", 2.0); p.access("a", 3.0)
        >>> p.pop_victim(4.0)
        'b'
    """

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()  # unpinned, least recent first
        self._pins: dict[K, int] = {}

    def insert(self, key: K, now: float, parent: K | None = None) -> None:
        """Track a newly cached block as the most recent.

        Raises:
            InvalidInputError: ``key`` is already tracked (use :meth:`access`).
        """
        if key in self:
            raise _already_tracked(key)
        self._order[key] = None

    def access(self, key: K, now: float) -> None:
        """Make ``key`` the most recent.

        Raises:
            InvalidInputError: ``key`` is not tracked.
        """
        if key in self._order:
            self._order.move_to_end(key)
        elif key not in self._pins:
            raise _unknown("access", key)

    def remove(self, key: K) -> None:
        """Forget ``key``.

        Raises:
            InvalidInputError: ``key`` is not tracked, or is pinned (unpin it first).
        """
        if key in self._pins:
            raise _still_pinned(key, self._pins[key])
        if key not in self._order:
            raise _unknown("remove", key)
        del self._order[key]

    def pin(self, key: K) -> None:
        """Protect ``key`` from eviction until as many :meth:`unpin` calls.

        Raises:
            InvalidInputError: ``key`` is not tracked.
        """
        if key in self._pins:
            self._pins[key] += 1
        elif key in self._order:
            del self._order[key]
            self._pins[key] = 1
        else:
            raise _unknown("pin", key)

    def unpin(self, key: K) -> None:
        """Drop one pin of ``key``.

        Raises:
            InvalidInputError: ``key`` is not tracked, or is not pinned.
        """
        count = self._pins.get(key)
        if count is None:
            if key in self._order:
                raise _not_pinned(key)
            raise _unknown("unpin", key)
        if count == 1:
            del self._pins[key]
            self._order[key] = None
        else:
            self._pins[key] = count - 1

    def pop_victim(self, now: float) -> K | None:
        """Forget and return the least recent unpinned key, or ``None`` if there is none."""
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        return key

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pins

    def __len__(self) -> int:
        return len(self._order) + len(self._pins)
