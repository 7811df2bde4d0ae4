"""A plain round-robin HTTP proxy in front of engines: the baseline of the routed fleet.

    python -m memkv.bench.round_robin_proxy PORT ENGINE_URL [ENGINE_URL ...]

What a fleet gets from a load balancer that knows nothing of sessions: each
request goes to the next engine in turn, streamed through as it comes (the
same uvicorn + httpx stack as memkv's gateway, so the two differ in routing,
not in proxy overhead). No retries, no health checks.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

__all__ = ["proxy_app"]

#: Headers of the caller's request that are the proxy's, not the engine's.
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}


def proxy_app(engines: list[str]) -> Starlette:
    turn = itertools.cycle(engines)
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0),
                               limits=httpx.Limits(max_connections=512))

    async def forward(request: Request) -> StreamingResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        sent = client.build_request(request.method, next(turn) + request.url.path,
                                    content=await request.body(), headers=headers)
        answer = await client.send(sent, stream=True)
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code,
                                 media_type=answer.headers.get("content-type"),
                                 background=BackgroundTask(answer.aclose))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])],
                     lifespan=lifespan)


def main(port: int, engines: list[str]) -> None:
    uvicorn.run(proxy_app([e.rstrip("/") for e in engines]), host="127.0.0.1", port=port,
                http="httptools", log_level="warning", access_log=False)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
