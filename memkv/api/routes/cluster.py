"""Questions about the whole table: ``/v1/match`` (the longest cached prefix) and
``/v1/stats`` (every figure of the cluster and of this gateway)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import Counter, Histogram

from memkv.actors.router_shards import merge_prefix
from memkv.api.answers import MatchOut
from memkv.api.context import Caller, GatewayState
from memkv.api.models import MatchIn
from memkv.protocol.hashing import token_array
from memkv.protocol.ids import PUBLISHER_SEPARATOR
from memkv.protocol.layout import KVLayout
from memkv.protocol.messages import PrefixMatch
from memkv.protocol.stats import as_document

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/match", tags=["kv"])
async def match(body: MatchIn, gw: GatewayState, who: Caller) -> MatchOut:
    """How many leading tokens are already cached (any session of the namespace:
    the caller's tenant by default, or a public one its token may read)."""
    who.require("read")
    layout = KVLayout.from_dict(body.layout.model_dump())
    token_array(body.token_ids)  # validate before asking the router
    # In a public namespace, each trusted publisher's blocks apart: the longest
    # prefix wins, the earlier publisher in the token's trust on a tie.
    best: PrefixMatch | None = None
    for namespace in who.read_namespaces(body.namespace):
        found = merge_prefix(list(await asyncio.gather(
            *gw.routers.match_prefix(layout, namespace, body.token_ids))))
        if found.tokens > (best.tokens if best is not None else 0):
            best = found
    if best is None:
        return MatchOut(tokens=0, blocks=[], publisher=None)
    return MatchOut(tokens=best.tokens, blocks=[k.hex() for k in best.blocks],
                    publisher=_publisher_of(best.namespace))


# An open document by design: ClusterStats as JSON plus this gateway's own figures,
# which tools and the status page read by name, and which grow release by release.
@router.get("/v1/stats", tags=["cluster"])
async def stats(request: Request, gw: GatewayState, who: Caller) -> dict[str, Any]:
    """Cluster-wide figures (every tenant's): the admin role only. The cluster part is
    a snapshot at most 2 s old, shared with /metrics and the status page."""
    who.require("admin")
    out = as_document(await gw.snapshot.get())
    # This gateway's own read paths: how many blocks it served from shared
    # memory and how many in-cluster, and leases that ran out mid-write.
    out["gateway"] = {
        # Of gateway.workers: only this worker's own figures.
        "worker": getattr(request.app.state, "worker", 0),
        "plan_cache": gw.fetcher.plan_stats(),
        "client_leases": gw.client_leases.stats(),
        "same_node_blocks": gw.fetcher.same_node_blocks,
        "in_cluster_blocks": gw.fetcher.in_cluster_blocks,
        "leases_lost": gw.fetcher.leases_lost,
        # Appends: bytes devices copied out of the staging segment (the rest went
        # through the object store), and the segment's size (0: no staging).
        "staged_bytes": int(gw.metrics.staged_bytes._value.get()),
        "staging_bytes": gw.staging.capacity_bytes if gw.staging is not None else 0,
        # Append bodies being received (by declared length), and those dropped for
        # stalling, trickling or taking too long (memkv.api.body_budget).
        "inflight_body_bytes": gw.inflight.used,
        "bodies_dropped": gw.inflight.dropped,
        "http": _route_figures(gw.metrics.requests, gw.metrics.latency),
    }
    if gw.door is not None and gw.door.registry.engines():
        # The OpenAI front door: each engine's state and what was routed to it.
        routed = gw.door.routed_counts()
        out["gateway"]["engines"] = [{**e.document(), "routed": routed.get(e.engine_id, {})}
                                     for e in gw.door.registry.engines()]
    port = getattr(request.app.state, "block_port", None)
    if port is not None:
        out["gateway"]["block_port"] = asdict(port.stats)  # a copy: a snapshot, not live counters
    return out


def _publisher_of(namespace: str | None) -> str | None:
    """The tenant a publisher's namespace (``public@tenant``) belongs to; None otherwise."""
    if namespace is None or PUBLISHER_SEPARATOR not in namespace:
        return None
    return namespace.partition(PUBLISHER_SEPARATOR)[2]


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
