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
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from starlette.responses import Response
from starlette.types import Message

from memkv.api.answers import AppendOut
from memkv.api.auth import Principal
from memkv.api.body_budget import BodyHold
from memkv.api.errors import BodyTimeout, PayloadTooLarge, any_error_document
from memkv.api.guarded_send import TRANSPORT_EXTENSION, UNBUFFERED_EXTENSION
from memkv.api.models import BlocksByKeyIn
from memkv.errors import InvalidInputError, MemkvError, UnauthorizedError
from memkv.protocol.wire import (
    PREFIX_BYTES,
    Frame,
    FrameBudget,
    FrameHeader,
    WireError,
    decode_header,
    decode_prefix,
    encode_frame,
    payload_buffer,
)

__all__ = ["BLOCK_PORT_VERSION", "BlockPortServer", "ConnectionGone", "PortStats"]

logger = logging.getLogger(__name__)

BLOCK_PORT_VERSION = 1
#: A hello or request header is small (a token, a session id); more is malformed.
MAX_CONTROL_HEADER_BYTES = 64 << 10
#: Bytes read ahead of the current frame (headers of pipelined requests).
_SPARE_BYTES = 256 << 10
#: At most this much is read ahead at once: the part of a payload that arrives
#: with its header is copied once more; the rest goes straight to its buffer.
_READ_AHEAD_BYTES = 64 << 10
#: Requests of one connection taken off the socket before their answers are written;
#: reading stops while this many wait (each append holds its body in staging).
MAX_PIPELINED = 8
#: A new connection has this long to say hello.
HELLO_TIMEOUT_S = 5.0
#: Connections that have not said hello yet, at most (more are closed at once): each
#: costs its buffers until it does.
MAX_AWAITING_HELLO = 256
#: The spare buffer of a connection before its hello (enough for the hello itself;
#: the full _SPARE_BYTES once authenticated).
_HELLO_SPARE_BYTES = 4 << 10


class ConnectionGone(Exception):
    """The peer closed the connection (or it broke) while a frame was awaited."""


class _Inbox(asyncio.BufferedProtocol):
    """A connection whose bytes go where the reader says: ``readinto(view)``.

    While a reader waits for a payload, :meth:`get_buffer` hands the event loop
    the rest of that payload's own buffer, so the kernel copies the bytes there
    (``recv_into``) and nothing copies them again. Between payloads bytes land
    in a small spare buffer (headers, pipelined requests); reading stops while
    it is full.
    """

    def __init__(
        self, on_open: Callable[[_Inbox], Coroutine[Any, Any, None]], idle_timeout_s: float
    ) -> None:
        self._on_open = on_open
        self._idle_timeout_s = idle_timeout_s
        self._spare = bytearray(_HELLO_SPARE_BYTES)  # the full size after the hello
        self._start = self._end = 0  # unread spare bytes: [start, end)
        self._target: memoryview | None = None  # a waiting reader's buffer
        self._filled = 0
        self._waiter: asyncio.Future[None] | None = None
        self._deadline: asyncio.Timeout | None = None
        self._hold: BodyHold | None = None
        self._paused_reading = False
        self._writable: asyncio.Future[None] | None = None
        self._gone: BaseException | None = None
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.peer: Any = None

    # -- asyncio.BufferedProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp: Any = transport  # uvloop's transport is no asyncio.Transport subclass
        self.transport = tcp
        self.peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # No write buffer of our own: a block's bytes are in the kernel before the
        # next one is fetched, and before its lease is let go.
        tcp.set_write_buffer_limits(high=0, low=0)
        self.task = asyncio.get_running_loop().create_task(self._on_open(self))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None and self._start == self._end:
            return self._target[self._filled :]
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._spare):  # room at the front only: move the tail there
            tail = self._end - self._start
            self._spare[:tail] = self._spare[self._start : self._end]
            self._start, self._end = 0, tail
        return memoryview(self._spare)[self._end : self._end + _READ_AHEAD_BYTES]

    def buffer_updated(self, nbytes: int) -> None:
        # A reader sets its target only once the spare bytes are all taken, and the
        # loop calls get_buffer and buffer_updated back to back: the same branch.
        if self._target is not None and self._start == self._end:
            self._filled += nbytes
            if self._filled == len(self._target):
                self._target = None  # bytes that come before the reader runs go to spare
                self._wake()
        else:
            self._end += nbytes
            if self._end == len(self._spare) and self._start == 0:
                self._pause_reading()
        self._progress(nbytes)

    def eof_received(self) -> bool:
        # Requests already received are still answered (the peer may read replies
        # after closing its side); the handler closes once it needs more bytes.
        self._fail(ConnectionGone("the peer closed the connection"))
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionGone(f"the connection was lost: {exc}" if exc else "closed"))
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(ConnectionGone("the connection was lost"))

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # -- for the connection's handler

    def grow_spare(self) -> None:
        """The connection said hello: its spare buffer at full size (unread bytes kept)."""
        if len(self._spare) < _SPARE_BYTES:
            unread = self._spare[self._start : self._end]
            self._spare = bytearray(_SPARE_BYTES)
            self._spare[: len(unread)] = unread
            self._start, self._end = 0, len(unread)
            self._resume_reading()

    async def readinto(self, view: memoryview, hold: BodyHold | None = None) -> None:
        """Fill ``view`` from the connection; idle longer than the timeout raises BodyTimeout."""
        taken = min(len(view), self._end - self._start)
        if taken:
            view[:taken] = self._spare[self._start : self._start + taken]
            self._start += taken
            self._resume_reading()
        if taken == len(view):
            return
        if self._gone is not None:
            raise self._gone
        self._target, self._filled = view[taken:], 0
        await self._wait(hold)

    async def read_header(self, max_header_bytes: int, max_payload_bytes: int
                          ) -> tuple[FrameHeader, int]:
        """The next frame's header and payload size (the payload is not read)."""
        prefix = bytearray(PREFIX_BYTES)
        await self.readinto(memoryview(prefix))
        raw = bytearray(decode_prefix(prefix, max_header_bytes))
        await self.readinto(memoryview(raw))
        return decode_header(bytes(raw), max_payload_bytes)

    async def write(self, chunks: list[bytes | memoryview]) -> None:
        """Hand ``chunks`` to the kernel; return once the transport holds none of them."""
        assert self.transport is not None
        if self._gone is not None:
            raise self._gone
        self.transport.writelines(chunks)
        if self._writable is not None and not self._writable.done():
            await self._writable

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- internals

    async def _wait(self, hold: BodyHold | None) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        self._hold = hold
        self._resume_reading()
        try:
            async with asyncio.timeout(self._idle_timeout_s) as deadline:
                self._deadline = deadline
                if hold is not None:
                    hold.timeout = deadline  # a stalled body is dropped through it
                await self._waiter
        except TimeoutError:
            if hold is not None and hold.dropped:
                raise BodyTimeout(f"the body was dropped: {hold.why}") from None
            raise BodyTimeout(
                f"the connection stalled: no bytes for {self._idle_timeout_s:g} s"
            ) from None
        finally:
            self._target = self._waiter = self._deadline = self._hold = None

    def _progress(self, nbytes: int) -> None:
        if self._hold is not None:
            self._hold.progress(nbytes)
            if self._hold.dropped:
                return  # its deadline was brought forward: leave it there
        if self._deadline is not None and not self._deadline.expired():
            self._deadline.reschedule(asyncio.get_running_loop().time() + self._idle_timeout_s)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self._gone = exc
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    def _pause_reading(self) -> None:
        if not self._paused_reading and self.transport is not None:
            self._paused_reading = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._paused_reading and self.transport is not None:
            self._paused_reading = False
            self.transport.resume_reading()


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
        self._connections: set[_Inbox] = set()
        self.stats = PortStats()
        self._awaiting_hello = 0  # connections whose hello has not come yet
        app.state.block_port = self

    async def start(self, sock: socket.socket) -> None:
        """Serve on ``sock`` (bound and listening, or bound: it is put to listen)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Inbox(self._serve, self._idle_timeout_s), sock=sock
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

    async def _serve(self, inbox: _Inbox) -> None:
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

    async def _answer(self, inbox: _Inbox, replies: asyncio.Queue[_Answer | None],
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

    async def _hello(self, inbox: _Inbox) -> Principal | None:
        """Check the connection's token before anything else is read from it."""
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                header, _ = await inbox.read_header(MAX_CONTROL_HEADER_BYTES, 0)
            if header.get("kind") != "hello":
                raise WireError(f"a block port connection starts with 'hello', got "
                                f"{header.get('kind')!r}")
            if header.get("v") != BLOCK_PORT_VERSION:
                raise WireError(f"block port version {header.get('v')!r} is not served; "
                                f"expected {BLOCK_PORT_VERSION}")
            token = header.get("token")
            if token is not None and not isinstance(token, str):
                raise WireError("'token' must be a string")
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
        await inbox.write(encode_frame({
            "kind": "welcome", "v": BLOCK_PORT_VERSION, "tenant": who.tenant,
            "max_body_bytes": self._max_body_bytes,
        }))
        return who

    async def _accept(self, inbox: _Inbox, who: Principal, header: FrameHeader,
                      appends: _SessionOrder) -> _Answer:
        """Take one request off the connection: an append's body is read now and
        stored while the next request is read; other requests run when their turn
        to answer comes (so a read sees every append before it)."""
        rid = header.get("id")
        op = header.get("op")
        self.stats.requests[str(op)] = self.stats.requests.get(str(op), 0) + 1
        if header.get("kind") != "request" or isinstance(rid, bool) or not isinstance(rid, int) \
                or rid < 0:
            return self._fatal(inbox, rid, WireError(
                "expected a 'request' frame with a non-negative int 'id'"))
        if op == "append":
            return await self._append(inbox, who, rid, header, appends)
        if op == "read":
            run = functools.partial(self._read, inbox, who, rid, header)
        elif op == "read_keys":
            run = functools.partial(self._read_keys, inbox, who, rid, header)
        elif op == "ping":
            run = functools.partial(inbox.write, encode_frame(
                {"kind": "reply", "id": rid, "status": 200}))
        else:
            error = InvalidInputError(
                f"unknown op {op!r}; expected append, read, read_keys or ping")
            return _Answer(functools.partial(self._reply_error, inbox, rid, error))

        async def write() -> None:
            try:
                await run()
            except ConnectionGone:
                raise
            except Exception as e:  # noqa: BLE001 - answered like the HTTP routes answer it
                await self._reply_error(inbox, rid, e)

        return _Answer(write)

    def _fatal(self, inbox: _Inbox, rid: object, error: BaseException) -> _Answer:
        """An answer after which the connection closes (its stream position is lost)."""
        answered = rid if isinstance(rid, int) and not isinstance(rid, bool) and rid >= 0 else 0
        return _Answer(functools.partial(
            self._reply_error, inbox, answered, error, closing=True), closing=True)

    async def _append(self, inbox: _Inbox, who: Principal, rid: int, header: FrameHeader,
                      appends: _SessionOrder) -> _Answer:
        """Read the append's body, then store it in the background (after the
        connection's earlier appends to the same session): its answer."""
        session_id = header.get("session_id")
        body_bytes = header.get("body_bytes")
        if not isinstance(session_id, str):
            return self._fatal(inbox, rid, InvalidInputError("append needs a 'session_id' string"))
        if isinstance(body_bytes, bool) or not isinstance(body_bytes, int) or body_bytes < 0:
            return self._fatal(inbox, rid,
                               WireError("append needs 'body_bytes', a non-negative int"))
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
            await inbox.write(encode_frame({"kind": "reply", "id": rid, "status": 200,
                                            "result": AppendOut.of(result).model_dump()}))

        return _Answer(write, settle=functools.partial(asyncio.wait, [store]))

    async def _body_frames(
        self,
        inbox: _Inbox,
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

    async def _read(self, inbox: _Inbox, who: Principal, rid: int,
                    header: FrameHeader) -> None:
        session_id = header.get("session_id")
        start, end, turn = header.get("start", 0), header.get("end"), header.get("turn")
        if not isinstance(session_id, str):
            raise InvalidInputError("read needs a 'session_id' string")
        for name, value, optional in (("start", start, False), ("end", end, True),
                                      ("turn", turn, True)):
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidInputError(f"read's {name!r} must be a non-negative int")
        response = await self._app.state.session_blocks(who, session_id, start, end, turn)
        await self._stream(inbox, response, {"kind": "reply", "id": rid, "status": 200,
                                             "body_bytes": response.content_length},
                           f"the read of {session_id!r}")

    async def _read_keys(self, inbox: _Inbox, who: Principal, rid: int,
                         header: FrameHeader) -> None:
        keys = header.get("keys")
        if not isinstance(keys, list) or not all(isinstance(k, bytes) for k in keys):
            raise InvalidInputError("read_keys needs 'keys', a list of 16-byte keys")
        try:
            body = BlocksByKeyIn(namespace=header.get("namespace"),
                                 keys=[k.hex() for k in keys])
        except ValidationError as e:
            raise InvalidInputError(f"read_keys: {e.errors()[0]['msg']}") from None
        response = await self._app.state.blocks_by_key(body, who)
        # A by-key response has no length known up front: its frames run to the end frame.
        await self._stream(inbox, response, {"kind": "reply", "id": rid, "status": 200,
                                             "until_end": True}, "the by-key read")

    async def _stream(self, inbox: _Inbox, response: Response, head: FrameHeader,
                      what: str) -> None:
        """Write an ASGI response's body after ``head``; cut short, the connection closes."""
        started = False

        async def send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                await inbox.write(encode_frame(head))
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
        self, inbox: _Inbox, rid: int, exc: BaseException, *, closing: bool = False
    ) -> None:
        """Answer ``exc``; ``closing``: the gateway closes the connection after it."""
        error = any_error_document(exc)
        self.stats.errors[error["type"]] = self.stats.errors.get(error["type"], 0) + 1
        reply = {"kind": "reply", "id": rid, "status": error["status"], "error": error}
        if closing:
            reply["close"] = True
        try:
            await inbox.write(encode_frame(reply))
        except ConnectionGone:
            pass


async def _no_receive() -> Message:
    # ASGI spec 2.4: responses do not listen for a disconnect; a write to a closed
    # connection raises ConnectionGone instead.
    await asyncio.get_running_loop().create_future()
    raise AssertionError("unreachable")
