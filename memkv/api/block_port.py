"""The block port: memkv's frames over a bare TCP connection, beside HTTP.

HTTP costs an append several copies of every body chunk and a parser on the
way (uvicorn + Starlette); the block port reads each block payload from the
socket straight into the staging segment it is stored from, and writes read
payloads from where they sit. It carries the same frames (docs/wire-format.md),
checks the same tokens (once per connection), limits and checksums, and goes
through the same append and read code as the HTTP routes
(``app.state.receive_append``, ``app.state.session_blocks``). HTTP stays for
everything else and everyone else.

A connection (docs/wire-format.md, "The block port")::

    client: hello {token}            server: welcome {tenant, max_body_bytes}
    client: request {id, op, ...} [body frames]
    server: reply {id, status, ...} [block frames + end]       (in request order)

Requests may be pipelined: a client sends several before reading a reply; the
server answers them in order. An append's body is read as soon as it comes and
stored while the next request is read (up to ``MAX_PIPELINED`` per connection;
one session's appends reach its router in request order); a read runs when its
turn to answer comes, so it sees every append sent before it. An error the
connection can go on from (a 404 read) is a reply; one that leaves the stream's
position unknown (a malformed frame, a refused body) is a reply and then the
connection is closed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from starlette.responses import Response
from starlette.types import Message

from memkv.api.auth import Principal
from memkv.api.body_budget import BodyHold
from memkv.api.errors import BodyTimeout, PayloadTooLarge, any_error_document
from memkv.api.guarded_send import TRANSPORT_EXTENSION, UNBUFFERED_EXTENSION
from memkv.api.models import BlocksByKeyIn
from memkv.api.port_inbox import ConnectionGone, Inbox
from memkv.errors import InvalidInputError, MemkvError, UnauthorizedError
from memkv.protocol import http_form
from memkv.protocol.port import (
    BLOCK_PORT_VERSION,
    AppendRequest,
    BadRequest,
    Hello,
    ReadKeysRequest,
    ReadRequest,
    Reply,
    Welcome,
    decode_control,
    decode_request,
    port_frame,
)
from memkv.protocol.wire import (
    PREFIX_BYTES,
    Frame,
    FrameBudget,
    FrameHeader,
    WireError,
    decode_header,
    decode_prefix,
    payload_buffer,
)

__all__ = ["BLOCK_PORT_VERSION", "BlockPortServer", "ConnectionGone", "PortStats"]

logger = logging.getLogger(__name__)

#: A hello or request header is small (a token, a session id); more is malformed.
MAX_CONTROL_HEADER_BYTES = 64 << 10
#: Requests of one connection taken off the socket before their answers are written;
#: reading stops while this many wait (each append holds its body in staging).
MAX_PIPELINED = 8
#: A new connection has this long to say hello.
HELLO_TIMEOUT_S = 5.0
#: Connections that have not said hello yet, at most (more are closed at once): each
#: costs its buffers until it does.
MAX_AWAITING_HELLO = 256


@dataclass
class PortStats:
    """What the block port did, for ``/v1/stats`` (``gateway.block_port``)."""

    port: int = 0
    connections: int = 0
    open_connections: int = 0
    refused_connections: int = 0
    requests: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Answer:
    """A request taken off a connection: ``write`` answers it when its turn comes;
    ``settle`` waits for its work when no answer can be written (None: no work
    started before its turn)."""

    write: Callable[[], Awaitable[None]]
    closing: bool = False  # the connection closes after it
    settle: Callable[[], Awaitable[Any]] | None = None

    async def finish_unanswered(self) -> None:
        if self.settle is not None:
            await self.settle()


class _SessionOrder:
    """The last append of each session on one connection, so that a session's
    appends reach its router in request order while other sessions' overlap."""

    def __init__(self) -> None:
        self._last: dict[str, asyncio.Task[Any]] = {}

    def last(self, session_id: str) -> asyncio.Task[Any] | None:
        return self._last.get(session_id)

    def follow(self, session_id: str, task: asyncio.Task[Any]) -> None:
        self._last[session_id] = task

        def forget(done: asyncio.Task[Any]) -> None:
            if self._last.get(session_id) is done:
                del self._last[session_id]

        task.add_done_callback(forget)


class _FatalToConnection(Exception):
    """Wraps an error after which the connection cannot go on (its stream position is lost)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class BlockPortServer:
    """The block port of one gateway app, served on the app's event loop.

    Args:
        app: the gateway app (:func:`memkv.api.app.create_app`); errors are
            answered with the HTTP routes' own mapping (status, type, message).
    """

    def __init__(self, app: Any):
        self._app = app
        limits = app.state.limits
        self._max_body_bytes = int(limits["max_body_bytes"])
        self._idle_timeout_s = float(limits["body_timeout_s"])
        self._server: asyncio.Server | None = None
        self._connections: set[Inbox] = set()
        self.stats = PortStats()
        self._awaiting_hello = 0  # connections whose hello has not come yet
        app.state.block_port = self

    async def start(self, sock: socket.socket) -> None:
        """Serve on ``sock`` (bound and listening, or bound: it is put to listen)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Inbox(self._serve, self._idle_timeout_s), sock=sock
        )
        self.stats.port = sock.getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for inbox in list(self._connections):
                inbox.close()
            await self._server.wait_closed()
            self._server = None

    # -- one connection

    async def _serve(self, inbox: Inbox) -> None:
        self._connections.add(inbox)
        self.stats.connections += 1
        self.stats.open_connections += 1
        replies: asyncio.Queue[_Answer | None] = asyncio.Queue()
        room = asyncio.Semaphore(MAX_PIPELINED)  # requests taken and not yet answered
        writer: asyncio.Task[None] | None = None
        try:
            if self._awaiting_hello >= MAX_AWAITING_HELLO:
                self.stats.refused_connections += 1
                logger.info("block port: %d connections have not said hello: %s closed",
                            self._awaiting_hello, inbox.peer)
                return
            self._awaiting_hello += 1
            try:
                who = await self._hello(inbox)
            finally:
                self._awaiting_hello -= 1
            if who is None:
                return
            inbox.grow_spare()
            writer = asyncio.get_running_loop().create_task(
                self._answer(inbox, replies, room))
            appends = _SessionOrder()
            while not writer.done():
                await room.acquire()
                try:
                    header, _ = await inbox.read_header(MAX_CONTROL_HEADER_BYTES, 0)
                except ConnectionGone:
                    return  # a clean close between requests (answers still go out)
                except WireError as e:
                    # A malformed frame (bad magic, not msgpack, not a map, too long):
                    # answered, then the connection ends (its stream position is lost).
                    logger.info("block port: a malformed request from %s: %s", inbox.peer, e)
                    replies.put_nowait(self._fatal(inbox, 0, e))
                    return
                answer = await self._accept(inbox, who, header, appends)
                replies.put_nowait(answer)
                if answer.closing:
                    return
        except ConnectionGone:
            pass
        except Exception:  # noqa: BLE001 - one connection's fault must not end the server
            logger.exception("block port connection from %s failed", inbox.peer)
        finally:
            if writer is not None:
                replies.put_nowait(None)  # the writer answers what is queued, then stops
                await writer
            self.stats.open_connections -= 1
            self._connections.discard(inbox)
            inbox.close()

    async def _answer(self, inbox: Inbox, replies: asyncio.Queue[_Answer | None],
                      room: asyncio.Semaphore) -> None:
        """Write the answers in request order; after a closing one, or once the
        connection is gone, the rest are awaited (their work finishes) unanswered."""
        writable = True
        while (answer := await replies.get()) is not None:
            try:
                if not writable:
                    await answer.finish_unanswered()
                    continue
                await answer.write()
            except ConnectionGone:  # gone, or a read cut short: no answer can follow
                writable = False
            except Exception:  # noqa: BLE001 - as _serve: this connection only
                logger.exception("block port connection from %s failed", inbox.peer)
                writable = False
            finally:
                room.release()
            if answer.closing or not writable:
                writable = False
                inbox.close()  # the reader stops at its next read

    async def _hello(self, inbox: Inbox) -> Principal | None:
        """Check the connection's token before anything else is read from it."""
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                header, _ = await inbox.read_header(MAX_CONTROL_HEADER_BYTES, 0)
            hello = decode_control(header)
            if not isinstance(hello, Hello):
                raise WireError(f"a block port connection starts with 'hello', got "
                                f"{type(hello).__name__.lower()!r}")
            if hello.v != BLOCK_PORT_VERSION:
                raise WireError(f"block port version {hello.v!r} is not served; "
                                f"expected {BLOCK_PORT_VERSION}")
            token = hello.token
            if token is not None and (token != token.strip() or not token.isprintable()):
                # HTTP strips a header value's spaces; a frame has no such excuse.
                raise UnauthorizedError("the bearer token is not valid")
            who = self._app.state.authenticator.authenticate(
                f"Bearer {token}" if token else None
            )
        except (TimeoutError, MemkvError) as e:
            self.stats.refused_connections += 1
            if isinstance(e, TimeoutError):
                e = BodyTimeout(f"no hello within {HELLO_TIMEOUT_S:g} s")
            await self._reply_error(inbox, 0, e, closing=True)
            return None
        await inbox.write(port_frame(Welcome(
            v=BLOCK_PORT_VERSION, tenant=who.tenant, max_body_bytes=self._max_body_bytes)))
        return who

    async def _accept(self, inbox: Inbox, who: Principal, header: FrameHeader,
                      appends: _SessionOrder) -> _Answer:
        """Take one request off the connection: an append's body is read now and
        stored while the next request is read; other requests run when their turn
        to answer comes (so a read sees every append before it)."""
        try:
            request = decode_request(header)
        except BadRequest as e:
            self._count(e.op)
            if e.fatal or e.request_id is None:
                return self._fatal(inbox, e.request_id, e)
            return _Answer(functools.partial(self._reply_error, inbox, e.request_id, e))
        self._count(request.op.value)
        rid = request.id
        if isinstance(request, AppendRequest):
            return await self._append(inbox, who, request, appends)
        if isinstance(request, ReadRequest):
            run = functools.partial(self._read, inbox, who, request)
        elif isinstance(request, ReadKeysRequest):
            run = functools.partial(self._read_keys, inbox, who, request)
        else:
            run = functools.partial(inbox.write, port_frame(Reply(id=rid, status=200)))

        async def write() -> None:
            try:
                await run()
            except ConnectionGone:
                raise
            except Exception as e:  # noqa: BLE001 - answered like the HTTP routes answer it
                await self._reply_error(inbox, rid, e)

        return _Answer(write)

    def _count(self, op: str) -> None:
        self.stats.requests[op] = self.stats.requests.get(op, 0) + 1

    def _fatal(self, inbox: Inbox, rid: int | None, error: BaseException) -> _Answer:
        """An answer after which the connection closes (its stream position is lost)."""
        return _Answer(functools.partial(
            self._reply_error, inbox, rid or 0, error, closing=True), closing=True)

    async def _append(self, inbox: Inbox, who: Principal, request: AppendRequest,
                      appends: _SessionOrder) -> _Answer:
        """Read the append's body, then store it in the background (after the
        connection's earlier appends to the same session): its answer."""
        rid, session_id, body_bytes = request.id, request.session_id, request.body_bytes
        if body_bytes > self._max_body_bytes:
            return self._fatal(inbox, rid, PayloadTooLarge(
                f"body of {body_bytes} bytes exceeds the limit of {self._max_body_bytes}"))

        loop = asyncio.get_running_loop()
        body_read: asyncio.Future[None] = loop.create_future()
        before = appends.last(session_id)

        async def read(allocate: Callable[[int], memoryview | None] | None,
                       hold: BodyHold) -> list[Frame]:
            try:
                frames = await self._body_frames(inbox, body_bytes, allocate, hold)
            except BaseException as e:
                body_read.set_exception(e)
                body_read.exception()  # retrieved: the store task raises it too
                raise
            body_read.set_result(None)
            if before is not None:
                await asyncio.wait([before])  # the session's appends in request order
            return frames

        store = loop.create_task(self._app.state.receive_append(who, session_id, body_bytes,
                                                                read))
        appends.follow(session_id, store)
        await asyncio.wait([body_read, store], return_when=asyncio.FIRST_COMPLETED)
        if not body_read.done() or body_read.exception() is not None:
            # Refused before its body was read (a read-only token, a full gateway), or
            # the body broke off: the stream's position is lost, the connection ends.
            try:
                await store
            except ConnectionGone:
                raise
            except _FatalToConnection as e:  # a malformed or stalled body
                return self._fatal(inbox, rid, e.cause)
            except Exception as e:  # noqa: BLE001 - answered, then the connection closes
                return self._fatal(inbox, rid, e)
            raise AssertionError("an append stored without its body read")

        async def write() -> None:
            try:
                result = await store
            except Exception as e:  # noqa: BLE001 - answered like the HTTP routes answer it
                await self._reply_error(inbox, rid, e)
                return
            await inbox.write(port_frame(Reply(id=rid, status=200,
                                               result=http_form.to_builtins(result))))

        return _Answer(write, settle=functools.partial(asyncio.wait, [store]))

    async def _body_frames(
        self,
        inbox: Inbox,
        body_bytes: int,
        allocate: Callable[[int], memoryview | None] | None,
        hold: BodyHold,
    ) -> list[Frame]:
        """Exactly ``body_bytes`` of frames; each payload read into where it is stored.

        Memory is committed as bytes arrive, never on what a frame declares
        (:func:`payload_buffer`); a body that fails lets go of its buffers at once
        (its error carries no traceback into the frames that held them).
        """
        frames: list[Frame] = []
        payload: memoryview | None = None
        budget = FrameBudget()
        left = body_bytes
        try:
            while left > 0:
                if left < PREFIX_BYTES:
                    raise WireError("the body ends in the middle of a frame")
                prefix = bytearray(PREFIX_BYTES)
                await inbox.readinto(memoryview(prefix), hold)
                header_len = decode_prefix(prefix)
                budget.take(header_len)
                left -= PREFIX_BYTES
                if header_len > left:
                    raise WireError(f"a frame header of {header_len} bytes runs past the body")
                raw = bytearray(header_len)
                await inbox.readinto(memoryview(raw), hold)
                left -= header_len
                # No frame may declare more payload than the body has left.
                frame_header, nbytes = decode_header(bytes(raw), left)
                payload = allocate(nbytes) if allocate is not None and nbytes else None
                if payload is None:
                    payload = payload_buffer(nbytes)
                if nbytes:
                    await inbox.readinto(payload, hold)
                left -= nbytes
                frames.append(Frame(frame_header, payload))
                payload = None
        except BaseException as e:
            # A client that declared a GiB and left: its buffers go now, not when the
            # cycle collector finds the traceback that holds this frame and its callees.
            frames.clear()
            payload = None
            if isinstance(e, WireError | BodyTimeout):
                raise _FatalToConnection(e.with_traceback(None)) from None
            raise e.with_traceback(None) from None
        return frames

    async def _read(self, inbox: Inbox, who: Principal, request: ReadRequest) -> None:
        response = await self._app.state.session_blocks(
            who, request.session_id, request.start, request.end, request.turn)
        await self._stream(inbox, response, Reply(id=request.id, status=200,
                                                  body_bytes=response.content_length),
                           f"the read of {request.session_id!r}")

    async def _read_keys(self, inbox: Inbox, who: Principal, request: ReadKeysRequest) -> None:
        try:
            body = BlocksByKeyIn(namespace=request.namespace,
                                 keys=[k.hex() for k in request.keys])
        except ValidationError as e:
            raise InvalidInputError(f"read_keys: {e.errors()[0]['msg']}") from None
        response = await self._app.state.blocks_by_key(body, who)
        # A by-key response has no length known up front: its frames run to the end frame.
        await self._stream(inbox, response, Reply(id=request.id, status=200, until_end=True),
                           "the by-key read")

    async def _stream(self, inbox: Inbox, response: Response, head: Reply,
                      what: str) -> None:
        """Write an ASGI response's body after ``head``; cut short, the connection closes."""
        started = False

        async def send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                await inbox.write(port_frame(head))
            elif message.get("body"):
                await inbox.write([message["body"]])

        # Its transport, so that a reader that stops reading is cut off before the pins
        # on the shared memory its unsent bytes lie in go (memkv.api.guarded_send).
        scope = {"type": "http", "asgi": {"spec_version": "2.4"},
                 "extensions": {TRANSPORT_EXTENSION: inbox.transport, UNBUFFERED_EXTENSION: True}}
        try:
            await response(scope, _no_receive, send)
        except Exception as e:
            if not started:
                raise
            # Cut short: the client sees it and raises, never a partial cache taken
            # for a whole one. No reply can follow.
            logger.warning("block port: %s cut short: %s", what, e)
            raise ConnectionGone(f"{what} was cut short") from e

    async def _reply_error(
        self, inbox: Inbox, rid: int, exc: BaseException, *, closing: bool = False
    ) -> None:
        """Answer ``exc``; ``closing``: the gateway closes the connection after it."""
        error = any_error_document(exc)
        self.stats.errors[error["type"]] = self.stats.errors.get(error["type"], 0) + 1
        reply = Reply(id=rid, status=error["status"], error=dict(error), close=closing)
        try:
            await inbox.write(port_frame(reply))
        except ConnectionGone:
            pass


async def _no_receive() -> Message:
    # ASGI spec 2.4: responses do not listen for a disconnect; a write to a closed
    # connection raises ConnectionGone instead.
    await asyncio.get_running_loop().create_future()
    raise AssertionError("unreachable")
