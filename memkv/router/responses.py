"""Stored responses as a router shard serves them: put, get and delete, journaled.

The front door stores each response of a chain with its session
(:mod:`memkv.protocol.responses`); the shard that owns the session keeps it in
its table (:class:`~memkv.router.response_table.ResponseTable`) and journal,
durable (fsynced, and on the journal's archive replicas where it has them)
before the store is answered: a chain outlives the engine, the gateway and the
router process that served its turns.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from memkv.errors import InvalidInputError
from memkv.protocol.ids import unscoped_session_id
from memkv.protocol.responses import (
    MAX_RESPONSE_BYTES,
    StoredResponse,
    UnknownResponseError,
    session_of_response,
)
from memkv.protocol.services import decode, encode
from memkv.router.records import ResponseDeleted, ResponseStored
from memkv.router.state import RouterState

__all__ = ["Responses"]


class Responses:
    """One shard's stored responses.

    Args:
        durable: makes the journal durable when called with True (group commit).
    """

    def __init__(self, state: RouterState,
                 durable: Callable[[bool], Awaitable[None]]) -> None:
        self._state = state
        self._durable = durable

    async def put(self, session_id: str, response: StoredResponse) -> None:
        """Store ``response`` with ``session_id`` (the router's scoped id).

        Raises:
            InvalidInputError: its id does not name this session, or it is larger
                than MAX_RESPONSE_BYTES.
        """
        if session_of_response(response.response_id) != unscoped_session_id(session_id):
            raise InvalidInputError(f"response {response.response_id!r} is not of session "
                                    f"{unscoped_session_id(session_id)!r}")
        document = encode(response)
        if len(document) > MAX_RESPONSE_BYTES:
            raise InvalidInputError(f"a stored response is at most {MAX_RESPONSE_BYTES} bytes, "
                                    f"this one is {len(document)}")
        self._state.responses.restore(session_id, response.response_id, document)
        self._state.log(ResponseStored(id=session_id, rid=response.response_id, doc=document))
        await self._durable(True)

    async def get(self, session_id: str, response_id: str) -> StoredResponse:
        """Raises: UnknownResponseError (never stored, deleted, or not this session's)."""
        document = self._state.responses.get(session_id, response_id)
        if document is None:
            raise UnknownResponseError(f"no response {response_id!r}")
        return decode(StoredResponse, document)

    async def delete(self, session_id: str, response_id: str) -> None:
        """Raises: UnknownResponseError."""
        if not self._state.responses.remove(session_id, response_id):
            raise UnknownResponseError(f"no response {response_id!r}")
        self._state.log(ResponseDeleted(id=session_id, rid=response_id))
        await self._durable(True)
