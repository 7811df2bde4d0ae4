"""One block-port connection's bytes, read where its reader says (no copy of its own).

An :class:`asyncio.BufferedProtocol`: the event loop reads the socket straight
into the buffer :meth:`Inbox.readinto` was given (a staging slot, a payload
buffer), a few header bytes ahead into a small spare. The block port
(:mod:`memkv.api.block_port`) parses frames on top of it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from memkv.api.body_budget import BodyHold
from memkv.api.errors import BodyTimeout
from memkv.protocol.wire import PREFIX_BYTES, FrameHeader, decode_header, decode_prefix

__all__ = ["ConnectionGone", "Inbox"]

#: Bytes read ahead of the current frame (headers of pipelined requests).
_SPARE_BYTES = 256 << 10
#: At most this much is read ahead at once: the part of a payload that arrives
#: with its header is copied once more; the rest goes straight to its buffer.
_READ_AHEAD_BYTES = 64 << 10
#: The spare buffer of a connection before its hello (enough for the hello itself;
#: the full _SPARE_BYTES once authenticated).
_HELLO_SPARE_BYTES = 4 << 10


class ConnectionGone(Exception):
    """The peer closed the connection (or it broke) while a frame was awaited."""


class Inbox(asyncio.BufferedProtocol):
    """A connection whose bytes go where the reader says: ``readinto(view)``.

    While a reader waits for a payload, :meth:`get_buffer` hands the event loop
    the rest of that payload's own buffer, so the kernel copies the bytes there
    (``recv_into``) and nothing copies them again. Between payloads bytes land
    in a small spare buffer (headers, pipelined requests); reading stops while
    it is full.
    """

    def __init__(
        self, on_open: Callable[[Inbox], Coroutine[Any, Any, None]], idle_timeout_s: float
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
