"""The HTTP gateway: FastAPI routes over the router and device actors.

Session lifecycle under ``/v1``; KV payloads travel as binary frame bodies
(:mod:`memkv.protocol.wire`, docs/wire-format.md), never pickle. Reads stream: a
resume's first block is on the wire before its last is promoted. Errors are
JSON ``{"error": {"type": ..., "message": ...}}`` with a status chosen from
memkv's exception hierarchy (:mod:`memkv.api.errors`: only the gateway maps
exceptions to HTTP).

This module puts one gateway together: its shared state
(:class:`~memkv.api.context.Gateway`), the pure-ASGI layers
(:mod:`memkv.api.middleware`) and the routes, one module per resource
(:mod:`memkv.api.routes`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any

import ray
from fastapi import FastAPI

from memkv.actors.router_shards import RouterShards, merge_stats
from memkv.api.auth import Authenticator
from memkv.api.blocks import READ_HOLD_S, BlockFetcher, PlanCache
from memkv.api.body_budget import BodyBudget
from memkv.api.client_leases import ClientLeases
from memkv.api.context import (
    PLAN_MARGIN_S,
    PLAN_USE_S,
    READ_AHEAD_BLOCKS,
    Gateway,
    GatewayMetrics,
    this_node_id,
)
from memkv.api.engines.book import EngineBook, LocalBook
from memkv.api.engines.front_door import (
    EngineSpec,
    FrontDoor,
    FrontDoorOptions,
    RoutingMetrics,
)
from memkv.api.errors import install_error_handlers, openapi_with_errors
from memkv.api.frame_responses import FRAMES_MEDIA_TYPE
from memkv.api.guarded_send import DEFAULT_STALL_S, LEASE_SAFETY_S
from memkv.api.middleware import (
    AuthMiddleware,
    BlockReadFastPath,
    BodyLimitMiddleware,
    MetricsMiddleware,
)
from memkv.api.observe import StatsSnapshot
from memkv.api.routes import (
    appends,
    cluster,
    health,
    leases,
    openai,
    reads,
    responses,
    sessions,
)
from memkv.protocol.stats import ClusterStats
from memkv.shm.same_node import SegmentMaps
from memkv.shm.staging import PutStaging

__all__ = ["FRAMES_MEDIA_TYPE", "create_app"]


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
    read_stall_s: float = DEFAULT_STALL_S,
    read_hold_s: float = READ_HOLD_S,
    max_json_bytes: int = 16 << 20,
    max_inflight_body_bytes: int | None = None,
    client_lease_bytes: int = 1 << 30,
    engines: Sequence[EngineSpec] = (),
    routing: FrontDoorOptions | None = None,
    engine_book: EngineBook | None = None,
) -> FastAPI:
    """The gateway app for a router actor handle, or a sharded table's routers.

    Args:
        router: the SessionRouter actor, or :class:`RouterShards` (each
            session's calls go to the shard that owns it).
        auth: who may call it; None serves every caller as one trusted user
            (``memkv up`` always passes the deployment's authenticator).
        body_timeout_s: an append body that sends nothing for this long is
            answered 408 and its buffers let go.
        read_stall_s: a reader that takes no bytes of a block read for this long has
            its connection aborted (bytes in shared memory never outlive their pin;
            memkv.api.guarded_send).
        read_hold_s: how long a block read pins every block it announced.
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
            node's devices copy the blocks from there (memkv.shm.staging);
            None sends every block through ``put_object``.
        client_lease_bytes: block bytes that clients on the gateway's host may
            keep pinned under leases (``/v1/blocks/lease``) at once.
        engines: engines the OpenAI front door routes to (more register at
            ``/v1/engines``).
        routing: how it chooses and checks them (spill bounds, check interval).
        engine_book: where engine registrations are shared with the deployment's other
            gateway processes (default: this process's own).
    """
    app = FastAPI(
        title="memkv gateway",
        version="1",
        description="Session lifecycle of memkv, the KV-cache store for LLM agents.",
    )
    routers = router if isinstance(router, RouterShards) else RouterShards([router])

    async def whole_table_stats() -> ClusterStats:
        return merge_stats(list(await asyncio.gather(*routers.stats())))

    this_node = node_id or this_node_id() or ""
    metrics = GatewayMetrics.create()
    gw = Gateway(
        routers=routers,
        metrics=metrics,
        fetcher=BlockFetcher(
            SegmentMaps() if same_node_reads else None,
            (node_id or this_node_id()) if same_node_reads else None,
            # A held plan is used while its lease outlasts a stalled reader's bound.
            PlanCache(ttl_s=PLAN_USE_S + read_stall_s + LEASE_SAFETY_S + PLAN_MARGIN_S,
                      margin_s=read_stall_s + LEASE_SAFETY_S + PLAN_MARGIN_S,
                      max_bytes=plan_cache_bytes)
            if same_node_reads and plan_cache_bytes > 0
            else None,
            read_ahead=READ_AHEAD_BLOCKS,
            hold_s=read_hold_s,
        ),
        client_leases=ClientLeases(max_bytes=client_lease_bytes),
        staging=staging,
        put_object=put_object,
        this_node=this_node,
        same_node_reads=same_node_reads,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        read_stall_s=read_stall_s,
        inflight=BodyBudget(
            max_inflight_body_bytes if max_inflight_body_bytes is not None
            else 2 * max_body_bytes
        ),
        snapshot=StatsSnapshot(whole_table_stats),
        door=FrontDoor(RoutingMetrics.create(metrics.registry),
                       options=routing or FrontDoorOptions(), configured=list(engines),
                       book=engine_book if engine_book is not None else LocalBook()),
    )
    authenticator = auth if auth is not None else Authenticator.disabled()

    # Outermost first: metrics see every request; block reads skip FastAPI's
    # dependency machinery (their hot path), every other request goes on to it.
    app.add_middleware(BlockReadFastPath)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_json_bytes)
    app.add_middleware(AuthMiddleware, auth=authenticator)
    app.add_middleware(MetricsMiddleware, requests=metrics.requests, latency=metrics.latency,
                       errors=metrics.errors)
    install_error_handlers(app)
    for module in (health, sessions, appends, reads, leases, cluster, openai, responses):
        app.include_router(module.router)

    app.state.gateway = gw
    # What the block port and the fast path call (memkv.api.block_port), bound to
    # this gateway's state.
    app.state.session_blocks = functools.partial(reads.session_blocks, gw)
    app.state.receive_append = functools.partial(appends.receive_append, gw)
    app.state.blocks_by_key = lambda body, who: reads.read_blocks_by_key(body, gw, who)
    app.state.authenticator = authenticator
    app.state.limits = {"max_body_bytes": max_body_bytes, "body_timeout_s": body_timeout_s,
                        "read_stall_s": read_stall_s}
    app.state.payload_bytes = metrics.payload_bytes
    app.state.release_plans = gw.fetcher.release_all
    app.state.client_leases = gw.client_leases
    app.openapi = lambda: openapi_with_errors(app)  # type: ignore[method-assign]
    return app
