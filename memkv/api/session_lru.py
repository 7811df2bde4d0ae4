"""A bounded least-recently-used map keyed by session id (the gateway's per-session
caches: layouts, read routes, the front door's engine affinity)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["SessionLRU"]

_V = TypeVar("_V")


class SessionLRU(Generic[_V]):
    """A bounded least-recently-used map of session id to ``_V``."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[str, _V] = OrderedDict()

    def get(self, session_id: str) -> _V | None:
        entry = self._entries.get(session_id)
        if entry is not None:
            self._entries.move_to_end(session_id)
        return entry

    def put(self, session_id: str, entry: _V) -> None:
        self._entries[session_id] = entry
        self._entries.move_to_end(session_id)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def drop(self, session_id: str) -> None:
        self._entries.pop(session_id, None)
