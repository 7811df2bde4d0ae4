"""Block responses of the gateway: frames written straight from where the bytes sit.

A read response is a raw ASGI response with a Content-Length (computed from
the session's layout before any block is fetched: see
:class:`~memkv.protocol.wire.BlockFrameTemplate`), so uvicorn writes each
block's bytes to the socket as they are, without chunk framing (which would
join them into a new buffer). The bytes come from
:class:`memkv.api.blocks.BlockFetcher`.

A response that cannot finish (its device died) is cut short: the client
sees fewer bytes than the Content-Length and reports it, never a short 200
taken for a whole one. Bytes in shared memory reach the socket only while
their pin holds, however slowly the reader reads (:mod:`memkv.api.guarded_send`).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from memkv.api.errors import PayloadTooLarge
from memkv.api.guarded_send import DEFAULT_STALL_S, GuardedSend, ReaderStalledError
from memkv.errors import CorruptDataError, LeaseExpiredError
from memkv.protocol.layout import KVLayout
from memkv.protocol.wire import BlockFrameTemplate, end_frame

__all__ = ["FRAMES_MEDIA_TYPE", "BlockFramesResponse", "FetchedBytes", "KeyedFramesResponse"]

FRAMES_MEDIA_TYPE = "application/x-memkv-frames"


@dataclass(frozen=True, slots=True)
class FetchedBytes:
    """One block's bytes as the gateway writes them (no copy of its own)."""

    key: bytes
    data: memoryview
    tier: str
    exact: bool
    crc: int
    lossy: str = ""
    dtype: str = ""  # the block's dtype and shape, for frames built without a layout
    shape: tuple[int, ...] = ()
    #: Local monotonic time its pin runs out where ``data`` is shared memory (inf: the
    #: bytes are the gateway's own): never handed to a socket after it
    #: (memkv.api.guarded_send).
    valid_until: float = math.inf



class BlockFramesResponse(Response):
    """An ASGI response of block frames then an ``end`` frame, with a Content-Length.

    Args:
        layout: the blocks' layout (sizes and shapes).
        keys, tokens: the blocks and their token counts, in order.
        first_index: the ``index`` of the first frame.
        blocks: their bytes, in the same order (see :class:`BlockFetcher`).
        on_block: called with each block's byte count once it is written.
        stall_s: a reader that takes no bytes this long is cut off
            (:mod:`memkv.api.guarded_send`).
    """

    media_type = FRAMES_MEDIA_TYPE

    def __init__(  # noqa: PLR0913
        self,
        layout: KVLayout,
        keys: Sequence[bytes],
        tokens: Sequence[int],
        first_index: int,
        blocks: AsyncIterator[FetchedBytes],
        on_block: Callable[[int], None] = lambda n: None,
        stall_s: float = DEFAULT_STALL_S,
    ) -> None:
        self._templates = [
            BlockFrameTemplate(
                index=first_index + i,
                key=key,
                dtype=layout.dtype,
                shape=layout.block_shape(n),
                nbytes=layout.block_nbytes(n),
            )
            for i, (key, n) in enumerate(zip(keys, tokens, strict=True))
        ]
        self._end = end_frame(len(keys))
        self._blocks = blocks
        self._on_block = on_block
        self._stall_s = stall_s
        self._first: FetchedBytes | None = None
        # Response's own fields (FastAPI merges dependency headers into them);
        # the body is ours to write in __call__.
        super().__init__(content=b"", media_type=self.media_type)

    @property
    def content_length(self) -> int:
        return sum(len(t.prefix) + t.nbytes for t in self._templates) + len(self._end)

    async def prime(self) -> None:
        """Fetch the first block before the head goes out, so its errors get a status code."""
        if self._templates:
            self._first = await self._blocks.__anext__()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        out = GuardedSend(scope, send, self._stall_s)
        try:
            await out.start(200, [
                (b"content-type", self.media_type.encode()),
                (b"content-length", str(self.content_length).encode()),
            ])
            for i, template in enumerate(self._templates):
                block = self._first if i == 0 and self._first is not None else None
                if block is None:
                    block = await self._blocks.__anext__()
                if block.key != template.key or block.data.nbytes != template.nbytes:
                    raise CorruptDataError(
                        f"block {i}: got {block.data.nbytes} bytes of {block.key.hex()}, "
                        f"expected {template.nbytes}"
                    )
                prefix = bytes(
                    template.fill(
                        tier=block.tier, exact=block.exact, crc=block.crc, lossy=block.lossy
                    )
                )
                await out.body(prefix)
                await out.body(block.data, valid_until=block.valid_until)
                self._on_block(template.nbytes)
            await out.body(self._end, more=False)
        except (LeaseExpiredError, ReaderStalledError) as e:
            await out.cut(e)  # a reader too slow for its pins: cut off, one line logged
        finally:
            await self._blocks.aclose()  # type: ignore[attr-defined]
            out.done()


class KeyedFramesResponse(Response):
    """Blocks asked for by key, as frames then an ``end`` frame; no length known up front
    (each frame's header comes from its block), so the body is chunked.

    Args:
        keys: the blocks, in the order asked.
        first: the first block, fetched before the head goes out (its errors get a status).
        blocks: the others, in order (see :class:`BlockFetcher`).
        max_bytes: the most block bytes one answer may carry.
        on_block: called with each block's byte count once it is written.
        stall_s: a reader that takes no bytes this long is cut off.
    """

    media_type = FRAMES_MEDIA_TYPE

    def __init__(self, keys: Sequence[bytes], first: FetchedBytes,
                 blocks: AsyncIterator[FetchedBytes], *, max_bytes: int,
                 on_block: Callable[[int], None] = lambda n: None,
                 stall_s: float = DEFAULT_STALL_S) -> None:
        self._keys = list(keys)
        self._first: FetchedBytes | None = first
        self._blocks = blocks
        self._max_bytes = max_bytes
        self._on_block = on_block
        self._stall_s = stall_s
        super().__init__(content=b"", media_type=self.media_type)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        out = GuardedSend(scope, send, self._stall_s)
        try:
            await out.start(200, [(b"content-type", self.media_type.encode())])
            total = 0
            for i, key in enumerate(self._keys):
                block, self._first = self._first, None
                if block is None:
                    block = await self._blocks.__anext__()
                if block.key != key:
                    raise CorruptDataError(f"asked for block {key.hex()}, got {block.key.hex()}")
                total += block.data.nbytes
                if total > self._max_bytes:
                    raise PayloadTooLarge(
                        f"these blocks are over {self._max_bytes} bytes: ask for fewer at a time")
                template = BlockFrameTemplate(
                    index=i, key=key, dtype=block.dtype, shape=block.shape,
                    nbytes=block.data.nbytes)
                await out.body(bytes(template.fill(tier=block.tier, exact=block.exact,
                                                   crc=block.crc, lossy=block.lossy)))
                await out.body(block.data, valid_until=block.valid_until)
                self._on_block(block.data.nbytes)
            await out.body(end_frame(len(self._keys)), more=False)
        except (LeaseExpiredError, ReaderStalledError) as e:
            await out.cut(e)
        finally:
            await self._blocks.aclose()  # type: ignore[attr-defined]
            out.done()
