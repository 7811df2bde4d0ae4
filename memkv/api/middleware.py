"""The gateway's pure-ASGI layers: metrics, auth, the JSON body limit, and the
block-read fast path ahead of FastAPI's routing."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from prometheus_client import (
    Counter,
    Histogram,
)
from ray.exceptions import RayError

from memkv.actors.handles import ACTOR_GONE_ERRORS
from memkv.api.auth import Authenticator, Principal
from memkv.api.errors import (
    PayloadTooLarge,
    error_response,
    internal_response,
    unavailable_response,
)
from memkv.errors import (
    MemkvError,
    UnauthorizedError,
)

__all__ = [
    "AuthMiddleware",
    "BlockReadFastPath",
    "BodyLimitMiddleware",
    "MetricsMiddleware",
]

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
            response = error_response(e)
        except ACTOR_GONE_ERRORS as e:
            response = unavailable_response(e)
        except RayError as e:
            cause = getattr(e, "cause", None)
            response = (error_response(cause) if isinstance(cause, MemkvError)
                        else internal_response(e))
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
                await error_response(too_big)(scope, receive, send)
                return
        # JSON bodies are small: take the whole body first (so one over the cap
        # is answered 413 by us, not half-parsed by the route), then replay it.
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self._app(scope, _replay([], message, receive), send)
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self._max:
                too_big = PayloadTooLarge(f"body exceeds the limit of {self._max} for this route")
                await error_response(too_big)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self._app(scope, _replay(chunks, None, receive), send)


def _replay(chunks: list[bytes], then: Any, receive: Any) -> Callable[[], Any]:
    """An ASGI ``receive`` that hands over a body already read (or the message that came
    instead), then is the real one again: a client that goes away is still seen (a
    streamed answer stops, and the engine's request with it)."""
    body = b"".join(chunks)
    sent = False

    async def replayed() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return then if then is not None else {"type": "http.request", "body": body,
                                                  "more_body": False}
        return await receive()

    return replayed


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
            await error_response(e)(scope, receive, send)
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


def _error_type(body: bytes) -> str:
    """The ``type`` of an error envelope (one of memkv's error classes), else "other"."""
    try:
        kind = json.loads(body)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return "other"
    return kind if isinstance(kind, str) and kind.isidentifier() and len(kind) < 64 else "other"
