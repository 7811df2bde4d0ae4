"""Sending bytes that live in shared memory: never after the pin that keeps them.

The gateway writes a read's blocks straight from the devices' shared memory
(``device.same_node_reads``). The event loop's transport keeps what the kernel
did not take yet *by reference* (uvloop buffers the memoryview, it does not
copy it) and reads it when the socket is writable again. A reader that stops
reading for longer than the blocks' leases would then be sent whatever the
device has since put in that memory: another tenant's KV (measured: 42 of 48
blocks of a stalled stream were another tenant's). The rule here:

- the transport keeps no byte of the gateway's own (its write buffer limits
  are 0: the protocol is paused as soon as anything is left unsent), and after
  each block read from shared memory the response waits until the kernel has
  taken all of it (uvicorn's ``send`` waits for that before it writes more; an
  empty body is a flush);
- a reader that takes no bytes for ``stall_s`` has its connection aborted
  (the unsent bytes are dropped, never read again), before the pins go;
- a block is handed to the transport only while its pin has more than
  ``stall_s`` left, so a block waiting in the transport is always pinned.

The gateway's uvicorn protocol puts its transport in each request's scope
(:class:`TransportScopeProtocol`); the block port's own protocol keeps the
same rules itself (``memkv.api.block_port``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from memkv.errors import LeaseExpiredError, MemkvError

__all__ = [
    "DEFAULT_STALL_S", "TRANSPORT_EXTENSION", "UNBUFFERED_EXTENSION", "GuardedSend",
    "ReaderStalledError", "TransportScopeProtocol",
]

logger = logging.getLogger(__name__)

#: Where the gateway's HTTP protocol puts the connection's transport in a request's scope.
TRANSPORT_EXTENSION = "memkv.transport"
#: Set by a server whose send returns only once the transport holds nothing (the block
#: port): no buffer limits to change, nothing to flush.
UNBUFFERED_EXTENSION = "memkv.unbuffered"
#: A reader that takes no bytes this long (seconds) has its connection aborted.
DEFAULT_STALL_S = 5.0
#: How long a cut response waits for the server to see its connection gone (seconds).
CUT_SETTLE_S = 0.005
#: A block goes to the transport only with this much more than ``stall_s`` left on its pin.
LEASE_SAFETY_S = 1.0


class ReaderStalledError(MemkvError):
    """The reader took no bytes for the gateway's stall bound: its connection was aborted."""


class TransportScopeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with the connection's transport in each request's
    scope (``scope["extensions"]["memkv.transport"]``) for :class:`GuardedSend`."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        extensions: Any = {TRANSPORT_EXTENSION: self.transport}
        self.scope["extensions"] = extensions


class GuardedSend:
    """An ASGI ``send`` for responses with bytes in shared memory.

    Args:
        scope: the request's scope (its transport, where the server gives it).
        send: the ASGI send.
        stall_s: how long a reader may take no bytes before its connection is aborted.
    """

    def __init__(self, scope: Any, send: Any, stall_s: float = DEFAULT_STALL_S) -> None:
        if not stall_s > 0:
            raise ValueError(f"stall_s must be > 0, got {stall_s}")
        self._send = send
        self.stall_s = stall_s
        extensions = scope.get("extensions") or {}
        transport: Any = extensions.get(TRANSPORT_EXTENSION)
        self._transport = transport
        self._buffered = transport is not None and not extensions.get(UNBUFFERED_EXTENSION)
        if self._buffered:
            # Nothing left unsent in the transport once a send returns: the protocol is
            # paused while anything is, and uvicorn's next send waits for it to resume.
            transport.set_write_buffer_limits(high=0, low=0)

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self._bounded({"type": "http.response.start", "status": status,
                             "headers": headers})

    async def body(self, data: bytes | memoryview, *, valid_until: float = math.inf,
                   more: bool = True) -> None:
        """Send ``data``; ``valid_until`` (local monotonic seconds): when the pin on the
        shared memory it lies in runs out (inf: the gateway's own bytes)."""
        shared = math.isfinite(valid_until)
        if shared and time.monotonic() + self.stall_s + LEASE_SAFETY_S >= valid_until:
            raise LeaseExpiredError(
                "a block's pin would run out while it is sent (the reader is too slow): "
                "the read ends here; read the rest again")
        await self._bounded({"type": "http.response.body", "body": data, "more_body": more})
        if shared and more:
            await self.flush()

    async def flush(self) -> None:
        """Return once the kernel holds everything sent (an empty body waits for it)."""
        if self._buffered:
            await self._bounded({"type": "http.response.body", "body": b"", "more_body": True})

    async def cut(self, why: BaseException) -> None:
        """End the response here: the connection is aborted (what the transport holds is
        dropped, a reader sees a cut stream, never a short answer taken for whole)."""
        logger.info("a block read was cut off: %s", why)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.abort()
            # The loop tells the server the connection is gone on a later turn; let it,
            # so that the server does not take the response's end for an error of ours.
            await asyncio.sleep(CUT_SETTLE_S)

    def done(self) -> None:
        """The response is over: the connection's usual write buffering again."""
        if self._buffered and self._transport is not None and not self._transport.is_closing():
            self._transport.set_write_buffer_limits()

    async def _bounded(self, message: dict[str, Any]) -> None:
        try:
            await asyncio.wait_for(self._send(message), self.stall_s)
        except TimeoutError:
            # Drop what the transport holds (it may point into shared memory whose pin
            # goes next): the reader sees a cut connection, never other bytes.
            if self._transport is not None:
                self._transport.abort()
            raise ReaderStalledError(
                f"the reader took no bytes for {self.stall_s:g} s") from None
