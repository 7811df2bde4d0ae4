"""The gateway's front door for agent traffic: its engines, which session went where,
and the routing counters.

One :class:`FrontDoor` per gateway process. Its HTTP client and the registry's
check loop are made on first use, inside the server's event loop.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client import CollectorRegistry, Counter

from memkv.api.engines.book import EngineBook, LocalBook
from memkv.api.engines.policy import Reason, SpillThreshold
from memkv.api.engines.registry import EngineRegistry
from memkv.api.engines.spec import EngineSpec
from memkv.api.responses.chains import ChainBook
from memkv.api.session_lru import SessionLRU
from memkv.errors import InvalidInputError

logger = logging.getLogger(__name__)

__all__ = ["EngineSpec", "FrontDoor", "FrontDoorOptions", "RoutingMetrics", "configured_engine_id"]


@dataclass(frozen=True)
class FrontDoorOptions:
    """``gateway.routing``: the spill bounds, the engines' checks, the request limit."""

    spill: SpillThreshold = field(default_factory=SpillThreshold)
    check_interval_s: float = 2.0
    failures_to_down: int = 2
    request_timeout_s: float = 600.0

#: Sessions whose last engine is remembered (sticky routing), least recent dropped.
AFFINITY_ENTRIES = 100_000
#: Engines tried for one request before it fails (a failover needs a second).
ATTEMPTS = 2
#: How long a session's KV node and priority, asked of the router, are used again.
KV_LOOKUP_TTL_S = 5.0


def configured_engine_id(url: str) -> str:
    return "engine-" + hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:8]


@dataclass
class RoutingMetrics:
    """Per-engine routing counters (``/metrics``)."""

    routed: Counter  # engine, reason (sticky, kv-node, least-loaded, spill)
    failovers: Counter  # engine that failed before the request started
    stream_errors: Counter  # engine that died mid-stream

    @classmethod
    def create(cls, registry: CollectorRegistry) -> RoutingMetrics:
        return cls(
            routed=Counter("memkv_routed_requests", "OpenAI requests routed, by engine and why",
                           ["engine", "reason"], registry=registry),
            failovers=Counter("memkv_routing_failovers",
                              "Requests sent to another engine after one failed to start them",
                              ["engine"], registry=registry),
            stream_errors=Counter("memkv_routing_stream_errors",
                                  "Streams ended with an error event (their engine failed)",
                                  ["engine"], registry=registry),
        )


@dataclass
class FrontDoor:
    """Engines, affinity and counters of one gateway."""

    metrics: RoutingMetrics
    options: FrontDoorOptions = field(default_factory=FrontDoorOptions)
    _client: httpx.AsyncClient | None = None
    _registry: EngineRegistry | None = None
    #: Each session's last engine (sticky routing).
    _affinity: SessionLRU[str] = field(default_factory=lambda: SessionLRU(AFFINITY_ENTRIES))
    #: Each session's (time its entry expires, KV node, priority), asked of the router.
    _kv: SessionLRU[tuple[float, str | None, str]] = field(
        default_factory=lambda: SessionLRU(AFFINITY_ENTRIES))
    configured: list[EngineSpec] = field(default_factory=list)
    #: Where registrations are kept for every gateway process (LocalBook: this one's).
    book: EngineBook = field(default_factory=LocalBook)
    _pending: list[EngineSpec] | None = None  # configured engines not registered yet
    #: Stored responses this process read or wrote, and conversations by their history.
    chains: ChainBook = field(default_factory=ChainBook)
    #: Sessions this process suspended on a pause hint (resumed before their next turn).
    paused: SessionLRU[bool] = field(default_factory=lambda: SessionLRU(AFFINITY_ENTRIES))

    async def ready(self) -> None:
        """On first use: take the engines other gateway processes registered, and start
        the checks (which keep taking them); register the configured engines (one that
        does not answer yet is tried again on the next request)."""
        if self._pending is None:
            self._pending = list(self.configured)
            await self.registry.sync()
            self.registry.ensure_running()
        left: list[EngineSpec] = []
        for spec in self._pending:
            try:
                # One id per URL: every gateway process registers the configured
                # engines, and they share one book.
                await self.registry.register(spec.url, model=spec.model, node=spec.node,
                                             priority_scheduling=spec.priority_scheduling,
                                             max_requests=spec.max_requests,
                                             tenants=spec.tenants,
                                             engine_id=configured_engine_id(spec.url))
            except InvalidInputError as e:
                logger.warning("configured engine %s not registered yet: %s", spec.url, e)
                left.append(spec)
        self._pending = left

    @property
    def spill(self) -> SpillThreshold:
        return self.options.spill

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.options.request_timeout_s, connect=5.0),
                limits=httpx.Limits(max_connections=512, max_keepalive_connections=128))
        return self._client

    @property
    def registry(self) -> EngineRegistry:
        if self._registry is None:
            self._registry = EngineRegistry(
                self.client, interval_s=self.options.check_interval_s,
                failures_to_down=self.options.failures_to_down, book=self.book)
        return self._registry

    def kv_of(self, session_id: str) -> tuple[str | None, str] | None:
        """The session's KV node and priority, if looked up within KV_LOOKUP_TTL_S."""
        entry = self._kv.get(session_id)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1], entry[2]

    def remember_kv(self, session_id: str, found: tuple[str | None, str]) -> None:
        self._kv.put(session_id, (time.monotonic() + KV_LOOKUP_TTL_S, *found))

    def engine_of(self, session_id: str) -> str | None:
        return self._affinity.get(session_id)

    def remember(self, session_id: str, engine_id: str, reason: Reason) -> None:
        self._affinity.put(session_id, engine_id)
        self.metrics.routed.labels(engine_id, reason.value).inc()

    def routed_counts(self) -> dict[str, dict[str, int]]:
        """Requests routed per engine, by reason (and failovers, stream errors)."""
        out: dict[str, dict[str, int]] = {}
        for counter, key in ((self.metrics.routed, None), (self.metrics.failovers, "failovers"),
                             (self.metrics.stream_errors, "stream_errors")):
            for family in counter.collect():
                for sample in family.samples:
                    if not sample.name.endswith("_total"):
                        continue
                    engine = sample.labels["engine"]
                    name = key or sample.labels["reason"]
                    out.setdefault(engine, {})[name] = int(sample.value)
        return out

    async def close(self) -> None:
        if self._registry is not None:
            self._registry.stop()
        if self._client is not None:
            await self._client.aclose()
