"""Block responses of the gateway: frames written straight from where the bytes sit.

A read response is a raw ASGI response with a Content-Length (computed from
the session's layout before any block is fetched: see
:class:`~memkv.protocol.wire.BlockFrameTemplate`), so uvicorn writes each
block's bytes to the socket as they are, without chunk framing (which would
join them into a new buffer). Where the device runs on the gateway's node the
bytes are memoryviews of its shared-memory arenas, pinned by a lease while
they are written; elsewhere they are zero-copy views of Ray objects.

A response that cannot finish (its device died) is cut short: the client
sees fewer bytes than the Content-Length and reports it, never a short 200
taken for a whole one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.responses import Response

from memkv.actors.payload import READ_BATCH_BLOCKS, READ_WINDOW_BATCHES, BlockPayload
from memkv.errors import CorruptDataError
from memkv.protocol.checksum import crc32
from memkv.protocol.layout import KVLayout
from memkv.protocol.messages import ReadPlan
from memkv.protocol.wire import BlockFrameTemplate, end_frame
from memkv.same_node import SegmentMaps

__all__ = ["FRAMES_MEDIA_TYPE", "BlockFramesResponse", "BlockFetcher", "FetchedBytes"]

FRAMES_MEDIA_TYPE = "application/x-memkv-frames"


@dataclass(frozen=True, slots=True)
class FetchedBytes:
    """One block's bytes as the gateway writes them (no copy of its own)."""

    key: bytes
    data: memoryview
    tier: str
    exact: bool
    crc: int


class BlockFetcher:
    """Fetches blocks from a device in pipelined batches.

    Args:
        maps: mappings of shared-memory segments, or None to never read them
            (same-node reads switched off).
        node_id: the gateway's Ray node: plans of devices elsewhere are not used.
    """

    def __init__(self, maps: SegmentMaps | None, node_id: str | None) -> None:
        self._maps = maps
        self._node_id = node_id
        self.same_node_blocks = 0
        self.in_cluster_blocks = 0
        self.leases_lost = 0
        self._settling: set[asyncio.Future[None]] = set()

    async def fetch(
        self,
        device: Any,
        keys: Sequence[bytes],
        stream: str | None,
        settled: list[asyncio.Future[None]] | None = None,
    ) -> AsyncIterator[FetchedBytes]:
        """The blocks of ``keys`` in order; at most READ_WINDOW_BATCHES batches ahead.

        Args:
            settled: receives the task that releases this fetch's leases once
                its last block is handed over (await it to know they are released).
        """
        batches = [keys[i : i + READ_BATCH_BLOCKS] for i in range(0, len(keys), READ_BATCH_BLOCKS)]
        use_plans = self._maps is not None
        in_flight: deque[tuple[Sequence[bytes], Any, bool]] = deque()
        # Plans whose bytes were handed to the transport. They are released one
        # batch later (and the last ones after the end frame), because the
        # transport may still hold a view of the bytes it has not sent yet.
        drained: list[ReadPlan] = []
        releases: list[Any] = []
        try:
            for batch in batches:
                in_flight.append(self._ask(device, batch, stream, use_plans))
                if len(in_flight) > READ_WINDOW_BATCHES:
                    held = len(drained)
                    async for item in self._drain(device, in_flight.popleft(), stream, drained):
                        yield item
                    releases += [device.release_lease.remote(p.lease_id) for p in drained[:held]]
                    del drained[:held]
            while in_flight:
                async for item in self._drain(device, in_flight.popleft(), stream, drained):
                    yield item
        finally:
            releases += [device.release_lease.remote(p.lease_id) for p in drained]
            # Leases of batches asked for but never drained (the client went away).
            for _, ref, planned in in_flight:
                if planned:
                    releases.append(_release_later(device, ref))
            # Settled after the last byte is out, off the reader's critical path
            # (the response's finally awaits it before the connection serves
            # its next request).
            task = asyncio.ensure_future(self._settle(releases))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)
            if settled is not None:
                settled.append(task)

    async def _settle(self, releases: list[Any]) -> None:
        for done in releases:
            if not await done:
                # The lease ran out while its bytes were written: they may have
                # changed under the socket. The client's checksum check stops
                # them; this counts how often it happens.
                self.leases_lost += 1

    async def settled(self) -> None:
        """Wait until every lease handed back so far is released (shutdown)."""
        await asyncio.gather(*list(self._settling))

    def _ask(
        self, device: Any, batch: Sequence[bytes], stream: str | None, use_plans: bool
    ) -> tuple[Sequence[bytes], Any, bool]:
        if use_plans:
            return batch, device.read_plan.remote(list(batch), stream), True
        return batch, device.get_blocks.remote(list(batch), stream), False

    async def _drain(
        self,
        device: Any,
        asked: tuple[Sequence[bytes], Any, bool],
        stream: str | None,
        drained: list[ReadPlan],
    ) -> AsyncIterator[FetchedBytes]:
        batch, ref, planned = asked
        if not planned:
            for payload in await ref:
                self.in_cluster_blocks += 1
                yield _from_payload(payload)
            return
        plan: ReadPlan = await ref
        if plan.node_id != self._node_id or self._maps is None:
            # The device is elsewhere: give the pins back, read in-cluster.
            drained.append(plan)
            self._maps = None
            for payload in await device.get_blocks.remote(list(batch), stream):
                self.in_cluster_blocks += 1
                yield _from_payload(payload)
            return
        # Handed back for release now: an async generator interrupted by the
        # client going away is not closed, so no finally of ours would run.
        drained.append(plan)
        missing = [k for k, e in zip(batch, plan.entries, strict=True) if e is None]
        fallback: dict[bytes, BlockPayload] = {}
        if missing:
            fallback = {p.key: p for p in await device.get_blocks.remote(missing, stream)}
        for key, entry in zip(batch, plan.entries, strict=True):
            if entry is None:
                self.in_cluster_blocks += 1
                yield _from_payload(fallback[bytes(key)])
                continue
            segment = self._maps.view(entry.segment, entry.segment_bytes, plan.incarnation)
            if entry.offset + entry.nbytes > segment.size:
                raise CorruptDataError(f"block {entry.key.hex()} lies outside its segment")
            data = segment[entry.offset : entry.offset + entry.nbytes].data
            self.same_node_blocks += 1
            yield FetchedBytes(entry.key, data, entry.found, entry.exact, entry.crc32)


async def _nothing() -> None:
    return None


async def _release_later(device: Any, plan_ref: Any) -> bool:
    plan: ReadPlan = await plan_ref
    return bool(await device.release_lease.remote(plan.lease_id))


def _from_payload(payload: BlockPayload) -> FetchedBytes:
    data = np.ascontiguousarray(payload.data).data.cast("B")
    return FetchedBytes(payload.key, data, payload.tier or "hot", payload.exact, crc32(data))


class BlockFramesResponse(Response):
    """An ASGI response of block frames then an ``end`` frame, with a Content-Length.

    Args:
        layout: the blocks' layout (sizes and shapes).
        keys, tokens: the blocks and their token counts, in order.
        first_index: the ``index`` of the first frame.
        blocks: their bytes, in the same order (see :class:`BlockFetcher`).
        on_block: called with each block's byte count once it is written.
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
        after: Callable[[], Awaitable[None]] | None = None,
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
        self._after = after or _nothing
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
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", self.media_type.encode()),
                    (b"content-length", str(self.content_length).encode()),
                ],
            }
        )
        try:
            for i, template in enumerate(self._templates):
                block = self._first if i == 0 and self._first is not None else None
                if block is None:
                    block = await self._blocks.__anext__()
                if block.key != template.key or block.data.nbytes != template.nbytes:
                    raise CorruptDataError(
                        f"block {i}: got {block.data.nbytes} bytes of {block.key.hex()}, "
                        f"expected {template.nbytes}"
                    )
                prefix = bytes(template.fill(tier=block.tier, exact=block.exact, crc=block.crc))
                await send({"type": "http.response.body", "body": prefix, "more_body": True})
                await send({"type": "http.response.body", "body": block.data, "more_body": True})
                self._on_block(template.nbytes)
            await send({"type": "http.response.body", "body": self._end, "more_body": False})
        finally:
            await self._blocks.aclose()  # type: ignore[attr-defined]
            await self._after()
