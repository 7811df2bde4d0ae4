"""Response chains as a gateway reads and writes them: a stored response's whole input
(its predecessors' input and output items, oldest first), and the session of a
conversation that sends its whole history each turn instead of a
``previous_response_id``.

Stored responses live with their session on its router shard
(:mod:`memkv.router.responses`); this process keeps the last ones it read or
wrote (:data:`CACHED_RESPONSES`), so continuing a chain costs one router call
at most.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from memkv.api.responses.items import Item, chat_messages
from memkv.api.session_lru import SessionLRU
from memkv.errors import InvalidInputError
from memkv.protocol.responses import StoredResponse, session_of_response

__all__ = ["ChainBook", "MAX_CHAIN", "StoredTurn"]

#: The longest chain followed (a chain is one response per turn of a conversation).
MAX_CHAIN = 10_000
#: Stored responses this gateway process remembers (most recent kept).
CACHED_RESPONSES = 10_000
#: Conversations whose next turn this process can tell by its history.
CONVERSATIONS = 100_000


class StoredTurn:
    """A stored response, decoded: its own input and output items, its response object."""

    __slots__ = ("previous_id", "input", "output", "response")

    def __init__(self, stored: StoredResponse) -> None:
        document = json.loads(stored.document)
        self.previous_id = stored.previous_id or None
        self.input: list[Item] = document["input"]
        self.output: list[Item] = document["output"]
        self.response: Item = document["response"]

    @staticmethod
    def encode(response_id: str, previous_id: str | None, created_at: int,
               items: list[Item], response: Item) -> StoredResponse:
        document = {"input": items, "output": response["output"], "response": response}
        return StoredResponse(response_id=response_id, previous_id=previous_id or "",
                              created_at=created_at,
                              document=json.dumps(document, separators=(",", ":")).encode())


class ChainBook:
    """Reads of stored responses through this process's cache, and the conversations
    it has seen by the digest of their history."""

    def __init__(self) -> None:
        self._turns: SessionLRU[StoredTurn] = SessionLRU(CACHED_RESPONSES)
        self._by_history: SessionLRU[str] = SessionLRU(CONVERSATIONS)
        self._latest: SessionLRU[str] = SessionLRU(CONVERSATIONS)  # session -> last response

    async def turn(self, routers: Any, scoped: Any, response_id: str) -> StoredTurn:
        """The stored response ``response_id`` of the caller (``scoped``: the caller's
        session id -> the router's).

        Raises:
            UnknownResponseError: never stored, deleted, or another tenant's.
        """
        sid = scoped(session_of_response(response_id))
        key = f"{sid}\0{response_id}"
        found = self._turns.get(key)
        if found is None:
            found = StoredTurn(await routers.service(sid).get_response(sid, response_id))
            self._turns.put(key, found)
        return found

    async def history(self, routers: Any, scoped: Any, response_id: str) -> list[Item]:
        """Every item of the chain that ends with ``response_id`` (input and output
        of each response, oldest first): what the next turn's input follows."""
        turns: list[StoredTurn] = []
        next_id: str | None = response_id
        while next_id is not None:
            if len(turns) >= MAX_CHAIN:
                raise InvalidInputError(f"response chains are followed {MAX_CHAIN} turns back "
                                        f"at most; {response_id!r} is longer")
            turn = await self.turn(routers, scoped, next_id)
            turns.append(turn)
            next_id = turn.previous_id
        return [item for turn in reversed(turns) for item in (*turn.input, *turn.output)]

    def remember(self, sid: str, response_id: str, turn: StoredTurn | None,
                 tenant_prefix: str, session: str, items: list[Item],
                 output: list[Item]) -> None:
        """After a response of ``session`` (``sid``: the router's id): its stored turn
        (if stored), and its whole history (``items`` then ``output``) as a
        conversation of that session, among its tenant's (``tenant_prefix``)."""
        if turn is not None:
            self._turns.put(f"{sid}\0{response_id}", turn)
        self._latest.put(sid, response_id)
        self._by_history.put(history_digest(tenant_prefix, [*items, *output]), session)

    def branches(self, sid: str, previous_id: str) -> bool:
        """Whether a turn continuing ``previous_id`` (of session ``sid``) starts a branch:
        the session has gone on since from another of its responses (as far as this
        process saw; unknown: it continues the session)."""
        latest = self._latest.get(sid)
        return latest is not None and latest != previous_id

    def forget(self, sid: str, response_id: str) -> None:
        self._turns.drop(f"{sid}\0{response_id}")

    def session_by_history(self, tenant_prefix: str, items: list[Item]) -> str | None:
        """The session of the longest earlier conversation (this tenant's)
        whose whole history ``items`` starts with: an agent that sends its history
        each turn (the OpenAI Agents SDK's default) keeps one session."""
        digests = _prefix_digests(tenant_prefix, items)
        for digest in reversed(digests):
            found = self._by_history.get(digest)
            if found is not None:
                return found
        return None


def history_digest(tenant_prefix: str, items: list[Item]) -> str:
    return _prefix_digests(tenant_prefix, items)[-1]


def _prefix_digests(tenant: str, items: list[Item]) -> list[str]:
    """The digest of each prefix of ``items``, by what the engine sees of each (its chat
    message: ids and statuses that SDKs drop or add when they send an item back do not
    change it), chained like block hashes."""
    digests: list[str] = []
    running = hashlib.blake2b(f"memkv-chain\0{tenant}".encode(), digest_size=16)
    for message in chat_messages([i for i in items if i.get("type") != "reasoning"], None):
        running.update(json.dumps(message, sort_keys=True, separators=(",", ":")).encode())
        digests.append(running.copy().hexdigest())
    return digests or [running.hexdigest()]
