"""Python clients of the memkv gateway: :class:`Client` (sync) and :class:`AsyncClient`.

Typed methods for the routes; the server's JSON errors are raised again as
memkv's own exceptions (:mod:`memkv.errors`); idempotent calls (reads, deletes,
and appends, which carry a turn index) are retried on connection errors and
503s. KV goes out as binary frames (docs/wire-format.md) and comes back
streamed, each block read from the socket straight into the array it is then
returned in (``Block.array``; ``Block.tensor`` wraps it for torch users).

Import-light: ``import memkv.client`` loads neither torch nor ray (torch is
imported only when a caller hands in or asks for tensors).

Example:
    >>> with Client("http://127.0.0.1:8080") as client:           # doctest: +SKIP
    ...     client.create_session("chat-1", layout, namespace="tenant-a")
    ...     client.append_turn("chat-1", token_ids, keys, values)
    ...     blocks = [b.tensor for b in client.read_blocks("chat-1")]

One idea per module: :mod:`.views` (what the gateway answers), :mod:`.frames`
(KV on the wire), :mod:`.transport` (connections, retries, errors), :mod:`.base`
(the sessions a client knows, shared by both), :mod:`.sync` and :mod:`.aio`.
"""

from __future__ import annotations

from memkv.client.aio import AsyncClient
from memkv.client.frames import FRAMES_MEDIA_TYPE
from memkv.client.sync import Client
from memkv.client.transport import DEFAULT_URL, TOKEN_ENV
from memkv.client.views import Block, Match
from memkv.protocol.services import AppendAnswer, ResumeAnswer, SessionView

__all__ = [
    "DEFAULT_URL",
    "AppendAnswer",
    "FRAMES_MEDIA_TYPE",
    "TOKEN_ENV",
    "AsyncClient",
    "Block",
    "Client",
    "Match",
    "ResumeAnswer",
    "SessionView",
]
