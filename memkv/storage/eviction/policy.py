"""What a memory tier needs from an eviction policy, and the errors of its misuse."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, TypeVar

from memkv.errors import InvalidInputError

__all__ = ["EvictionPolicy", "K"]

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(Protocol[K]):
    """What a memory tier needs from an eviction policy."""

    def insert(self, key: K, now: float, parent: K | None = None) -> None:
        """Track a newly cached block (counts as an access); ``parent`` precedes it in its chain."""
        ...

    def access(self, key: K, now: float) -> None:
        """Record a hit."""
        ...

    def remove(self, key: K) -> None:
        """Forget a block that left for another reason (deleted, moved to another tier)."""
        ...

    def pin(self, key: K) -> None:
        """Protect a block from eviction (refcounted)."""
        ...

    def unpin(self, key: K) -> None:
        """Drop one pin."""
        ...

    def pop_victim(self, now: float) -> K | None:
        """Choose and forget the victim; ``None`` when nothing is evictable."""
        ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


def _unknown(op: str, key: object) -> InvalidInputError:
    return InvalidInputError(f"{op}: key {key!r} is not tracked by this policy; insert() it first")


def _already_tracked(key: object) -> InvalidInputError:
    return InvalidInputError(f"insert: key {key!r} is already tracked; use access() for a hit")


def _still_pinned(key: object, pins: int) -> InvalidInputError:
    return InvalidInputError(f"remove: key {key!r} is pinned {pins} time(s); unpin it first")


def _not_pinned(key: object) -> InvalidInputError:
    return InvalidInputError(f"unpin: key {key!r} is not pinned (its pin count would go below 0)")
