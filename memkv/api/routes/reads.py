"""Block reads: a session's blocks in chain order, and blocks by key.

Both stream block frames then an ``end`` frame (docs/wire-format.md), fetched
in small pipelined batches while earlier ones are on the wire. The block-read
fast path (:class:`memkv.api.middleware.BlockReadFastPath`) and the block port
serve session reads through :func:`session_blocks` too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Query, Response
from fastapi.responses import StreamingResponse
from ray.exceptions import RayError

from memkv.actors.handles import ACTOR_GONE_ERRORS
from memkv.actors.router_shards import merge_located
from memkv.api.auth import Principal
from memkv.api.context import Caller, Gateway, GatewayState, scoped
from memkv.api.errors import PayloadTooLarge
from memkv.api.frame_responses import (
    FRAMES_MEDIA_TYPE,
    BlockFramesResponse,
    FetchedBytes,
    KeyedFramesResponse,
)
from memkv.api.models import BINARY, BlocksByKeyIn, SessionIdPath
from memkv.errors import (
    InvalidInputError,
    MemkvError,
    NotFoundError,
    UnknownBlockError,
)
from memkv.protocol.messages import ReadRoute
from memkv.protocol.payload import BlockPayload
from memkv.protocol.wire import block_frame_prefix, end_frame

__all__ = ["read_blocks_by_key", "router", "session_blocks"]

router = APIRouter()


@router.get(
    "/v1/sessions/{session_id}/blocks",
    tags=["kv"],
    response_class=BlockFramesResponse,
    status_code=200,
    responses={200: {"content": {FRAMES_MEDIA_TYPE: {"schema": BINARY}}}},
)
async def read_blocks(
    session_id: SessionIdPath,
    gw: GatewayState,
    who: Caller,
    start: int = Query(default=0, ge=0),
    end: int | None = Query(default=None, ge=0),
    turn: int | None = Query(
        default=None,
        ge=0,
        description=(
            "The session's turn the reader has already seen (after its own append). "
            "A gateway that knows the session at this turn or later serves from its "
            "own view without asking the router; without it the router is asked."
        ),
    ),
) -> BlockFramesResponse:
    """A session's blocks in chain order: block frames, then an ``end`` frame.

    Blocks are fetched in small pipelined batches while earlier ones are on
    the wire, so a resume promotes them from the warm or cold tier as the
    reader gets to them. Each header says where the block was found, whether
    its bytes are exact, and their CRC32 (the writer's own, for exact blocks).
    Served by :class:`BlockReadFastPath` ahead of this route (same code, no
    FastAPI dependency machinery); this route documents it and serves the
    requests the fast path leaves (malformed query strings).
    """
    return await session_blocks(gw, who, session_id, start, end, turn)


async def _no_blocks() -> AsyncIterator[FetchedBytes]:
    """The blocks of a session that holds none yet (its route names no device)."""
    return
    yield


async def session_blocks(
    gw: Gateway, who: Principal, session_id: str, start: int, end: int | None, turn: int | None
) -> BlockFramesResponse:
    sid = scoped(who, session_id, "read")

    async def opened(whole: ReadRoute) -> BlockFramesResponse:
        route = whole.sliced(start, end)
        response = BlockFramesResponse(
            route.layout,
            route.keys,
            route.tokens,
            route.first_index,
            # Leases are released after the last byte, without holding up
            # the connection's next request (a release is a device call).
            gw.fetcher.fetch(
                route.device_id,
                route.device,
                route.keys,
                sid,
                whole.keys[start + len(route.keys) :],
            ) if route.device is not None else _no_blocks(),
            on_block=gw.metrics.payload_bytes.labels("out").inc,
            stall_s=gw.read_stall_s,
        )
        await response.prime()
        return response

    cached = gw.routes.get_at(sid, turn)
    if cached is not None:
        try:
            response = await opened(cached)
        except (MemkvError, RayError):
            gw.routes.drop(sid)  # moved or lost: ask the router below
        else:
            gw.touches.add(sid)  # hotness, told to the router in batches
            return response
    owner = gw.routers.service(sid)
    whole = await owner.read_route(sid, 0, None)
    try:
        response = await opened(whole)
    except (NotFoundError, *ACTOR_GONE_ERRORS) as e:
        if isinstance(e, NotFoundError) and not whole.keys:
            raise
        # Blocks of the route missing on its device, or the device gone: it may
        # have restarted since the router last looked, or its node died (the
        # router then moves its sessions). Have it check, then ask again.
        await owner.device_failed(whole.device_id)
        whole = await owner.read_route(sid, 0, None)
        response = await opened(whole)
    gw.routes.put(sid, whole)
    return response


@router.post(
    "/v1/blocks/read",
    tags=["kv"],
    response_class=BlockFramesResponse,
    status_code=200,
    responses={200: {"content": {FRAMES_MEDIA_TYPE: {"schema": BINARY}}}},
)
async def read_blocks_by_key(body: BlocksByKeyIn, gw: GatewayState, who: Caller) -> Response:
    """Blocks by key (e.g. a prefix found by /v1/match), in the order asked.

    Only blocks of the namespace read (the caller's tenant, or a public one
    its token may read) are served; any other key answers 404 like a
    missing one. A key named twice is sent once.
    """
    who.require("read")
    namespaces = who.read_namespaces(body.namespace)
    try:
        keys = list(dict.fromkeys(bytes.fromhex(k) for k in body.keys))
    except ValueError as e:
        raise InvalidInputError(f"keys must be hex strings: {e}") from e
    if not namespaces:  # a public namespace whose publishers it trusts none of
        raise UnknownBlockError("no block of a trusted publisher has these keys")
    groups = merge_located(
        list(await asyncio.gather(*gw.routers.locate_blocks(keys, namespaces)))
    )
    if len(groups) == 1:
        # One device holds them all (the usual case: a prefix lives where its
        # sessions do): stream them the way session reads go, through read
        # plans from shared memory, pipelined, in the order asked.
        device_id, device, group = groups[0]
        return await _streamed_by_key(gw, device_id, device, list(group))
    found: dict[bytes, BlockPayload] = {}
    total = 0
    for _, device, group in groups:
        for payload in await device.get_blocks(group):
            found[payload.key] = payload
            total += payload.nbytes
        if total > gw.max_body_bytes:
            raise PayloadTooLarge(
                f"these blocks are over {gw.max_body_bytes} bytes: ask for fewer at a time"
            )

    async def stream() -> AsyncIterator[bytes | memoryview]:
        for i, key in enumerate(keys):
            for chunk in _block_chunks(i, found[key]):
                yield chunk
            gw.metrics.payload_bytes.labels("out").inc(found[key].nbytes)
        yield end_frame(len(keys))

    return StreamingResponse(stream(), media_type=FRAMES_MEDIA_TYPE)


async def _streamed_by_key(
    gw: Gateway, device_id: str, device: Any, keys: list[bytes]
) -> KeyedFramesResponse:
    blocks = gw.fetcher.fetch(device_id, device, keys, None)
    # The first block before the head goes out, so its errors get a status code.
    first = await blocks.__anext__()
    return KeyedFramesResponse(
        keys, first, blocks, max_bytes=gw.max_body_bytes,
        on_block=gw.metrics.payload_bytes.labels("out").inc, stall_s=gw.read_stall_s)
def _block_chunks(index: int, payload: BlockPayload) -> list[bytes | memoryview]:
    data = memoryview(np.ascontiguousarray(payload.data).data).cast("B")
    prefix = block_frame_prefix(
        index=index,
        key=payload.key,
        dtype=payload.dtype,
        shape=tuple(payload.data.shape),
        data=data,
        tier=payload.tier or "hot",
        exact=payload.exact,
        lossy=payload.lossy,
    )
    return [prefix, data]
