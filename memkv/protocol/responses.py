"""Stored responses (OpenAI's Responses API): what the front door keeps of each turn of
a response chain, and how a response's id names its session.

A response is stored with its session, by the router shard that owns the session,
in that shard's journal: it is as durable as the session's table (replicated to
archives where the journal is), and it is gone when the session is deleted. Its
items (OpenAI's input and output items) are a JSON document the router keeps
whole and never reads: they are open by design, as OpenAI's bodies are.

A response id names its session (``resp_<nonce>_<session id>``; session ids have
no ``_``), so that ``previous_response_id`` finds the shard that holds the
response without an index, and a tenant's id resolves within that tenant only
(the session is scoped by the caller's tenant, as on every route).
"""

from __future__ import annotations

import secrets
from typing import Any, Protocol

import msgspec

from memkv.errors import NotFoundError
from memkv.protocol.ids import is_session_id

__all__ = [
    "MAX_RESPONSE_BYTES",
    "OpenAIDocument",
    "RESPONSE_PREFIX",
    "ResponseService",
    "StoredResponse",
    "UnknownResponseError",
    "new_response_id",
    "session_of_response",
]

#: A JSON object of OpenAI's API (a request or response body, an input or output item):
#: open by design, checked where it is read (memkv.api.responses.items).
OpenAIDocument = dict[str, Any]

RESPONSE_PREFIX = "resp_"
#: The largest stored document (a response's own input and output items).
MAX_RESPONSE_BYTES = 8 << 20


class UnknownResponseError(NotFoundError):
    """No such response (never stored, deleted, or another tenant's)."""


class StoredResponse(msgspec.Struct, frozen=True, kw_only=True):
    """One response of a chain as the front door stored it.

    ``document`` is JSON: ``{"input": [...], "output": [...], "response": {...}}``,
    the items this request added (the chain's earlier items are its predecessors'),
    the items the model produced, and the response object as it was answered.
    """

    response_id: str
    previous_id: str = ""
    created_at: int = 0
    document: bytes = b""


def new_response_id(session_id: str) -> str:
    """A fresh id for a response of ``session_id`` (the caller's, unscoped)."""
    return f"{RESPONSE_PREFIX}{secrets.token_hex(16)}_{session_id}"


def session_of_response(response_id: str) -> str:
    """The (unscoped) session a response id names.

    Raises:
        UnknownResponseError: not an id memkv made (as for any unknown response).
    """
    if isinstance(response_id, str) and response_id.startswith(RESPONSE_PREFIX):
        nonce, sep, session_id = response_id[len(RESPONSE_PREFIX):].partition("_")
        if sep and len(nonce) == 32 and is_session_id(session_id):
            return session_id
    raise UnknownResponseError(f"no response {response_id!r:.120}")


class ResponseService(Protocol):
    """What a router shard answers for the stored responses of its sessions
    (``session_id``: the router's scoped id)."""

    async def put_response(self, session_id: str, response: StoredResponse) -> None: ...

    async def get_response(self, session_id: str, response_id: str) -> StoredResponse: ...

    async def delete_response(self, session_id: str, response_id: str) -> None: ...
