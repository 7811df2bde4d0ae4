"""One client connection to a gateway's block port (memkv.api.block_port).

Blocking sockets, no event loop: a request's frames go out with ``sendmsg``
of the payloads' own memoryviews (no join), and each block of a read comes
off the socket with ``readinto`` straight into its destination. Requests may
be pipelined: :meth:`PortConnection.send` several, then :meth:`reply` to each
in order.

Import-light like :mod:`memkv.client` (no torch, no ray).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Sequence
from typing import Any

import msgspec

from memkv.errors import MemkvError, UnauthorizedError
from memkv.protocol.port import (
    BLOCK_PORT_VERSION,
    AppendRequest,
    Hello,
    PortRequest,
    Reply,
    Welcome,
    decode_control,
    port_frame,
)
from memkv.protocol.wire import PREFIX_BYTES, WireError, decode_header, decode_prefix

__all__ = ["AsyncPortConnection", "PortConnection", "PortError", "ReplyBody"]

#: Reply headers announce no payload of their own (a body follows as ``body_bytes``).
_NO_PAYLOAD_LIMIT = 0
#: Buffered reads below this size; larger ones go straight into their destination.
_READ_BUFFER_BYTES = 256 << 10
#: Buffers per sendmsg call (Linux's IOV_MAX is 1024).
_IOV_MAX = 512


def _hello(token: str | None) -> list[bytes | memoryview]:
    return port_frame(Hello(v=BLOCK_PORT_VERSION, token=token or None))


def _welcome(header: dict[str, Any]) -> Welcome:
    """The gateway's welcome; raise what a refused hello means (UnauthorizedError for a
    bad token)."""
    answer = decode_control(header)
    if isinstance(answer, Welcome):
        return answer
    if not isinstance(answer, Reply):
        raise WireError(f"expected a welcome, got a {type(answer).__name__.lower()}")
    error = answer.error or {}
    if answer.status == 401:
        raise UnauthorizedError(f"{error.get('message')} (block port)")
    raise PortError(answer.status, error)


#: What a caller sends: a typed request (its ``id`` and an append's ``body_bytes``
#: are filled in on the way), or a raw header (tests of malformed requests).
Outgoing = PortRequest | dict[str, Any]


def _request_frame(request: Outgoing, rid: int, body_bytes: int
                   ) -> list[bytes | memoryview]:
    if isinstance(request, dict):
        raw = {**request, "kind": "request", "id": rid}
        if body_bytes:
            raw["body_bytes"] = body_bytes
        return port_frame(raw)
    if isinstance(request, AppendRequest):
        return port_frame(msgspec.structs.replace(request, id=rid, body_bytes=body_bytes))
    return port_frame(msgspec.structs.replace(request, id=rid))


def _reply_to(header: dict[str, Any], rid: int) -> Reply:
    """The reply to request ``rid``.

    Raises:
        WireError: another frame, or another request's reply.
    """
    reply = decode_control(header)
    if not isinstance(reply, Reply) or reply.id != rid:
        raise WireError(f"expected the reply to request {rid}, got {reply!r:.200}")
    return reply


class PortError(MemkvError):
    """A reply with an error status: ``status`` and the gateway's error document."""

    def __init__(self, status: int, error: dict[str, Any]) -> None:
        super().__init__(f"{error.get('message', error)} (block port {status})")
        self.status = status
        self.error = error


class ReplyBody:
    """The ``body_bytes`` that follow a reply, read like an HTTP response body.

    ``read(n)`` and ``readinto(view)`` stop at the body's end (then return
    nothing), so a short body is seen by the frame parser as a cut stream.
    """

    def __init__(self, stream: Any, nbytes: int | None) -> None:
        self._stream = stream
        #: Bytes of the body not read yet; None: a body that runs to its end frame.
        self.left = nbytes

    def read(self, n: int) -> bytes:
        if self.left is None:
            return bytes(self._stream.read(n))
        data: bytes = self._stream.read(min(n, self.left)) if self.left else b""
        self.left -= len(data)
        return data

    def readinto(self, view: memoryview) -> int:
        if self.left is None:
            return int(self._stream.readinto(view) or 0)
        if not self.left:
            return 0
        got: int = self._stream.readinto(view[: self.left]) or 0
        self.left -= got
        return got


class PortConnection:
    """A connection to a block port, authenticated once (its ``hello``).

    Raises:
        UnauthorizedError: the gateway refused the token.
        OSError: the port could not be reached.
    """

    def __init__(self, host: str, port: int, *, token: str | None, timeout: float) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._stream = self._sock.makefile("rb", buffering=_READ_BUFFER_BYTES)
        self._ids = itertools.count(1)
        self._pending: list[int] = []  # ids sent and not answered yet, in order
        self.broken = False
        try:
            self._send_all(_hello(token))
            welcome = _welcome(self._header())
        except Exception:
            self.close()
            raise
        self.tenant = welcome.tenant
        self.max_body_bytes = welcome.max_body_bytes

    def send(self, request: Outgoing, body: Sequence[bytes | memoryview] = ()) -> int:
        """Send a request and its body frames; return its id."""
        rid = next(self._ids)
        body_bytes = sum(memoryview(c).nbytes for c in body)
        try:
            self._send_all([*_request_frame(request, rid, body_bytes), *body])
        except BaseException:
            self.broken = True
            raise
        self._pending.append(rid)
        return rid

    def reply(self, rid: int) -> tuple[Reply, ReplyBody]:
        """The reply to request ``rid`` (the oldest one pending) and its body.

        The body must be read to its end before the next reply.

        Raises:
            PortError: the reply is an error; after one the gateway cannot go on
                from (a malformed frame, a body refused unread) it closes the
                connection, and :attr:`broken` is set.
        """
        if not self._pending or self._pending[0] != rid:
            raise WireError(
                f"replies come in request order: {self._pending[:1]} is next, not {rid}"
            )
        self._pending.pop(0)
        try:
            reply = _reply_to(self._header(), rid)
        except BaseException:
            self.broken = True
            raise
        if reply.close:
            self.broken = True  # the gateway closes it after this reply
        if reply.status >= 400:
            raise PortError(reply.status, reply.error or {})
        length = None if reply.until_end else reply.body_bytes or 0
        return reply, ReplyBody(self._stream, length)

    def request(
        self, request: Outgoing, body: Sequence[bytes | memoryview] = ()
    ) -> tuple[Reply, ReplyBody]:
        return self.reply(self.send(request, body))

    def close(self) -> None:
        self.broken = True
        self._stream.close()
        self._sock.close()

    # -- internals

    def _header(self) -> dict[str, Any]:
        header_len = decode_prefix(self._exact(PREFIX_BYTES))
        return decode_header(self._exact(header_len), _NO_PAYLOAD_LIMIT)[0]

    def _exact(self, n: int) -> bytes:
        data: bytes = self._stream.read(n)
        if len(data) != n:
            raise ConnectionError("the block port closed the connection")
        return data

    def _send_all(self, chunks: Sequence[bytes | memoryview]) -> None:
        views = [memoryview(c).cast("B") for c in chunks if memoryview(c).nbytes]
        while views:
            sent = self._sock.sendmsg(views[:_IOV_MAX])
            while sent and views:  # drop what went, keep the rest of a partial one
                if sent >= views[0].nbytes:
                    sent -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0


class AsyncPortConnection:
    """A block port connection for asyncio (:class:`memkv.client.AsyncClient`).

    Coroutines may share it: each request is sent as soon as it is made
    (pipelined), and replies are read in request order, each one's body to its
    end by its own caller before the next reply is read.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._ids = itertools.count(1)
        self._send_lock = asyncio.Lock()
        self._turn: asyncio.Future[None] | None = None  # the previous reply read to its end
        self.broken = False

    @classmethod
    async def open(cls, host: str, port: int, *, token: str | None,
                   timeout: float) -> AsyncPortConnection:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=_READ_BUFFER_BYTES), timeout
        )
        conn = cls(reader, writer)
        try:
            writer.writelines(_hello(token))
            _welcome(await asyncio.wait_for(conn.header(), timeout))
        except BaseException:
            await conn.aclose()
            raise
        return conn

    async def request(
        self, request: Outgoing, body: Sequence[bytes | memoryview] = ()
    ) -> tuple[Reply, int | None, asyncio.Future[None]]:
        """Send a request; return its reply, body length (None: to the end frame)
        and the future to set once that body is read (the next reply waits for it)."""
        loop = asyncio.get_running_loop()
        async with self._send_lock:
            rid = next(self._ids)
            body_bytes = sum(memoryview(c).nbytes for c in body)
            previous, done = self._turn, loop.create_future()
            self._turn = done
            try:
                self._writer.writelines([*_request_frame(request, rid, body_bytes), *body])
                await self._writer.drain()
            except BaseException:
                self.broken = True
                done.set_result(None)
                raise
        if previous is not None:
            await previous
        try:
            reply = _reply_to(await self.header(), rid)
        except BaseException:
            self.broken = True
            done.set_result(None)
            raise
        if reply.close:
            self.broken = True
        if reply.status >= 400:
            done.set_result(None)
            raise PortError(reply.status, reply.error or {})
        length = None if reply.until_end else reply.body_bytes or 0
        return reply, length, done

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes of the reply being read (fewer only at the connection's end)."""
        return await self._reader.read(n)

    async def header(self) -> dict[str, Any]:
        try:
            header_len = decode_prefix(await self._reader.readexactly(PREFIX_BYTES))
            raw = await self._reader.readexactly(header_len)
        except asyncio.IncompleteReadError as e:
            raise ConnectionError("the block port closed the connection") from e
        return decode_header(raw, _NO_PAYLOAD_LIMIT)[0]

    async def aclose(self) -> None:
        self.broken = True
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass
