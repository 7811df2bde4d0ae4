"""The stored responses of a router shard's sessions (:mod:`memkv.protocol.responses`).

Kept by session, each as the document the front door stored (msgpack of a
:class:`~memkv.protocol.responses.StoredResponse`), which the router never
reads. A session's responses go when the session is deleted. A response may be
stored for a session the table does not hold (an engine with no connector
never creates the session's KV): it is kept until it, or that session, is
deleted.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["ResponseTable"]


class ResponseTable:
    """session id -> response id -> document, and the bytes they hold."""

    def __init__(self) -> None:
        self._by_session: dict[str, dict[str, bytes]] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return sum(len(r) for r in self._by_session.values())

    def restore(self, session_id: str, response_id: str, document: bytes) -> None:
        """Keep ``document`` (a response stored again replaces its document)."""
        held = self._by_session.setdefault(session_id, {})
        old = held.get(response_id)
        self.bytes += len(document) - (len(old) if old is not None else 0)
        held[response_id] = document

    def get(self, session_id: str, response_id: str) -> bytes | None:
        return self._by_session.get(session_id, {}).get(response_id)

    def remove(self, session_id: str, response_id: str) -> bool:
        held = self._by_session.get(session_id)
        if held is None or response_id not in held:
            return False
        self.bytes -= len(held.pop(response_id))
        if not held:
            del self._by_session[session_id]
        return True

    def drop(self, session_id: str) -> None:
        """Forget every response of a deleted session."""
        for document in self._by_session.pop(session_id, {}).values():
            self.bytes -= len(document)

    def entries(self) -> Iterator[tuple[str, str, bytes]]:
        """``(session, response id, document)`` of every response (a snapshot)."""
        for session_id, held in self._by_session.items():
            for response_id, document in held.items():
                yield session_id, response_id, document
