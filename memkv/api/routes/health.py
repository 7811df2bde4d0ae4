"""Health, readiness, metrics and the status page (no token needed for any)."""

from __future__ import annotations

import asyncio
import functools
import importlib.resources
import logging

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray.exceptions import RayError

from memkv.api.answers import HealthOut
from memkv.api.context import GatewayState
from memkv.api.observe import engine_metrics

__all__ = ["router"]

logger = logging.getLogger(__name__)

router = APIRouter()


@router.get("/healthz", tags=["health"], response_model_exclude_none=True)
async def healthz(request: Request) -> HealthOut:
    """The gateway process is up (no token needed); ``block_port``: where its block
    port listens, when it has one (clients use it for KV bodies); ``worker``:
    which of the node's gateway processes answered (``gateway.workers``)."""
    state = request.app.state
    port = getattr(state, "block_port", None)
    return HealthOut(status="ok", worker=getattr(state, "worker", 0),
                     block_port=port.stats.port if port is not None else None)


@router.get("/readyz", tags=["health"])
async def readyz(gw: GatewayState) -> JSONResponse:
    """The router answers (the cluster can serve; no token needed)."""
    try:
        await asyncio.gather(*(shard.ping() for shard in gw.routers.services))
    except RayError as e:
        return JSONResponse({"status": "unavailable", "reason": str(e)}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/", include_in_schema=False)
async def status_page() -> HTMLResponse:
    """The live status page: static, no data in it (its figures come from
    /v1/stats with the viewer's admin token), so it is served without one."""
    return HTMLResponse(_status_page_html())


@router.get("/metrics", tags=["health"])
async def metrics(request: Request, gw: GatewayState) -> Response:
    """This gateway's request figures, then the cluster's (tiers, hits, prefetch, ...).

    Per-tenant series (sessions and bytes by tenant) only for a token with the
    ``metrics`` or ``admin`` role: the open endpoint names no tenant."""
    who = request.scope.get("state", {}).get("principal")
    tenants = who is not None and who.sees_tenants
    body = generate_latest(gw.metrics.registry)
    try:
        body += engine_metrics(await gw.snapshot.get(), tenants=tenants)
    except RayError as e:  # the gateway's own figures still go out
        logger.warning("no cluster figures for /metrics: %s", e)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@functools.cache
def _status_page_html() -> str:
    return (importlib.resources.files("memkv.api") / "status_page.html").read_text()
