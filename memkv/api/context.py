"""What every route of one gateway shares: its caches, counters, read paths and
the router shards, built once by :func:`memkv.api.app.create_app`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import ray
from fastapi import Depends, Request
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
)

from memkv.actors.router_shards import RouterShards
from memkv.api.auth import Principal
from memkv.api.blocks import (
    BlockFetcher,
)
from memkv.api.body_budget import BodyBudget
from memkv.api.client_leases import (
    ClientLeases,
)
from memkv.api.client_segments import ClientSegments
from memkv.api.engines.front_door import FrontDoor
from memkv.api.observe import StatsSnapshot
from memkv.api.session_lru import SessionLRU
from memkv.protocol.ids import (
    scoped_session_id,
)
from memkv.protocol.layout import KVLayout
from memkv.protocol.members import BlockReader
from memkv.protocol.messages import ReadRoute
from memkv.shm.same_node import shm_identity
from memkv.shm.staging import PutStaging, StagingSlot

__all__ = [
    "Caller",
    "Gateway",
    "GatewayMetrics",
    "GatewayState",
    "RouteCache",
    "SessionLRU",
    "Touches",
    "caller",
    "gateway",
    "release_after",
    "run_in_background",
    "scoped",
    "this_node_id",
]

#: How long the gateway uses a read plan it holds, and how much longer than a
#: stalled reader's bound (memkv.api.guarded_send) its lease lasts after that; and
#: how many blocks one device call plans (those asked for, then the ones that follow).
PLAN_USE_S = 7.0
PLAN_MARGIN_S = 3.0
READ_AHEAD_BLOCKS = 8

#: Layouts and namespaces of recently written sessions (immutable while a session
#: lives), so an append costs one router call, not two.
SESSION_CACHE_ENTRIES = 65536


class RouteCache(SessionLRU[ReadRoute]):
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


class Touches:
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


def run_in_background(coro: Any) -> None:
    """Run ``coro`` to its end without a waiter (the loop keeps only weak references)."""
    task = asyncio.ensure_future(coro)
    _background_tasks.add(task)
    task.add_done_callback(_background_tasks.discard)


async def release_after(call: Any, slot: StagingSlot) -> None:
    """Free a staging slot once the device call that reads it has answered, however."""
    try:
        await call
    except Exception:  # noqa: BLE001, S110 - its caller has gone; only the slot matters now
        pass
    finally:
        slot.release()


def this_node_id() -> str | None:
    return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else None


@dataclass
class GatewayMetrics:
    """The gateway's own Prometheus figures (the cluster's come from the router's stats)."""

    registry: CollectorRegistry
    requests: Counter
    latency: Histogram
    payload_bytes: Counter
    errors: Counter
    staged_bytes: Counter

    @classmethod
    def create(cls) -> GatewayMetrics:
        registry = CollectorRegistry()
        return cls(
            registry=registry,
            requests=Counter(
                "memkv_http_requests", "HTTP requests", ["route", "status"], registry=registry
            ),
            latency=Histogram(
                "memkv_http_request_seconds",
                "Request latency (to the response head)",
                ["route"],
                registry=registry,
            ),
            payload_bytes=Counter(
                "memkv_payload_bytes", "KV payload bytes", ["direction"], registry=registry
            ),
            errors=Counter(
                "memkv_http_errors", "Error responses by route and error type",
                ["route", "type"], registry=registry,
            ),
            staged_bytes=Counter(
                "memkv_append_staged_bytes",
                "Appended block bytes devices copied out of the gateway's staging segment",
                registry=registry,
            ),
        )


@dataclass
class Gateway:
    """One gateway's shared state (see :func:`memkv.api.app.create_app` for each option).

    Attributes:
        sessions: layout, namespace and ``finite_only`` of recently written sessions
            (immutable while a session lives), so an append costs one router call.
        unstaged: sessions whose device is on another node: their appends skip staging.
        routes: whole-session read routes, for reads that name a turn they have seen.
        devices_by_id: device handles by id, asked of shard 0 when one is not known.
    """

    routers: RouterShards
    metrics: GatewayMetrics
    fetcher: BlockFetcher
    client_leases: ClientLeases
    staging: PutStaging | None
    put_object: Callable[[Any], Any]
    this_node: str
    same_node_reads: bool
    max_body_bytes: int
    body_timeout_s: float
    read_stall_s: float
    inflight: BodyBudget
    snapshot: StatsSnapshot
    host_shm: str = field(default_factory=shm_identity)
    #: Segments same-host clients stage their appends in (memkv.api.client_segments).
    client_segments: ClientSegments = field(default_factory=ClientSegments)
    sessions: SessionLRU[tuple[KVLayout, str, bool]] = field(
        default_factory=lambda: SessionLRU(SESSION_CACHE_ENTRIES))
    unstaged: SessionLRU[bool] = field(default_factory=lambda: SessionLRU(SESSION_CACHE_ENTRIES))
    routes: RouteCache = field(default_factory=lambda: RouteCache(SESSION_CACHE_ENTRIES))
    devices_by_id: dict[str, BlockReader] = field(default_factory=dict)
    #: The OpenAI front door (engines, affinity, routing counters); None: not served.
    door: FrontDoor | None = None
    device_nodes: dict[str, str] = field(default_factory=dict)
    touches: Touches = field(init=False)

    def __post_init__(self) -> None:
        self.touches = Touches(self.routers, TOUCH_FLUSH_S)

    async def device_named(self, device_id: str) -> BlockReader | None:
        """A device's reader by id (shard 0 is asked again for one not known yet)."""
        if device_id not in self.devices_by_id:
            await self.refresh_devices()
        return self.devices_by_id.get(device_id)

    async def refresh_devices(self) -> None:
        """Learn the devices that joined since (shard 0 knows every one)."""
        self.devices_by_id.update(await self.routers.first_service.devices())

    async def node_of_device(self, device_id: str) -> str | None:
        """The Ray node a device runs on (asked once per device)."""
        if device_id not in self.device_nodes:
            device = await self.device_named(device_id)
            if device is None:
                return None
            self.device_nodes[device_id] = await device.node()
        return self.device_nodes[device_id]

    async def let_go_of(self, sid: str) -> None:
        """Release the read plans this gateway holds on a session's blocks."""
        route = self.routes.get_at(sid, 0)
        if route is not None:
            await self.fetcher.release_session(route)


async def caller(request: Request) -> Principal:
    """The principal :class:`~memkv.api.middleware.AuthMiddleware` put on the request."""
    principal: Principal = request.scope["state"]["principal"]
    return principal


async def gateway(request: Request) -> Gateway:
    """The app's :class:`Gateway` (async: FastAPI runs sync dependencies in a thread)."""
    state: Gateway = request.app.state.gateway
    return state


#: Route parameters: the caller and the gateway's state.
Caller = Annotated[Principal, Depends(caller)]
GatewayState = Annotated[Gateway, Depends(gateway)]


def scoped(who: Principal, session_id: str, role: str) -> str:
    """The router's id of the caller's session (checks the role first)."""
    who.require(role)
    return scoped_session_id(who.tenant, session_id)
