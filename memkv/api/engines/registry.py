"""The engines the gateway routes OpenAI requests to, checked and measured.

An engine (a ``vllm serve`` process) is registered by URL, with its model
(asked of its ``/v1/models`` when not given) and the Ray node it runs on. Every
``interval_s`` each is checked: ``/health`` must answer 200, and its
``/metrics`` give its load (``vllm:num_requests_running`` +
``vllm:num_requests_waiting``) and KV use (``vllm:kv_cache_usage_perc``, or the
older ``vllm:gpu_cache_usage_perc``). ``failures_to_down`` failed checks in a
row, or a request that could not reach it, take it out of routing; one good
check brings it back.

Registrations go into an :class:`~memkv.api.engines.book.EngineBook` too, and
each round of checks first takes from it what other gateway processes
registered or removed: every process routes to the same engines, each a check
interval after the change at most.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from memkv.api.engines.book import EngineBook, LocalBook
from memkv.api.engines.policy import EngineLoad
from memkv.api.engines.spec import EngineSpec
from memkv.errors import InvalidInputError
from memkv.periodic import Periodic

__all__ = ["Engine", "EngineRegistry"]

logger = logging.getLogger(__name__)

_REQUESTS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_KV_USE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
#: memkv's connector counters an engine exports (memkv.integrations.vllm.metrics), shown
#: with the engine: what it saved, what it did not and why, what it loaded.
_CONNECTOR = {f"vllm:memkv_{name}_total": name for name in (
    "save_blocks", "save_skipped_blocks", "save_skipped_blocks_load_failed",
    "save_skipped_blocks_memkv_error", "hit_tokens", "load_failures")}


@dataclass
class Engine:
    """One registered engine and what its last check found."""

    engine_id: str
    url: str
    model: str
    node: str = ""
    #: The engine runs vLLM's priority scheduler (``--scheduling-policy priority``):
    #: a session's priority goes with its requests.
    priority_scheduling: bool = False
    max_requests: int | None = None  # its spill bound (None: the gateway's)
    #: The tenants whose requests it takes (its connector holds a token of theirs, and
    #: stores what it computes as theirs); None: every tenant's.
    tenants: frozenset[str] | None = None
    healthy: bool = False
    requests: int = 0  # running + waiting, from its last /metrics
    inflight: int = 0  # requests this gateway has sent it and not seen answered
    kv_use: float = 0.0
    #: memkv's connector counters from its last /metrics (empty: no memkv connector).
    connector: dict[str, int] = field(default_factory=dict)
    failures: int = 0  # checks failed in a row
    last_error: str = ""
    checked_at: float = 0.0

    def load(self) -> EngineLoad:
        # Its /metrics count every gateway's requests but are up to a check old; what
        # this gateway sent is current: the larger of the two.
        return EngineLoad(self.engine_id, self.model, self.node, self.healthy,
                          max(self.requests, self.inflight), self.kv_use, self.max_requests)

    def spec(self) -> EngineSpec:
        return EngineSpec(self.url, self.model, self.node, self.priority_scheduling,
                          self.max_requests, self.tenants)

    def serves(self, tenant: str | None) -> bool:
        return self.tenants is None or tenant in self.tenants

    def document(self) -> dict[str, object]:
        return {"id": self.engine_id, "url": self.url, "model": self.model, "node": self.node,
                "tenants": None if self.tenants is None else sorted(self.tenants),
                "priority_scheduling": self.priority_scheduling,
                "max_requests": self.max_requests, "healthy": self.healthy,
                "requests": self.requests, "inflight": self.inflight, "kv_use": self.kv_use,
                "connector": dict(self.connector), "last_error": self.last_error}


class EngineRegistry:
    """Registered engines; a background task checks them while the gateway runs.

    Args:
        client: the gateway's HTTP client to the engines.
        interval_s: seconds between checks.
        failures_to_down: failed checks in a row before an engine leaves routing.
        timeout_s: a check's time limit.
        book: where registrations are shared with the other gateway processes.
    """

    def __init__(self, client: httpx.AsyncClient, *, interval_s: float = 2.0,
                 failures_to_down: int = 2, timeout_s: float = 2.0,
                 book: EngineBook | None = None) -> None:
        self.client = client
        self.book: EngineBook = book if book is not None else LocalBook()
        self.interval_s = interval_s
        self.failures_to_down = failures_to_down
        self.timeout_s = timeout_s
        self._engines: dict[str, Engine] = {}
        self._checks = Periodic(self.check_all, interval_s, "engine checks")

    def ensure_running(self) -> None:
        self._checks.ensure_running()

    def stop(self) -> None:
        self._checks.cancel()

    def engines(self) -> list[Engine]:
        return list(self._engines.values())

    def serving(self, tenant: str | None) -> list[Engine]:
        """The engines that take ``tenant``'s requests."""
        return [e for e in self._engines.values() if e.serves(tenant)]

    def get(self, engine_id: str) -> Engine | None:
        return self._engines.get(engine_id)

    async def register(self, url: str, *, model: str | None = None, node: str = "",
                       engine_id: str | None = None, priority_scheduling: bool = False,
                       max_requests: int | None = None,
                       tenants: frozenset[str] | None = None) -> Engine:
        """Add an engine and check it once now (it serves once healthy).

        Raises:
            InvalidInputError: the URL is not http(s), or no model was given and
                the engine's ``/v1/models`` does not name one.
        """
        if not url.startswith(("http://", "https://")):
            raise InvalidInputError(f"an engine URL is http:// or https://..., got {url!r}")
        url = url.rstrip("/")
        if model is None:
            model = await self._model_of(url)
        engine = Engine(engine_id or f"engine-{uuid.uuid4().hex[:8]}", url, model, node,
                        priority_scheduling, max_requests, tenants)
        await self.book.put(engine.engine_id, engine.spec())
        self._adopt(engine)
        await self.check(engine)
        self.ensure_running()
        logger.warning("engine %s registered: %s serving %s (%s)", engine.engine_id, url, model,
                       "healthy" if engine.healthy else f"not yet healthy: {engine.last_error}")
        return engine

    async def unregister(self, engine_id: str) -> None:
        if self._engines.pop(engine_id, None) is None:
            raise InvalidInputError(f"no engine {engine_id!r} is registered")
        await self.book.remove(engine_id)

    def _adopt(self, engine: Engine) -> None:
        """Route to ``engine`` (replacing one of its id: what this gateway has in flight
        there and its last check carry over)."""
        old = self._engines.get(engine.engine_id)
        if old is not None and old.url == engine.url:
            engine.inflight, engine.healthy = old.inflight, old.healthy
            engine.requests, engine.kv_use = old.requests, old.kv_use
        self._engines[engine.engine_id] = engine

    async def sync(self) -> None:
        """Take what other gateway processes registered or removed from the book."""
        try:
            entries = await self.book.entries()
        except Exception as e:  # noqa: BLE001 - the book is unreachable: route as before
            logger.warning("engine registrations not read (%s); routing to the known ones", e)
            return
        for engine_id in set(self._engines) - set(entries):
            logger.warning("engine %s unregistered (by another gateway process)", engine_id)
            del self._engines[engine_id]
        adopted: list[Engine] = []
        for engine_id, spec in entries.items():
            known = self._engines.get(engine_id)
            if known is not None and known.spec() == spec:
                continue
            if spec.model is None:
                continue  # (registrations always name the model they found)
            engine = Engine(engine_id, spec.url, spec.model, spec.node,
                            spec.priority_scheduling, spec.max_requests, spec.tenants)
            self._adopt(engine)
            if known is None:
                logger.warning("engine %s registered (by another gateway process): %s",
                               engine_id, spec.url)
                adopted.append(engine)
        await asyncio.gather(*(self.check(e) for e in adopted))  # routable at once

    def mark_failed(self, engine_id: str, error: str) -> None:
        """A request could not reach the engine: out of routing until a check passes."""
        engine = self._engines.get(engine_id)
        if engine is not None and engine.healthy:
            logger.warning("engine %s failed a request (%s): out of routing until it "
                           "answers its checks", engine_id, error)
            engine.healthy, engine.last_error = False, error
            engine.failures = max(engine.failures, self.failures_to_down)

    async def check(self, engine: Engine) -> None:
        try:
            health = await self.client.get(f"{engine.url}/health", timeout=self.timeout_s)
            health.raise_for_status()
            metrics = await self.client.get(f"{engine.url}/metrics", timeout=self.timeout_s)
            requests, kv_use, connector = _load_of(
                metrics.text if metrics.status_code == 200 else "")
        except (httpx.HTTPError, ValueError) as e:
            engine.failures += 1
            engine.last_error = f"{type(e).__name__}: {e}"
            if engine.healthy and engine.failures >= self.failures_to_down:
                engine.healthy = False
                logger.warning("engine %s is down: %s", engine.engine_id, engine.last_error)
        else:
            if not engine.healthy:
                logger.warning("engine %s is healthy", engine.engine_id)
            engine.healthy, engine.failures, engine.last_error = True, 0, ""
            engine.requests, engine.kv_use, engine.connector = requests, kv_use, connector
        engine.checked_at = time.monotonic()

    async def check_all(self) -> None:
        await self.sync()
        await asyncio.gather(*(self.check(e) for e in self.engines()))

    async def _model_of(self, url: str) -> str:
        try:
            answer = await self.client.get(f"{url}/v1/models", timeout=self.timeout_s)
            answer.raise_for_status()
            return str(answer.json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            raise InvalidInputError(
                f"engine {url}: no model given and its /v1/models names none ({e})") from e


def _load_of(text: str) -> tuple[int, float, dict[str, int]]:
    """(running + waiting requests, KV use 0..1, memkv's connector counters) from a
    vLLM /metrics page."""
    requests, kv_use = 0.0, 0.0
    connector: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _REQUESTS:
                requests += sample.value
            elif sample.name in _KV_USE:
                kv_use = max(kv_use, sample.value)
            elif sample.name in _CONNECTOR:
                name = _CONNECTOR[sample.name]
                connector[name] = connector.get(name, 0) + int(sample.value)
    return int(requests), float(kv_use), connector
