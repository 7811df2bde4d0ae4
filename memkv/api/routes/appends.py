"""Appends: ``POST /v1/sessions/{id}/turns``, a ``turn`` frame then its block frames.

The block port (:mod:`memkv.api.block_port`) sends its appends through
:func:`receive_append` too: one path checks every key and checksum, stages the
body where a device on this node can copy it, and stores it in one router call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response

from memkv.actors.handles import Pending
from memkv.api.answers import ReservationOut, documented, message_answer
from memkv.api.auth import Principal
from memkv.api.body_budget import BodyHold
from memkv.api.context import (
    Caller,
    Gateway,
    GatewayState,
    release_after,
    run_in_background,
    scoped,
)
from memkv.api.errors import BodyTimeout, PayloadTooLarge
from memkv.api.frame_responses import FRAMES_MEDIA_TYPE
from memkv.api.models import ReserveIn, SessionIdPath
from memkv.errors import (
    ConflictError,
    InvalidInputError,
    LayoutMismatchError,
    NotFoundError,
    WrongNodeError,
)
from memkv.protocol.dtypes import non_finite_count
from memkv.protocol.hashing import chain_hashes, token_array
from memkv.protocol.layout import KVLayout
from memkv.protocol.payload import BlockPayload, StagedBlock
from memkv.protocol.services import (
    AppendAnswer,
    AppendTurn,
    Expected,
    LayoutSpec,
    Quota,
    ReserveSlots,
)
from memkv.protocol.wire import (
    Frame,
    FrameHeader,
    FrameReader,
    WireError,
    block_payload,
    frame_checksum,
    staged_ref,
    staged_reservation,
)
from memkv.shm.staging import StagingSlot

__all__ = ["receive_append", "router"]

router = APIRouter()


@router.post(
    "/v1/sessions/{session_id}/turns",
    tags=["kv"],
    responses={200: documented(AppendAnswer, "The session's chain after the turn.")},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {FRAMES_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def append_turn(
    session_id: SessionIdPath, request: Request, gw: GatewayState, who: Caller
) -> Response:
    """Append a turn: a ``turn`` frame then its ``block`` frames (docs/wire-format.md).

    Idempotent by the turn index: a retry of the last turn with the same
    tokens answers as before (``replayed``) and stores nothing.
    """
    declared = request.headers.get("content-length")

    def read(allocate: Callable[[int], memoryview | None] | None,
             hold: BodyHold) -> Awaitable[list[Frame]]:
        return _read_frames(request, gw.max_body_bytes, gw.body_timeout_s, allocate=allocate,
                            hold=hold)

    return message_answer(await receive_append(
        gw, who, session_id, int(declared) if declared and declared.isdigit() else None, read
    ))


@router.post("/v1/sessions/{session_id}/reservations", tags=["kv"])
async def reserve_slots(
    session_id: SessionIdPath, body: ReserveIn, gw: GatewayState, who: Caller
) -> ReservationOut:
    """A write reservation for the session's next append (a client on this host).

    The session's device sets aside block-sized slots of its shared memory; the
    client copies its blocks there and its append names them, so the device
    stores them where they lie instead of copying them (a save's second copy).
    ``id`` null: no reservation here (the device is on another node, or short
    of room): stage or send the blocks as usual.
    """
    sid = scoped(who, session_id, "write")
    if gw.staging is None or not gw.this_node:
        return ReservationOut(id=None, reason="no device runs on this gateway's node")
    if gw.unstaged.get(sid) is not None:
        return ReservationOut(id=None, reason=f"session {session_id!r} lives on another node")
    chain: tuple[bytes, ...] = ()
    if body.tokens is not None:
        layout, namespace, _ = await _session_facts(gw, sid)
        chain = tuple(bytes(k) for k in chain_hashes(token_array(body.tokens), layout,
                                                     namespace))
    answer = await gw.routers.service(sid).reserve_slots(ReserveSlots(
        session_id=sid, count=body.blocks, node=gw.this_node, chain=chain, ttl_s=body.ttl_s))
    if not answer.reservation_id:
        return ReservationOut(id=None, reason=answer.reason)
    return ReservationOut(
        id=answer.reservation_id, host=gw.host_shm, device_id=answer.device_id,
        segment=answer.segment, segment_bytes=answer.segment_bytes,
        slot_bytes=answer.slot_bytes, offsets=list(answer.offsets), ttl_s=answer.ttl_s)


async def _session_facts(gw: Gateway, sid: str) -> tuple[KVLayout, str, bool]:
    """A session's layout, namespace and finite_only, from the gateway's cache."""
    known = gw.sessions.get(sid)
    if known is None:
        view = await gw.routers.service(sid).session(sid)
        known = (view.layout.layout(), view.namespace, view.finite_only)
        gw.sessions.put(sid, known)
    return known


async def receive_append(
    gw: Gateway,
    who: Principal,
    session_id: str,
    declared: int | None,
    read: Callable[[Callable[[int], memoryview | None] | None, BodyHold],
                   Awaitable[list[Frame]]],
) -> AppendAnswer:
    """An append whose body ``read`` receives: into staging where it can, under the
    in-flight budget, stored only once every frame is in and checked.

    Both the HTTP route and the block port (memkv.api.block_port) come here.
    ``declared``: the body's announced size (None: unknown, the limit is held).
    """
    sid = scoped(who, session_id, "write")
    slot = None
    if gw.staging is not None and gw.unstaged.get(sid) is None and declared:
        slot = gw.staging.lease(min(declared, gw.max_body_bytes))
    try:
        size = min(declared if declared is not None else gw.max_body_bytes, gw.max_body_bytes)
        async with gw.inflight.hold(who.tenant or "", size) as hold:
            frames = await read(slot.take if slot is not None else None, hold)
        return await _append(gw, sid, session_id, frames, slot, who)
    finally:
        if slot is not None:
            # A device may still be copying out of the slot (the client went away
            # mid-call): free it only once that call has answered.
            pending = slot.in_flight
            if pending is None:
                slot.release()
            else:
                run_in_background(release_after(pending, slot))


async def _append(
    gw: Gateway, sid: str, session_id: str, frames: list[Frame], slot: StagingSlot | None,
    who: Principal,
) -> AppendAnswer:
    if not frames or frames[0].kind != "turn":
        raise WireError("an append body starts with a 'turn' frame")
    head = frames[0].header
    layout, namespace, finite_only = await _session_facts(gw, sid)
    sent_layout = head.get("layout")
    if sent_layout is not None and KVLayout.from_dict(sent_layout) != layout:
        raise ConflictError(
            f"the body's layout {sent_layout} differs from session {session_id!r}'s "
            f"{layout.to_dict()}"
        )
    tokens = _tokens(head)
    # The gateway is the trust boundary: it hashes the chain once and checks
    # every block's key and checksum; the store keeps the writer's checksum.
    chain = chain_hashes(tokens, layout, namespace)
    start = head.get("start_block", 0)
    turn = head.get("turn")
    if not isinstance(start, int) or not 0 <= start <= len(chain):
        raise WireError(f"'start_block' must be an int in [0, {len(chain)}], got {start!r}")
    if turn is not None and not isinstance(turn, int):
        raise WireError(f"'turn' must be an int or absent, got {turn!r}")
    blocks = frames[1:]
    if len(blocks) != len(chain) - start:
        raise WireError(
            f"{len(tokens)} tokens make {len(chain)} blocks: from block {start} the body "
            f"must carry {len(chain) - start} block frames, it has {len(blocks)}"
        )
    payloads = []
    checksums: list[int | None] = []
    # Each block's (segment, offset, reservation) where its client staged it.
    in_client_segments: list[tuple[str, int, str] | None] = []
    for i, frame in enumerate(blocks, start=start):
        reservation = staged_reservation(frame)
        key, dtype, array = block_payload(
            frame, gw.client_segments.resolver(reservation))
        ref = staged_ref(frame)
        in_client_segments.append(None if ref is None else (*ref, reservation))
        if key != chain[i]:
            raise WireError(f"block {i}: its key does not match the hash of its tokens")
        if dtype != layout.dtype:
            raise LayoutMismatchError(
                f"block {i} is {dtype}, the session's layout is {layout.dtype}"
            )
        if finite_only and (bad := non_finite_count(array, dtype)):
            raise InvalidInputError(
                f"block {i} holds {bad} NaN or infinite value(s); session {session_id!r} "
                f"was created finite_only"
            )
        payloads.append(BlockPayload(key, dtype, array))
        checksums.append(frame_checksum(frame))  # None: staged without one
        gw.metrics.payload_bytes.labels("in").inc(array.nbytes)

    request = AppendTurn(
        session_id=sid, token_ids=AppendTurn.pack_tokens(tokens), start_block=start,
        chain=tuple(bytes(k) for k in chain), turn=turn,
        # Without every writer's checksum the device makes them all as it stores them.
        checksums=None if None in checksums else tuple(c for c in checksums if c is not None),
        expect=Expected(layout=LayoutSpec.of(layout), namespace=namespace),
        quota=Quota.of(who.quota),
    )

    def put(blocks: list[Any]) -> Pending[AppendAnswer]:
        return gw.routers.service(sid).put_blocks(request, blocks)

    try:
        staged = _describe(gw, sid, payloads, in_client_segments, slot)
        if staged is None:
            result = await put([gw.put_object(p) for p in payloads])
        else:
            pending = put(staged)
            if slot is not None:
                slot.in_flight = pending
            try:
                result = await pending
                gw.metrics.staged_bytes.inc(sum(p.nbytes for p in payloads))
            except WrongNodeError:
                # The session's device is on another node: by value from now on.
                gw.unstaged.put(sid, True)
                result = await put([gw.put_object(p) for p in payloads])
            finally:
                if slot is not None:
                    slot.in_flight = None
    except (NotFoundError, ConflictError):
        gw.sessions.drop(sid)  # the session went, or was created again
        raise
    finally:
        gw.routes.drop(sid)
    return result


def _describe(
    gw: Gateway, sid: str, payloads: list[BlockPayload],
    in_client_segments: list[tuple[str, int, str] | None], slot: StagingSlot | None,
) -> list[StagedBlock] | None:
    """Where a device on this node copies the blocks from: the client's segment (every
    block staged by the client) or this gateway's slot; None: send them by value."""
    if not payloads or gw.staging is None or gw.unstaged.get(sid) is not None:
        return None  # no device here, or not the session's (``staging`` needs one)
    if all(ref is not None for ref in in_client_segments):
        return [gw.client_segments.staged_block(p.key, p.dtype, tuple(p.data.shape), ref[0],
                                                ref[1], p.nbytes, gw.this_node, ref[2])
                for p, ref in zip(payloads, in_client_segments, strict=True)
                if ref is not None]
    if slot is None:
        return None
    return gw.staging.describe(payloads, gw.this_node)


def _tokens(head: FrameHeader) -> np.ndarray:
    raw = head.get("tokens")
    if isinstance(raw, bytes):
        if len(raw) % 8:
            raise WireError("'tokens' must be int64 little-endian bytes (a multiple of 8)")
        return token_array(np.frombuffer(raw, dtype="<i8"))
    if isinstance(raw, list):
        return token_array(raw)
    raise WireError("the turn frame needs 'tokens': int64 little-endian bytes or a list of ints")



async def _read_frames(
    request: Request,
    max_body_bytes: int,
    idle_timeout_s: float,
    allocate: Callable[[int], memoryview | None] | None = None,
    hold: BodyHold | None = None,
) -> list[Frame]:
    declared = request.headers.get("content-length")
    limit = max_body_bytes
    if declared is not None and declared.isdigit():
        if int(declared) > max_body_bytes:
            raise PayloadTooLarge(
                f"body of {declared} bytes exceeds the limit of {max_body_bytes}"
            )
        # No frame may declare more payload than the whole body has: a header
        # that lies about its size allocates nothing for it.
        limit = int(declared)
    reader = FrameReader(max_payload_bytes=limit, allocate=allocate)
    frames: list[Frame] = []
    total = 0
    chunks = request.stream().__aiter__()
    while True:
        try:
            async with asyncio.timeout(idle_timeout_s) as waiting:
                if hold is not None:
                    hold.timeout = waiting  # a stalled body is dropped through it
                chunk = await anext(chunks)
        except StopAsyncIteration:
            break
        except TimeoutError:
            if hold is not None and hold.dropped:
                raise BodyTimeout(
                    f"the request body was dropped: {hold.why} ({total} bytes received)"
                ) from None
            raise BodyTimeout(
                f"the request body stalled: no bytes for {idle_timeout_s:g} s "
                f"({total} bytes received)"
            ) from None
        total += len(chunk)
        if hold is not None:
            hold.progress(len(chunk))
        if total > max_body_bytes:
            raise PayloadTooLarge(f"body exceeds the limit of {max_body_bytes} bytes")
        frames.extend(reader.feed(chunk))
    reader.close()
    return frames
