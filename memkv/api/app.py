"""The HTTP gateway: FastAPI routes over the router and device actors.

Session lifecycle under ``/v1``; KV payloads travel as binary frame bodies
(:mod:`memkv.protocol.wire`, docs/wire-format.md), never pickle. Reads stream: a
resume's first block is on the wire before its last is promoted. Errors are
JSON ``{"error": {"type": ..., "message": ...}}`` with a status chosen from
memkv's exception hierarchy (only this module maps exceptions to HTTP).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.resources
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Annotated, Any, Generic, Literal, TypeVar

import numpy as np
import ray
from fastapi import Depends, FastAPI, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool
from ray.exceptions import RayActorError, RayError
from starlette.exceptions import HTTPException as StarletteHTTPException

from memkv.actors.handles import Pending
from memkv.actors.payload import BlockPayload
from memkv.actors.router_shards import RouterShards, merge_located, merge_prefix, merge_stats
from memkv.api.auth import Authenticator, Principal
from memkv.api.blocks import (
    FRAMES_MEDIA_TYPE,
    BlockFetcher,
    BlockFramesResponse,
    FetchedBytes,
    PlanCache,
)
from memkv.api.body_budget import BodyBudget, BodyHold
from memkv.api.client_leases import (
    DEFAULT_TTL_S,
    MAX_TTL_S,
    ClientLeases,
    parse_lease_id,
    plan_entry_json,
)
from memkv.api.observe import StatsSnapshot, engine_metrics
from memkv.errors import (
    BlockLostError,
    CapacityError,
    ClosedError,
    ConflictError,
    CorruptDataError,
    ForbiddenError,
    InvalidInputError,
    LayoutMismatchError,
    MemkvError,
    NotFoundError,
    UnauthorizedError,
    UnknownBlockError,
    WrongNodeError,
    plain_message,
)
from memkv.protocol.dtypes import DTYPES, non_finite_count
from memkv.protocol.enums import parse_ack, parse_priority
from memkv.protocol.hashing import chain_hashes, token_array
from memkv.protocol.ids import (
    MAX_SESSION_ID_LEN,
    NAME_PATTERN,
    PUBLISHER_SEPARATOR,
    SESSION_ID_PATTERN,
    scoped_session_id,
)
from memkv.protocol.layout import LAYOUT_LIMITS, MAX_MODEL_ID_CHARS, KVLayout
from memkv.protocol.messages import ReadRoute
from memkv.protocol.services import (
    AppendAnswer,
    AppendTurn,
    CreateSession,
    Expected,
    LayoutSpec,
    Quota,
    SessionView,
)
from memkv.protocol.wire import (
    BlockFrameTemplate,
    Frame,
    FrameReader,
    WireError,
    block_frame_prefix,
    block_payload,
    end_frame,
)
from memkv.same_node import SegmentMaps, shm_identity
from memkv.staging import PutStaging, StagingSlot

__all__ = ["FRAMES_MEDIA_TYPE", "create_app"]

logger = logging.getLogger(__name__)


# Most specific first: the first isinstance match decides the status.
_STATUS: list[tuple[type[BaseException], int]] = [
    (UnauthorizedError, 401),
    (ForbiddenError, 403),
    (ConflictError, 409),
    (NotFoundError, 404),
    (BlockLostError, 410),
    (InvalidInputError, 422),
    (CapacityError, 507),
    (CorruptDataError, 500),
    (ClosedError, 503),
    (MemkvError, 500),
]


_BINARY = {"type": "string", "format": "binary"}


class PayloadTooLarge(InvalidInputError):
    """A request body is larger than the gateway accepts."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _json_int(value: Any) -> Any:
    """JSON's integers (``4``, and ``4.0``, which JSON Schema calls an integer), not ``"4"``."""
    if isinstance(value, bool) or isinstance(value, str):
        raise ValueError(f"expected an integer, got {value!r:.40}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_json_int)]


class LayoutIn(_Model):
    # "4" is not 4. Bounds are KVLayout's own (LAYOUT_LIMITS).
    model_config = ConfigDict(extra="forbid", strict=False)

    model_id: str = Field(min_length=1, max_length=MAX_MODEL_ID_CHARS)
    num_layers: JsonInt = Field(ge=1, le=LAYOUT_LIMITS["num_layers"])
    num_kv_heads: JsonInt = Field(ge=1, le=LAYOUT_LIMITS["num_kv_heads"])
    head_dim: JsonInt = Field(ge=1, le=LAYOUT_LIMITS["head_dim"])
    dtype: str = Field(default="float16", pattern="^(" + "|".join(DTYPES) + ")$")
    block_tokens: JsonInt = Field(default=256, ge=1, le=LAYOUT_LIMITS["block_tokens"])


class SessionCreate(_Model):
    session_id: str = Field(
        pattern=SESSION_ID_PATTERN,
        description="1..256 characters of A-Z a-z 0-9 . _ : @ -, starting with a letter or digit",
    )
    layout: LayoutIn
    namespace: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Where the session's blocks are hashed: the caller's tenant by default, "
        "or a public namespace its token may publish into (shared prompts).",
    )
    priority: str = "normal"
    ack: Literal["memory", "archive"] | None = Field(
        default=None,
        description="When an append is answered: memory = its blocks are in device memory; "
        "archive = they are fsynced in the cold tier and survive a crash of every process. "
        "Default: the deployment's router.default_ack.",
    )
    exact_only: StrictBool = Field(
        default=False,
        description="Its blocks never take a lossy step (fp16 of fp32, int8, lossy cold codec). "
        "Blocks shared with sessions that allowed one before may still read as inexact: "
        "every block read says whether it is exact.",
    )
    finite_only: StrictBool = Field(
        default=False,
        description="Appends whose KV holds a NaN or an infinity are refused (422, naming "
        "the block). Default: stored as sent, bit for bit (such blocks never take a lossy "
        "step).",
    )


class SuspendIn(_Model):
    offline: bool = False


class MatchIn(_Model):
    layout: LayoutIn
    namespace: str | None = Field(
        default=None, pattern=NAME_PATTERN, description="Default: the caller's tenant."
    )
    token_ids: list[int]


#: Keys one by-key read may name (duplicates are collapsed first).
MAX_KEYS_PER_READ = 4096


class BlocksByKeyIn(_Model):
    namespace: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Whose blocks: the caller's tenant by default, or a public namespace "
        "its token may read. Keys of any other namespace answer 404, like missing ones.",
    )
    keys: list[Annotated[str, Field(pattern=r"^[0-9a-fA-F]{32}$")]] = Field(
        description="Block keys: 16 bytes as 32 hex digits.", max_length=MAX_KEYS_PER_READ
    )


class BlockLeaseIn(BlocksByKeyIn):
    ttl_s: float = Field(
        default=DEFAULT_TTL_S, gt=0, le=MAX_TTL_S,
        description="How long the blocks stay pinned unless the lease is given back first.",
    )


def _publisher_of(namespace: str | None) -> str | None:
    """The tenant a publisher's namespace (``public@tenant``) belongs to; None otherwise."""
    if namespace is None or PUBLISHER_SEPARATOR not in namespace:
        return None
    return namespace.partition(PUBLISHER_SEPARATOR)[2]


def _session_out(view: SessionView, session_id: str) -> dict[str, Any]:
    """A session as its tenant sees it (its own id, not the router's scoped one)."""
    out = view.as_dict()
    out["session_id"] = session_id
    out["chain"] = [k.hex() for k in view.chain]
    return out


#: A session id in a path: the one id rule, in the schema too.
SessionIdPath = Annotated[str, Path(pattern=SESSION_ID_PATTERN, max_length=MAX_SESSION_ID_LEN)]


def caller(request: Request) -> Principal:
    """The principal :class:`AuthMiddleware` put on the request."""
    principal: Principal = request.scope["state"]["principal"]
    return principal


def error_document(exc: BaseException) -> dict[str, Any]:
    """How an error is answered: ``{"type", "message", "status"}`` (HTTP and block port)."""
    # Errors raised in an actor arrive wrapped (RayTaskError subclasses the cause);
    # report the cause's own type and message, not the remote traceback.
    cause = getattr(exc, "cause", None)
    shown = cause if isinstance(cause, BaseException) else exc
    status = next((code for cls, code in _STATUS if isinstance(exc, cls)), 500)
    if isinstance(exc, PayloadTooLarge):
        status = 413
    elif isinstance(exc, BodyTimeout):
        status = 408
    if status >= 500 or shown is not exc:
        logger.warning("memkv error answered %d: %s", status, exc)
    return {"type": type(shown).__name__, "message": plain_message(shown), "status": status}


def _error_response(exc: BaseException) -> JSONResponse:
    error = error_document(exc)
    status = error["status"]
    headers = (
        {"WWW-Authenticate": "Bearer"}
        if status == 401
        else {"Retry-After": "1"}
        if status == 503
        else None
    )
    return JSONResponse(
        {"error": error},
        status_code=status,
        headers=headers,
    )


def create_app(
    router: Any | RouterShards,
    *,
    max_body_bytes: int = 1 << 30,
    same_node_reads: bool = True,
    plan_cache_bytes: int = 256 << 20,
    put_object: Callable[[Any], Any] = ray.put,
    node_id: str | None = None,
    staging: PutStaging | None = None,
    auth: Authenticator | None = None,
    body_timeout_s: float = 30.0,
    max_json_bytes: int = 16 << 20,
    max_inflight_body_bytes: int | None = None,
    client_lease_bytes: int = 1 << 30,
) -> FastAPI:
    """The gateway app for a router actor handle, or a sharded table's routers.

    Args:
        router: the SessionRouter actor, or :class:`RouterShards` (each
            session's calls go to the shard that owns it).
        auth: who may call it; None serves every caller as one trusted user
            (``memkv up`` always passes the deployment's authenticator).
        body_timeout_s: an append body that sends nothing for this long is
            answered 408 and its buffers let go.
        max_json_bytes: the body limit of every route but appends (413 beyond).
        max_inflight_body_bytes: append bodies being received at once, by their
            declared lengths (default: twice ``max_body_bytes``); beyond it an
            append is answered 503 with Retry-After before its body is read.
        A by-key block read answers at most ``max_body_bytes`` of blocks (413).
        max_body_bytes: larger append bodies are refused with 413.
        same_node_reads: serve blocks of devices on the gateway's node straight
            from their shared-memory arenas (the gateway process maps them).
        plan_cache_bytes: blocks the gateway may keep pinned under read plans
            it holds between reads (0: release each plan after its read).
        put_object: how a block is handed to the router (``ray.put``: one
            object-store object per block; tests with fakes hand the payload).
        node_id: this process's node, for same-node reads (default: Ray's).
        staging: append bodies are read into this shared-memory segment and the
            node's devices copy the blocks from there (memkv.staging);
            None sends every block through ``put_object``.
        client_lease_bytes: block bytes that clients on the gateway's host may
            keep pinned under leases (``/v1/blocks/lease``) at once.
    """
    app = FastAPI(
        title="memkv gateway",
        version="1",
        description="Session lifecycle of memkv, the KV-cache store for LLM agents.",
    )
    registry = CollectorRegistry()
    requests = Counter(
        "memkv_http_requests", "HTTP requests", ["route", "status"], registry=registry
    )
    latency = Histogram(
        "memkv_http_request_seconds",
        "Request latency (to the response head)",
        ["route"],
        registry=registry,
    )
    payload_bytes = Counter(
        "memkv_payload_bytes", "KV payload bytes", ["direction"], registry=registry
    )
    errors = Counter(
        "memkv_http_errors", "Error responses by route and error type", ["route", "type"],
        registry=registry,
    )
    routers = router if isinstance(router, RouterShards) else RouterShards([router])

    async def whole_table_stats() -> dict[str, Any]:
        return merge_stats(list(await asyncio.gather(*routers.stats())))

    snapshot = StatsSnapshot(whole_table_stats)
    inflight = BodyBudget(
        max_inflight_body_bytes if max_inflight_body_bytes is not None else 2 * max_body_bytes
    )
    sessions: _LRU[tuple[KVLayout, str, bool]] = _LRU(SESSION_CACHE_ENTRIES)
    this_node = node_id or _this_node() or ""
    # Sessions whose device is on another node: their appends skip staging.
    unstaged: _LRU[bool] = _LRU(SESSION_CACHE_ENTRIES)
    staged_bytes = Counter(
        "memkv_append_staged_bytes",
        "Appended block bytes devices copied out of the gateway's staging segment",
        registry=registry,
    )

    routes = _RouteCache(SESSION_CACHE_ENTRIES)
    touches = _Touches(routers, TOUCH_FLUSH_S)
    fetcher = BlockFetcher(
        SegmentMaps() if same_node_reads else None,
        (node_id or _this_node()) if same_node_reads else None,
        PlanCache(ttl_s=PLAN_TTL_S, margin_s=PLAN_MARGIN_S, max_bytes=plan_cache_bytes)
        if same_node_reads and plan_cache_bytes > 0
        else None,
        read_ahead=READ_AHEAD_BLOCKS,
    )
    client_leases = ClientLeases(max_bytes=client_lease_bytes)
    host_shm = shm_identity()
    devices_by_id: dict[str, Any] = {}

    async def device_named(device_id: str) -> Any | None:
        """A device's handle by id (shard 0 is asked again for one not known yet)."""
        if device_id not in devices_by_id:
            devices_by_id.update(await routers.first.devices.remote())
        return devices_by_id.get(device_id)

    # Outermost first: metrics see every request; block reads skip FastAPI's
    # dependency machinery (their hot path), every other request goes on to it.
    app.add_middleware(BlockReadFastPath)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_json_bytes)
    app.add_middleware(AuthMiddleware, auth=auth if auth is not None else Authenticator.disabled())
    app.add_middleware(MetricsMiddleware, requests=requests, latency=latency, errors=errors)

    @app.exception_handler(MemkvError)
    async def _memkv_error(request: Request, exc: MemkvError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RayActorError)
    async def _actor_unavailable(request: Request, exc: RayActorError) -> JSONResponse:
        # An actor is restarting: the router recovers it; the client may retry.
        return _unavailable(exc)

    @app.exception_handler(RayError)
    async def _ray_error(request: Request, exc: RayError) -> JSONResponse:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, MemkvError):
            return _error_response(cause)
        return _internal(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return _internal(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own (404 unknown route, 405, 400 unreadable body): one envelope too.
        kind = {404: "NotFoundError", 405: "MethodNotAllowed"}.get(exc.status_code, "HTTPError")
        return JSONResponse(
            {"error": {"type": kind, "message": str(exc.detail), "status": exc.status_code}},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            {"error": {"type": "InvalidInputError", "message": str(exc.errors()), "status": 422}},
            status_code=422,
        )

    async def _let_go_of(sid: str) -> None:
        """Release the read plans this gateway holds on a session's blocks."""
        route = routes.get_at(sid, 0)
        if route is not None:
            await fetcher.release_session(route)

    Reader = Depends(caller)

    def scoped(who: Principal, session_id: str, role: str) -> str:
        """The router's id of the caller's session (checks the role first)."""
        who.require(role)
        return scoped_session_id(who.tenant, session_id)

    # -- health ------------------------------------------------------------------------

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, Any]:
        """The gateway process is up (no token needed); ``block_port``: where its block
        port listens, when it has one (clients use it for KV bodies); ``worker``:
        which of the node's gateway processes answered (``gateway.workers``)."""
        port = getattr(app.state, "block_port", None)
        health: dict[str, Any] = {"status": "ok", "worker": getattr(app.state, "worker", 0)}
        if port is not None:
            health["block_port"] = port.stats.port
        return health

    @app.get("/readyz", tags=["health"])
    async def readyz() -> JSONResponse:
        """The router answers (the cluster can serve; no token needed)."""
        try:
            await asyncio.gather(*(r.ping.remote() for r in routers))
        except RayError as e:
            return JSONResponse({"status": "unavailable", "reason": str(e)}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/", include_in_schema=False)
    async def status_page() -> HTMLResponse:
        """The live status page: static, no data in it (its figures come from
        /v1/stats with the viewer's admin token), so it is served without one."""
        return HTMLResponse(_status_page_html())

    @app.get("/metrics", tags=["health"])
    async def metrics(request: Request) -> Response:
        """This gateway's request figures, then the cluster's (tiers, hits, prefetch, ...).

        Per-tenant series (sessions and bytes by tenant) only for a token with the
        ``metrics`` or ``admin`` role: the open endpoint names no tenant."""
        who = request.scope.get("state", {}).get("principal")
        tenants = who is not None and who.sees_tenants
        body = generate_latest(registry)
        try:
            body += engine_metrics(await snapshot.get(), tenants=tenants)
        except RayError as e:  # the gateway's own figures still go out
            logger.warning("no cluster figures for /metrics: %s", e)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # -- sessions ------------------------------------------------------------------------

    @app.post("/v1/sessions", status_code=201, tags=["sessions"])
    async def create_session(body: SessionCreate, who: Principal = Reader) -> dict[str, Any]:
        sid = scoped(who, body.session_id, "write")
        namespace = who.write_namespace(body.namespace)
        layout = KVLayout.from_dict(body.layout.model_dump())
        request = CreateSession(
            session_id=sid, layout=LayoutSpec.of(layout), namespace=namespace,
            priority=parse_priority(body.priority),
            ack=parse_ack(body.ack),
            quota=Quota.of(who.quota), exact_only=body.exact_only, finite_only=body.finite_only,
        )
        return _session_out(await routers.service(sid).create_session(request), body.session_id)

    @app.get("/v1/sessions/{session_id}", tags=["sessions"])
    async def get_session(session_id: SessionIdPath, who: Principal = Reader) -> dict[str, Any]:
        sid = scoped(who, session_id, "read")
        return _session_out(await routers.service(sid).session(sid), session_id)

    @app.delete("/v1/sessions/{session_id}", status_code=204, tags=["sessions"])
    async def delete_session(session_id: SessionIdPath, who: Principal = Reader) -> Response:
        sid = scoped(who, session_id, "write")
        await _let_go_of(sid)
        sessions.drop(sid)
        routes.drop(sid)
        await routers.service(sid).delete_session(sid)
        return Response(status_code=204)

    @app.post("/v1/sessions/{session_id}/suspend", tags=["sessions"])
    async def suspend(
        session_id: SessionIdPath, body: SuspendIn | None = None, who: Principal = Reader
    ) -> dict[str, Any]:
        sid = scoped(who, session_id, "write")
        offline = body.offline if body is not None else False
        await _let_go_of(sid)
        return _session_out(await routers.service(sid).suspend(sid, offline), session_id)

    @app.post("/v1/sessions/{session_id}/resume", tags=["sessions"])
    async def resume(session_id: SessionIdPath, who: Principal = Reader) -> dict[str, Any]:
        sid = scoped(who, session_id, "write")
        resumed = await routers.service(sid).resume(sid)
        return {
            "session_id": session_id,
            "device_id": resumed.device_id,
            "tokens": resumed.tokens,
            "blocks": [
                {"key": b.key.hex(), "tier": b.tier.value, "tokens": b.tokens}
                for b in resumed.blocks
            ],
        }

    @app.post("/v1/sessions/{session_id}/input-end", tags=["sessions"])
    async def input_end(session_id: SessionIdPath, who: Principal = Reader) -> dict[str, int]:
        """A turn's input is complete: prefetch the session's cache now.

        Needs the ``write`` role: the prefetch moves blocks between tiers and may
        evict other sessions' blocks to make room (a read-only token only reads)."""
        sid = scoped(who, session_id, "write")
        return {"prefetched": int(await routers.of(sid).notify_input_end.remote(sid))}

    # -- KV data -----------------------------------------------------------------------

    @app.post(
        "/v1/sessions/{session_id}/turns",
        tags=["kv"],
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {FRAMES_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
            }
        },
    )
    async def append_turn(
        session_id: SessionIdPath, request: Request, who: Principal = Reader
    ) -> dict[str, Any]:
        """Append a turn: a ``turn`` frame then its ``block`` frames (docs/wire-format.md).

        Idempotent by the turn index: a retry of the last turn with the same
        tokens answers as before (``replayed``) and stores nothing.
        """
        declared = request.headers.get("content-length")

        def read(allocate: Callable[[int], memoryview | None] | None,
                 hold: BodyHold) -> Awaitable[list[Frame]]:
            return _read_frames(request, max_body_bytes, body_timeout_s, allocate=allocate,
                                hold=hold)

        return await receive_append(
            who, session_id, int(declared) if declared and declared.isdigit() else None, read
        )

    async def receive_append(
        who: Principal,
        session_id: str,
        declared: int | None,
        read: Callable[[Callable[[int], memoryview | None] | None, BodyHold],
                       Awaitable[list[Frame]]],
    ) -> dict[str, Any]:
        """An append whose body ``read`` receives: into staging where it can, under the
        in-flight budget, stored only once every frame is in and checked.

        Both the HTTP route and the block port (memkv.api.block_port) come here.
        ``declared``: the body's announced size (None: unknown, the limit is held).
        """
        sid = scoped(who, session_id, "write")
        slot = None
        if staging is not None and unstaged.get(sid) is None and declared:
            slot = staging.lease(min(declared, max_body_bytes))
        try:
            size = min(declared if declared is not None else max_body_bytes, max_body_bytes)
            async with inflight.hold(who.tenant or "", size) as hold:
                frames = await read(slot.take if slot is not None else None, hold)
            return await _append(sid, session_id, frames, slot, who)
        finally:
            if slot is not None:
                # A device may still be copying out of the slot (the client went away
                # mid-call): free it only once that call has answered.
                pending = slot.in_flight
                if pending is None:
                    slot.release()
                else:
                    _background(_release_after(pending, slot))

    async def _append(
        sid: str, session_id: str, frames: list[Frame], slot: StagingSlot | None,
        who: Principal,
    ) -> dict[str, Any]:
        if not frames or frames[0].kind != "turn":
            raise WireError("an append body starts with a 'turn' frame")
        head = frames[0].header
        known = sessions.get(sid)
        if known is None:
            view = await routers.service(sid).session(sid)
            known = (view.layout.layout(), view.namespace, view.finite_only)
            sessions.put(sid, known)
        layout, namespace, finite_only = known
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
        checksums = []
        for i, frame in enumerate(blocks, start=start):
            key, dtype, array = block_payload(frame)
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
            checksums.append(int(frame.header["crc32"]))
            payload_bytes.labels("in").inc(array.nbytes)

        request = AppendTurn(
            session_id=sid, token_ids=AppendTurn.pack_tokens(tokens), start_block=start,
            chain=tuple(bytes(k) for k in chain), turn=turn, checksums=tuple(checksums),
            expect=Expected(layout=LayoutSpec.of(layout), namespace=namespace),
            quota=Quota.of(who.quota),
        )

        def put(blocks: list[Any]) -> Pending[AppendAnswer]:
            return routers.service(sid).put_blocks(request, blocks)

        try:
            staged = (staging.describe(payloads, this_node)
                      if slot is not None and staging is not None and payloads else None)
            if staged is None:
                result = await put([put_object(p) for p in payloads])
            else:
                assert slot is not None
                slot.in_flight = put(staged)
                try:
                    result = await slot.in_flight
                    staged_bytes.inc(sum(p.nbytes for p in payloads))
                except WrongNodeError:
                    # The session's device is on another node: by value from now on.
                    unstaged.put(sid, True)
                    result = await put([put_object(p) for p in payloads])
                finally:
                    slot.in_flight = None
        except (NotFoundError, ConflictError):
            sessions.drop(sid)  # the session went, or was created again
            raise
        finally:
            routes.drop(sid)
        out = result.as_dict()
        out["chain"] = [k.hex() for k in result.chain]
        return out

    @app.get(
        "/v1/sessions/{session_id}/blocks",
        tags=["kv"],
        response_class=BlockFramesResponse,
        status_code=200,
        responses={200: {"content": {FRAMES_MEDIA_TYPE: {"schema": _BINARY}}}},
    )
    async def read_blocks(
        session_id: SessionIdPath,
        start: int = Query(default=0, ge=0),
        end: int | None = Query(default=None, ge=0),
        who: Principal = Reader,
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
        return await session_blocks(who, session_id, start, end, turn)

    async def session_blocks(
        who: Principal, session_id: str, start: int, end: int | None, turn: int | None
    ) -> BlockFramesResponse:
        sid = scoped(who, session_id, "read")

        async def opened(whole: ReadRoute) -> BlockFramesResponse:
            route = whole.sliced(start, end)
            response = BlockFramesResponse(
                KVLayout.from_dict(route.layout),
                route.keys,
                route.tokens,
                route.first_index,
                # Leases are released after the last byte, without holding up
                # the connection's next request (a release is a device call).
                fetcher.fetch(
                    route.device_id,
                    route.device,
                    route.keys,
                    sid,
                    whole.keys[start + len(route.keys) :],
                ),
                on_block=payload_bytes.labels("out").inc,
            )
            await response.prime()
            return response

        cached = routes.get_at(sid, turn)
        if cached is not None:
            try:
                response = await opened(cached)
            except (MemkvError, RayError):
                routes.drop(sid)  # moved or lost: ask the router below
            else:
                touches.add(sid)  # hotness, told to the router in batches
                return response
        owner = routers.of(sid)
        whole = await owner.read_route.remote(sid, 0, None)
        try:
            response = await opened(whole)
        except NotFoundError:
            if not whole.keys:
                raise
            # Blocks of the route missing on its device: it may have restarted
            # since the router last looked. Have it check, then ask again.
            await owner.device_failed.remote(whole.device_id)
            whole = await owner.read_route.remote(sid, 0, None)
            response = await opened(whole)
        routes.put(sid, whole)
        return response

    app.state.session_blocks = session_blocks
    app.state.receive_append = receive_append
    app.state.authenticator = auth if auth is not None else Authenticator.disabled()
    app.state.limits = {"max_body_bytes": max_body_bytes, "body_timeout_s": body_timeout_s}
    app.state.payload_bytes = payload_bytes
    app.state.release_plans = fetcher.release_all
    app.state.client_leases = client_leases
    app.state.blocks_by_key = lambda body, who: read_blocks_by_key(body, who)
    app.openapi = lambda: _openapi_with_errors(app)  # type: ignore[method-assign]

    @app.post(
        "/v1/blocks/read",
        tags=["kv"],
        response_class=BlockFramesResponse,
        status_code=200,
        responses={200: {"content": {FRAMES_MEDIA_TYPE: {"schema": _BINARY}}}},
    )
    async def read_blocks_by_key(body: BlocksByKeyIn, who: Principal = Reader) -> Response:
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
            list(await asyncio.gather(*routers.locate_blocks(keys, namespaces)))
        )
        if len(groups) == 1:
            # One device holds them all (the usual case: a prefix lives where its
            # sessions do): stream them the way session reads go, through read
            # plans from shared memory, pipelined, in the order asked.
            device_id, device, group = groups[0]
            return await _streamed_by_key(device_id, device, list(group))
        found: dict[bytes, BlockPayload] = {}
        total = 0
        for _, device, group in groups:
            for payload in await device.get_blocks.remote(group):
                found[payload.key] = payload
                total += payload.nbytes
            if total > max_body_bytes:
                raise PayloadTooLarge(
                    f"these blocks are over {max_body_bytes} bytes: ask for fewer at a time"
                )

        async def stream() -> AsyncIterator[bytes | memoryview]:
            for i, key in enumerate(keys):
                for chunk in _block_chunks(i, found[key]):
                    yield chunk
                payload_bytes.labels("out").inc(found[key].nbytes)
            yield end_frame(len(keys))

        return StreamingResponse(stream(), media_type=FRAMES_MEDIA_TYPE)

    async def _streamed_by_key(
        device_id: str, device: Any, keys: list[bytes]
    ) -> StreamingResponse:
        blocks = fetcher.fetch(device_id, device, keys, None)
        # The first block before the head goes out, so its errors get a status code.
        first = await blocks.__anext__()

        async def stream() -> AsyncIterator[bytes | memoryview]:
            total = 0
            block: FetchedBytes | None = first
            for i, key in enumerate(keys):
                if block is None:
                    block = await blocks.__anext__()
                if block.key != key:
                    raise CorruptDataError(f"asked for block {key.hex()}, got {block.key.hex()}")
                total += block.data.nbytes
                if total > max_body_bytes:
                    raise PayloadTooLarge(
                        f"these blocks are over {max_body_bytes} bytes: ask for fewer at a time"
                    )
                template = BlockFrameTemplate(
                    index=i, key=key, dtype=block.dtype, shape=block.shape,
                    nbytes=block.data.nbytes,
                )
                yield bytes(template.fill(tier=block.tier, exact=block.exact, crc=block.crc,
                                          lossy=block.lossy))
                yield block.data
                payload_bytes.labels("out").inc(block.data.nbytes)
                block = None
            yield end_frame(len(keys))
            close = getattr(blocks, "aclose", None)  # an async generator: its leases go back
            if close is not None:
                await close()

        return StreamingResponse(stream(), media_type=FRAMES_MEDIA_TYPE)

    @app.post("/v1/blocks/lease", tags=["kv"])
    async def lease_blocks(body: BlockLeaseIn, who: Principal = Reader) -> dict[str, Any]:
        """Where blocks sit in this host's shared memory, pinned under leases (same host only).

        For a client on the gateway's host (its ``host`` equals the client's
        :func:`memkv.same_node.shm_identity`): it maps each block's segment,
        copies ``nbytes`` from ``offset``, checks ``crc32``, and gives each
        lease back with ``DELETE /v1/blocks/lease/{id}`` (or lets it run out at
        ``expires_at``, on the host's monotonic clock). A block answered
        ``null`` is not in shared memory here (another node, same-node reads
        off, the lease bound reached): read it with ``/v1/blocks/read``.
        Keys the token may not read answer 404, like missing ones.
        """
        who.require("read")
        namespaces = who.read_namespaces(body.namespace)
        try:
            keys = list(dict.fromkeys(bytes.fromhex(k) for k in body.keys))
        except ValueError as e:
            raise InvalidInputError(f"keys must be hex strings: {e}") from e
        if not namespaces:
            raise UnknownBlockError("no block of a trusted publisher has these keys")
        groups = merge_located(
            list(await asyncio.gather(*routers.locate_blocks(keys, namespaces)))
        )
        planned: dict[bytes, dict[str, Any]] = {}
        leases: list[dict[str, Any]] = []
        for device_id, device, group in groups if same_node_reads and this_node else []:
            plan = await device.read_plan.remote(list(group), None, body.ttl_s, (), who.tenant)
            nbytes = sum(e.nbytes for e in plan.entries if e is not None)
            if not plan.same_node or plan.node_id != this_node or not plan.lease_id:
                if plan.lease_id:
                    device.release_lease.remote(plan.lease_id, who.tenant)
                continue
            if nbytes > client_leases.room():
                client_leases.refused_over_budget += 1
                device.release_lease.remote(plan.lease_id, who.tenant)
                continue
            public_id = client_leases.add(who.tenant, device, plan, body.ttl_s)
            for entry in plan.entries:
                if entry is not None:
                    planned[entry.key] = plan_entry_json(entry, len(leases))
            leases.append({
                "id": public_id, "device_id": device_id,
                "incarnation": plan.incarnation, "expires_at": plan.expires_at,
            })
        return {
            "host": host_shm,
            "leases": leases,
            "blocks": [planned.get(k) for k in keys],
        }

    @app.delete("/v1/blocks/lease/{lease_id}", status_code=204, tags=["kv"])
    async def release_block_lease(
        lease_id: Annotated[str, Path(max_length=256)], who: Principal = Reader
    ) -> Response:
        """Give a lease back (through any gateway worker): its blocks may move again.
        Unknown, run out, or another tenant's: 404."""
        parsed = parse_lease_id(lease_id)
        device = client_leases.take(who.tenant, lease_id)
        if device is None and parsed is not None:
            # Granted by another worker (or replica): the id names the device.
            device = await device_named(parsed[1])
        if parsed is None or device is None or not await device.release_lease.remote(
            parsed[0], who.tenant
        ):
            raise UnknownBlockError(f"no live lease {lease_id!r} of this caller")
        return Response(status_code=204)

    @app.post("/v1/match", tags=["kv"])
    async def match(body: MatchIn, who: Principal = Reader) -> dict[str, Any]:
        """How many leading tokens are already cached (any session of the namespace:
        the caller's tenant by default, or a public one its token may read)."""
        who.require("read")
        layout = KVLayout.from_dict(body.layout.model_dump())
        token_array(body.token_ids)  # validate before asking the router
        # In a public namespace, each trusted publisher's blocks apart: the longest
        # prefix wins, the earlier publisher in the token's trust on a tie.
        best: dict[str, Any] = {"tokens": 0, "blocks": []}
        for namespace in who.read_namespaces(body.namespace):
            found = merge_prefix(list(await asyncio.gather(
                *routers.match_prefix(layout.to_dict(), namespace, body.token_ids))))
            if found["tokens"] > best["tokens"]:
                best = {**found, "namespace": namespace}
        return {"tokens": best["tokens"], "blocks": [bytes(k).hex() for k in best["blocks"]],
                "publisher": _publisher_of(best.get("namespace"))}

    @app.get("/v1/stats", tags=["cluster"])
    async def stats(who: Principal = Reader) -> dict[str, Any]:
        """Cluster-wide figures (every tenant's): the admin role only. The cluster part is
        a snapshot at most 2 s old, shared with /metrics and the status page."""
        who.require("admin")
        out = dict(await snapshot.get())
        # This gateway's own read paths: how many blocks it served from shared
        # memory and how many in-cluster, and leases that ran out mid-write.
        out["gateway"] = {
            "worker": getattr(app.state, "worker", 0),  # of gateway.workers: only its own figures
            "plan_cache": fetcher.plan_stats(),
            "client_leases": client_leases.stats(),
            "same_node_blocks": fetcher.same_node_blocks,
            "in_cluster_blocks": fetcher.in_cluster_blocks,
            "leases_lost": fetcher.leases_lost,
            # Appends: bytes devices copied out of the staging segment (the rest went
            # through the object store), and the segment's size (0: no staging).
            "staged_bytes": int(staged_bytes._value.get()),
            "staging_bytes": staging.capacity_bytes if staging is not None else 0,
            "http": _route_figures(requests, latency),
        }
        port = getattr(app.state, "block_port", None)
        if port is not None:
            out["gateway"]["block_port"] = port.stats.as_dict()
        return out

    return app


#: What each status of the error envelope means, for the OpenAPI document.
_ERROR_DOCS = {
    401: "No valid bearer token.",
    403: "The token may not do this (role or namespace).",
    404: "No such session or block (another tenant's answers the same).",
    408: "The request body stalled.",
    409: "Conflict with the session's state: the id is taken, a turn is out of order, the "
         "layout differs, the session has no blocks yet.",
    410: "The session's blocks are lost (its device restarted before they were archived).",
    413: "The body is larger than the gateway accepts.",
    422: "Invalid input (the message names what was expected).",
    500: "Internal error (logged by the gateway, never detailed here).",
    503: "A memkv service is restarting or recovering: retry after Retry-After seconds.",
    507: "Over a tenant's quota or a tier's capacity: nothing was stored.",
}
#: Errors every authenticated route may answer, and those of particular routes.
_COMMON_ERRORS = (401, 403, 422, 500, 503)
_ROUTE_ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/sessions"): (409, 507),
    ("get", "/v1/sessions/{session_id}"): (404, 410),
    ("delete", "/v1/sessions/{session_id}"): (404,),
    ("post", "/v1/sessions/{session_id}/suspend"): (404, 409, 410),
    ("post", "/v1/sessions/{session_id}/resume"): (404, 409, 410),
    ("post", "/v1/sessions/{session_id}/input-end"): (404, 409, 410),
    ("post", "/v1/sessions/{session_id}/turns"): (404, 408, 409, 410, 413, 507),
    ("get", "/v1/sessions/{session_id}/blocks"): (404, 410),
    ("post", "/v1/blocks/read"): (404, 410),
    ("post", "/v1/blocks/lease"): (404, 410),
    ("delete", "/v1/blocks/lease/{lease_id}"): (404,),
    ("post", "/v1/match"): (),
    ("get", "/v1/stats"): (),
}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "message", "status"],
            "properties": {
                "type": {"type": "string"},
                "message": {"type": "string"},
                "status": {"type": "integer"},
            },
        }
    },
}


def _openapi_with_errors(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with every status a route may answer and its media types."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = _ERROR_SCHEMA
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for (method, path), extra in _ROUTE_ERRORS.items():
        responses = schema["paths"][path][method]["responses"]
        for code in (*_COMMON_ERRORS, *extra):
            responses[str(code)] = {"description": _ERROR_DOCS[code], "content": error}
    health = schema["paths"]
    health["/metrics"]["get"]["responses"]["200"]["content"] = {
        CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}
    }
    health["/metrics"]["get"]["responses"]["401"] = {
        "description": _ERROR_DOCS[401],
        "content": error,
    }
    health["/readyz"]["get"]["responses"]["503"] = {
        "description": "The router does not answer.",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
    app.openapi_schema = schema
    return schema


#: How long the gateway's held read plans pin their blocks, how long before the
#: end of that it stops using one (longer than a response takes), and how many
#: blocks one device call plans (those asked for, then the ones that follow).
PLAN_TTL_S = 10.0
PLAN_MARGIN_S = 3.0
READ_AHEAD_BLOCKS = 8

#: Layouts and namespaces of recently written sessions (immutable while a session
#: lives), so an append costs one router call, not two.
SESSION_CACHE_ENTRIES = 65536


_V = TypeVar("_V")


class _LRU(Generic[_V]):
    """A bounded least-recently-used map of session id to ``_V``."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[str, _V] = OrderedDict()

    def get(self, session_id: str) -> _V | None:
        entry = self._entries.get(session_id)
        if entry is not None:
            self._entries.move_to_end(session_id)
        return entry

    def put(self, session_id: str, entry: _V) -> None:
        self._entries[session_id] = entry
        self._entries.move_to_end(session_id)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def drop(self, session_id: str) -> None:
        self._entries.pop(session_id, None)


class _RouteCache(_LRU[ReadRoute]):
    """Whole-session read routes by session id, used for reads that name a turn they know.

    A read that says "I have seen turn N" is served from a route at turn N or
    later without a router call; a reader that names no turn always gets the
    router's answer. Writes and deletes through this gateway drop the entry.
    """

    def get_at(self, session_id: str, turn: int | None) -> ReadRoute | None:
        if turn is None:
            return None
        route = self.get(session_id)
        return route if route is not None and route.turn >= turn else None


#: Reads served from the gateway's own routes are told to the router (session
#: hotness) in one call per this many seconds, not one per read.
TOUCH_FLUSH_S = 0.5


class _Touches:
    """Session ids read since the last flush; flushed by a task the first add starts."""

    def __init__(self, routers: RouterShards, interval_s: float) -> None:
        self._routers = routers
        self._interval_s = interval_s
        self._pending: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def add(self, session_id: str) -> None:
        self._pending.add(session_id)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(self._interval_s)
        pending, self._pending = self._pending, set()
        if pending:
            await asyncio.gather(*self._routers.touch_sessions(sorted(pending)))


_background_tasks: set[asyncio.Task[Any]] = set()


def _background(coro: Any) -> None:
    """Run ``coro`` to its end without a waiter (the loop keeps only weak references)."""
    task = asyncio.ensure_future(coro)
    _background_tasks.add(task)
    task.add_done_callback(_background_tasks.discard)


async def _release_after(call: Any, slot: StagingSlot) -> None:
    """Free a staging slot once the device call that reads it has answered, however."""
    try:
        await call
    except Exception:  # noqa: BLE001, S110 - its caller has gone; only the slot matters now
        pass
    finally:
        slot.release()


def _this_node() -> str | None:
    return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else None


_BLOCKS_PATH = re.compile(r"^/v1/sessions/([^/]+)/blocks$")
_BLOCKS_ROUTE = SimpleNamespace(path="/v1/sessions/{session_id}/blocks")
_READ_PARAMS = frozenset({"start", "end", "turn"})


class BlockReadFastPath:
    """``GET /v1/sessions/{id}/blocks`` as plain ASGI, ahead of FastAPI's routing.

    The route's work is a cache lookup and a response object; FastAPI's
    dependency solving and validation around it cost as much again here. A
    query string this parser does not take as it is (anything but the three
    non-negative int parameters) goes on to the FastAPI route, which answers
    it, errors included, exactly as documented.
    """

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "GET":
            await self._app(scope, receive, send)
            return
        match = _BLOCKS_PATH.match(scope["path"])
        params = _read_params(scope.get("query_string", b"")) if match else None
        if match is None or params is None:
            await self._app(scope, receive, send)
            return
        scope["route"] = _BLOCKS_ROUTE  # for the metrics' route label
        try:
            fastapi_app = scope["app"]
            who = scope["state"]["principal"]
            response = await fastapi_app.state.session_blocks(who, match.group(1), *params)
        except MemkvError as e:
            response = _error_response(e)
        except RayActorError as e:
            response = _unavailable(e)
        except RayError as e:
            cause = getattr(e, "cause", None)
            response = _error_response(cause) if isinstance(cause, MemkvError) else _internal(e)
        await response(scope, receive, send)


def _read_params(query: bytes) -> tuple[int, int | None, int | None] | None:
    """``(start, end, turn)`` of a plain query string, or None to leave it to FastAPI."""
    values: dict[str, int] = {}
    for part in query.decode("latin-1").split("&") if query else ():
        name, sep, raw = part.partition("=")
        if not sep or name not in _READ_PARAMS or name in values or not raw.isdigit():
            return None
        values[name] = int(raw)
    return values.get("start", 0), values.get("end"), values.get("turn")


_RESTARTING = {"type": "ClosedError", "message": "a memkv service is restarting; retry shortly",
               "status": 503}
_INTERNAL = {"type": "InternalError", "message": "internal error", "status": 500}


def any_error_document(exc: BaseException) -> dict[str, Any]:
    """:func:`error_document` of any exception, as the HTTP exception handlers answer it
    (the block port answers with this)."""
    if isinstance(exc, RayActorError):
        logger.warning("a memkv actor is unavailable: %s", exc)
        return dict(_RESTARTING)
    cause = getattr(exc, "cause", None)
    if isinstance(exc, RayError) and isinstance(cause, MemkvError):
        return error_document(cause)
    if isinstance(exc, MemkvError):
        return error_document(exc)
    logger.error("unexpected error in the gateway", exc_info=exc)
    return dict(_INTERNAL)


def _unavailable(exc: BaseException) -> JSONResponse:
    # Ray's message names actor ids, pids and addresses: the log gets it, the client not.
    logger.warning("a memkv actor is unavailable: %s", exc)
    return JSONResponse({"error": _RESTARTING}, status_code=503, headers={"Retry-After": "1"})


def _internal(exc: BaseException) -> JSONResponse:
    # A bug, or an error of a library under us: logged with its traceback, never
    # shown (it may carry paths, pids, actor ids).
    logger.error("unexpected error in the gateway", exc_info=exc)
    return JSONResponse({"error": _INTERNAL}, status_code=500)


class BodyLimitMiddleware:
    """Caps the body of every request but appends (which have their own limit): pure ASGI.

    A declared Content-Length over the cap is answered 413 before a byte is
    read; a body streamed without one is cut off with 413 once it passes the cap.
    """

    def __init__(self, app: Any, *, max_bytes: int) -> None:
        self._app = app
        self._max = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].endswith("/turns"):
            await self._app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self._max:
                too_big = PayloadTooLarge(
                    f"body of {int(value)} bytes exceeds the limit of {self._max} for this route"
                )
                await _error_response(too_big)(scope, receive, send)
                return
        # JSON bodies are small: take the whole body first (so one over the cap
        # is answered 413 by us, not half-parsed by the route), then replay it.
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self._app(scope, _replay([], message), send)
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self._max:
                too_big = PayloadTooLarge(f"body exceeds the limit of {self._max} for this route")
                await _error_response(too_big)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self._app(scope, _replay(chunks, None), send)


def _replay(chunks: list[bytes], then: Any) -> Callable[[], Any]:
    """An ASGI ``receive`` that hands over a body already read, then waits as the real one."""
    body = b"".join(chunks)
    sent = False

    async def receive() -> Any:
        nonlocal sent
        if then is not None:
            return then
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # nothing more will come; the app stops asking
        return {"type": "http.disconnect"}

    return receive


class AuthMiddleware:
    """Resolves the bearer token of every request but the open ones: pure ASGI.

    The principal goes on the scope (``scope["state"]["principal"]``) for the
    routes and the block-read fast path; a request without a valid token is
    answered 401 before any route runs.
    """

    def __init__(self, app: Any, *, auth: Authenticator) -> None:
        self._app = app
        self._auth = auth

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if not self._auth.enabled:
            scope.setdefault("state", {})["principal"] = Principal.trusted()
            await self._app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        if self._auth.is_open(scope["path"]):
            # Health probes (and docs, metrics): no token needed; a valid one still
            # names its caller (a metrics token's scrape gets per-tenant series).
            if header is not None:
                with contextlib.suppress(UnauthorizedError):
                    scope.setdefault("state", {})["principal"] = self._auth.authenticate(header)
            await self._app(scope, receive, send)
            return
        try:
            principal = self._auth.authenticate(header)
        except UnauthorizedError as e:
            await _error_response(e)(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal
        await self._app(scope, receive, send)


class MetricsMiddleware:
    """Counts requests by route and status and times them: pure ASGI.

    Starlette's ``@app.middleware("http")`` wraps every body in an extra
    stream; a no-op one cut a 4 MiB PUT from 1.35 to 0.42 GB/s here.
    """

    def __init__(
        self, app: Any, *, requests: Counter, latency: Histogram, errors: Counter | None = None
    ) -> None:
        self._app = app
        self._requests = requests
        self._latency = latency
        self._errors = errors

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_note(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                # Latency to the response head (a block stream goes on after it).
                route = getattr(scope.get("route"), "path", "unmatched")
                self._latency.labels(route).observe(time.perf_counter() - start)
            elif message["type"] == "http.response.body" and status >= 400 and self._errors:
                route = getattr(scope.get("route"), "path", "unmatched")
                self._errors.labels(route, _error_type(message.get("body", b""))).inc()
            await send(message)

        try:
            await self._app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self._requests.labels(route, str(status)).inc()


@functools.cache
def _status_page_html() -> str:
    return (importlib.resources.files("memkv.api") / "status_page.html").read_text()


def _error_type(body: bytes) -> str:
    """The ``type`` of an error envelope (one of memkv's error classes), else "other"."""
    try:
        kind = json.loads(body)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return "other"
    return kind if isinstance(kind, str) and kind.isidentifier() and len(kind) < 64 else "other"


def _route_figures(requests: Counter, latency: Histogram) -> dict[str, dict[str, float]]:
    """Per route: requests, errors (4xx/5xx) and the latency sum, since start (the status
    page turns successive polls into rates and mean latencies)."""
    out: dict[str, dict[str, float]] = {}
    for metric in requests.collect():
        for sample in metric.samples:
            if not sample.name.endswith("_total"):
                continue
            route = out.setdefault(sample.labels["route"], {"requests": 0, "errors": 0,
                                                            "latency_sum_s": 0.0})
            route["requests"] += sample.value
            if int(sample.labels["status"]) >= 400:
                route["errors"] += sample.value
    for metric in latency.collect():
        for sample in metric.samples:
            if sample.name.endswith("_sum") and sample.labels["route"] in out:
                out[sample.labels["route"]]["latency_sum_s"] += sample.value
    return out


def _tokens(head: dict[str, Any]) -> np.ndarray:
    raw = head.get("tokens")
    if isinstance(raw, bytes):
        if len(raw) % 8:
            raise WireError("'tokens' must be int64 little-endian bytes (a multiple of 8)")
        return token_array(np.frombuffer(raw, dtype="<i8"))
    if isinstance(raw, list):
        return token_array(raw)
    raise WireError("the turn frame needs 'tokens': int64 little-endian bytes or a list of ints")


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


class BodyTimeout(InvalidInputError):
    """A request body stalled (no bytes for the gateway's body timeout)."""


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
                    f"the request body was dropped: it stalled while the gateway was full "
                    f"({total} bytes received)"
                ) from None
            raise BodyTimeout(
                f"the request body stalled: no bytes for {idle_timeout_s:g} s "
                f"({total} bytes received)"
            ) from None
        total += len(chunk)
        if hold is not None:
            hold.progress()
        if total > max_body_bytes:
            raise PayloadTooLarge(f"body exceeds the limit of {max_body_bytes} bytes")
        frames.extend(reader.feed(chunk))
    reader.close()
    return frames
