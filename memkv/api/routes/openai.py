"""The OpenAI-compatible front door: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, forwarded to registered engines (``/v1/engines``).

A request's session comes from memkv's ``X-Memkv-Session`` header or the body's
``memkv.session_id`` (the OpenAI client's ``extra_body={"memkv": {...}}``), else
from what stock clients send: ``prompt_cache_key``, ``conversation``, an
``X-Session-ID`` header, ``user`` (:func:`_session_of`); it is the caller's
tenant's session, as on every other route, and
goes to the engine as ``kv_transfer_params`` (the memkv connector appends each
turn to it). The engine is chosen by :mod:`memkv.api.engines.policy`; one that
cannot be reached before the request starts is taken out of routing and the
request goes to another (its session's KV is loaded there from memkv). A
stream whose engine fails midway ends with an error event. A client that goes
away closes the engine's connection, and the engine drops the request.
Errors answer in OpenAI's shape (``{"error": {"message": ...}}``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field
from starlette.background import BackgroundTask

from memkv.api.context import Caller, Gateway, GatewayState, scoped
from memkv.api.engines.front_door import ATTEMPTS, FrontDoor
from memkv.api.engines.policy import choose_engine
from memkv.api.engines.registry import Engine
from memkv.api.models import _Model
from memkv.errors import MemkvError, NotFoundError
from memkv.protocol.ids import hashed_session_id, is_session_id

__all__ = ["router"]

router = APIRouter(tags=["openai"])

SESSION_HEADER = "x-memkv-session"
#: The session header routers and benchmarks send (vLLM's ``--send-conversation-id``).
ROUTER_SESSION_HEADER = "x-session-id"
#: A session's priority as vLLM's scheduler takes it (lower first).
VLLM_PRIORITY = {"high": -1, "normal": 0, "background": 1}
#: Which engine served the request (the answer's header).
ENGINE_HEADER = "X-Memkv-Engine"
#: Statuses of an engine that did not start the request (another may).
_NOT_STARTED = (502, 503, 504)
#: Headers of the caller's request that are not the engine's business.
_HOP_HEADERS = {"host", "authorization", "content-length", "connection", "x-memkv-session",
                "accept-encoding", "transfer-encoding"}


class EngineIn(_Model):
    url: str = Field(pattern=r"^https?://", description="The engine's base URL (vllm serve).")
    model: str | None = Field(default=None, description="Its model (default: its /v1/models).")
    node: str = Field(default="", description="The Ray node it runs on (for KV affinity).")
    engine_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    priority_scheduling: bool = Field(
        default=False, description="It runs vLLM's priority scheduler: a session's priority "
        "goes with its requests (high first, background last).")
    max_requests: int | None = Field(
        default=None, ge=1, description="Its spill bound: running + waiting requests at which "
        "sessions move to another engine (default: gateway.routing.spill_requests).")
    tenants: list[str] | None = Field(
        default=None, description="The tenants whose requests it takes: its connector holds a "
        "token of theirs and stores what it computes as theirs. Default: the registering "
        "token's tenant; [\"*\"]: every tenant (an engine with no connector, or auth off).")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """OpenAI's error shape (``error.message``, ``type``), with memkv's ``status`` too."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": None, "status": status}}, status_code=status)


def _body_schema(needs: str) -> dict[str, Any]:
    """The OpenAPI request body of a completion route (the engine checks the rest)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": ["model", needs], "additionalProperties": True,
        "properties": {"model": {"type": "string", "minLength": 1},
                       needs: {"type": "array"} if needs == "messages" else {},
                       "stream": {"type": "boolean"},
                       "user": {"type": "string"},
                       "memkv": {"type": "object",
                                 "properties": {"session_id": {"type": "string"}}}}}}}},
        "responses": {"200": {"description": "The engine's answer (JSON, or server-sent "
                                             "events when stream is true).",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {"schema": {"type": "string"}}}}}}


async def _door(gw: Gateway) -> FrontDoor:
    if gw.door is None:
        raise MemkvError("this gateway has no front door")
    await gw.door.ready()
    return gw.door


@router.post("/v1/engines", status_code=201, tags=["engines"])
async def register_engine(body: EngineIn, gw: GatewayState, who: Caller) -> dict[str, Any]:
    """Add an engine to route to (admin); checked now, then every few seconds."""
    who.require("admin")
    tenants = body.tenants if body.tenants is not None else (
        [who.tenant] if who.tenant is not None else ["*"])
    engine = await (await _door(gw)).registry.register(
        body.url, model=body.model, node=body.node, engine_id=body.engine_id,
        priority_scheduling=body.priority_scheduling, max_requests=body.max_requests,
        tenants=None if "*" in tenants else frozenset(tenants))
    return engine.document()


@router.get("/v1/engines", tags=["engines"])
async def list_engines(gw: GatewayState, who: Caller) -> dict[str, Any]:
    who.require("admin")
    return {"engines": [e.document() for e in (await _door(gw)).registry.engines()]}


@router.delete("/v1/engines/{engine_id}", status_code=204, tags=["engines"])
async def unregister_engine(engine_id: str, gw: GatewayState, who: Caller) -> Response:
    who.require("admin")
    if (await _door(gw)).registry.get(engine_id) is None:
        raise NotFoundError(f"no engine {engine_id!r} is registered")
    await (await _door(gw)).registry.unregister(engine_id)
    return Response(status_code=204)


@router.get("/v1/models")
async def models(gw: GatewayState, who: Caller) -> dict[str, Any]:
    """The models the caller's healthy engines serve (OpenAI's list shape)."""
    who.require("read")
    served = sorted({e.model for e in (await _door(gw)).registry.serving(who.tenant)
                     if e.healthy})
    return {"object": "list",
            "data": [{"id": m, "object": "model", "owned_by": "memkv"} for m in served]}


@router.post("/v1/chat/completions", openapi_extra=_body_schema("messages"))
async def chat_completions(request: Request, gw: GatewayState, who: Caller) -> Response:
    return await _forward(request, gw, who, "/v1/chat/completions", "messages")


@router.post("/v1/completions", openapi_extra=_body_schema("prompt"))
async def completions(request: Request, gw: GatewayState, who: Caller) -> Response:
    return await _forward(request, gw, who, "/v1/completions", "prompt")


def _session_of(request: Request, body: dict[str, Any]) -> str | None:
    """The request's session, from the first of (memkv's own, then OpenAI's and the
    routers' conventions, so that a stock client or agent SDK needs no memkv code):
    the ``X-Memkv-Session`` header, the body's ``memkv.session_id``, its
    ``prompt_cache_key``, its ``conversation`` (an id, or ``{"id": ...}``), the
    ``X-Session-ID`` header (vLLM's multi-turn benchmark, Dynamo), its ``user``.

    memkv's own fields name the session as they are (a bad id is refused, as on every
    route); any other string names one by its hash (memkv.protocol.ids), so whatever
    an SDK sends keeps its conversation together rather than failing it."""
    memkv = body.get("memkv")
    for own in (request.headers.get(SESSION_HEADER),
                memkv.get("session_id") if isinstance(memkv, dict) else None):
        if isinstance(own, str) and own:
            return own
    conversation = body.get("conversation")
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    for found in (body.get("prompt_cache_key"), conversation,
                  request.headers.get(ROUTER_SESSION_HEADER), body.get("user")):
        if isinstance(found, str) and found:
            return found if is_session_id(found) else hashed_session_id(found)
    return None


def _partition(engine: Engine, tenant: str | None) -> str | None:
    """Where an engine's connector keeps this tenant's KV in memkv: its own namespace for
    an engine of one tenant (None); for an engine shared by tenants, a partition per
    tenant (memkv.protocol.ids), so that one tenant's prompts never hit blocks another
    computed, in memkv either (a timing channel, as through vLLM's own prefix cache)."""
    if tenant is None or (engine.tenants is not None and engine.tenants == {tenant}):
        return None
    return hashlib.blake2b(f"memkv-tenant\0{tenant}".encode(), digest_size=12).hexdigest()


def _cache_salt(tenant: str, theirs: Any) -> str:
    """The engine's prefix-cache salt for the tenant (vLLM's ``cache_salt``): engines
    share their prefix caches between requests with the same salt only, so one tenant's
    prompts never hit blocks another's computed. The caller's own salt, if any, divides
    its tenant's cache further; it can never name another tenant's."""
    salt = hashlib.sha256(f"memkv-tenant\0{tenant}".encode()).hexdigest()[:32]
    return f"{salt}:{theirs}" if isinstance(theirs, str) and theirs else salt


async def _kv_node(gw: Gateway, door: FrontDoor, sid: str) -> tuple[str | None, str]:
    """The node whose device holds the session's blocks, and its priority (asked of the
    router at most every KV_LOOKUP_TTL_S per session: both change rarely, and a turn
    that finds them stale only loses locality, never data)."""
    known = door.kv_of(sid)
    if known is not None:
        return known
    try:
        view = await gw.routers.service(sid).session(sid)
    except MemkvError:
        found: tuple[str | None, str] = (None, "normal")  # new (or not locatable now)
    else:
        node = await gw.node_of_device(view.device_id) if view.device_id else None
        found = (node, view.priority.value)
    door.remember_kv(sid, found)
    return found


async def _forward(request: Request, gw: Gateway, who: Any, path: str, needs: str) -> Response:
    who.require("write")
    door = await _door(gw)
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        return _error(400, f"the body is not JSON: {e}")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return _error(400, "'model' is required: a model name of GET /v1/models")
    if needs not in body:
        return _error(400, f"'{needs}' is required for {path}")
    stream = body.get("stream") is True
    if not any(e.model == model for e in door.registry.serving(who.tenant)):
        return _error(404, f"the model {model!r} does not exist (GET /v1/models lists them)",
                      "not_found_error")
    session = _session_of(request, body)
    sid = scoped(who, session, "write") if session else None
    kv_node, priority = await _kv_node(gw, door, sid) if sid else (None, "normal")
    body.pop("memkv", None)
    if session is not None:
        # The caller's own id: the engine's connector is a client of memkv with its own
        # token, which scopes it (the engines of a tenant hold that tenant's token).
        body["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}),
                                      "session_id": session, "priority": priority,
                                      "namespace": who.write_namespace(None)}
    if who.tenant is not None:
        body["cache_salt"] = _cache_salt(who.tenant, body.get("cache_salt"))
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
    tried: set[str] = set()
    for _ in range(ATTEMPTS):
        choice = choose_engine(model, [e.load() for e in door.registry.serving(who.tenant)],
                               sticky=door.engine_of(sid) if sid else None, kv_node=kv_node,
                               spill=door.spill, avoid=frozenset(tried))
        engine = door.registry.get(choice.engine_id) if choice is not None else None
        if choice is None or engine is None:
            break
        tried.add(engine.engine_id)
        sent_body = {**body, "kv_transfer_params": {
            **(body.get("kv_transfer_params") or {}),
            "partition": _partition(engine, who.tenant)}}
        if engine.priority_scheduling and sid is not None and "priority" not in body:
            sent_body["priority"] = VLLM_PRIORITY.get(priority, 0)
        engine.inflight += 1  # until its answer is read or its stream ends
        try:
            sent = door.client.build_request("POST", engine.url + path, json=sent_body,
                                             headers=headers)
            answer = await door.client.send(sent, stream=True)
        except BaseException as e:
            engine.inflight -= 1
            if not isinstance(e, httpx.TransportError):
                raise  # the caller went away (cancelled) while it connected
            _not_started(door, engine, f"{type(e).__name__}: {e}")
            continue
        relay = _Relay(answer, engine, door)
        if answer.status_code in _NOT_STARTED:
            await relay.close()
            _not_started(door, engine, f"HTTP {answer.status_code}")
            continue
        if sid is not None:
            door.remember(sid, engine.engine_id, choice.reason)
        media = answer.headers.get("content-type", "application/json")
        if not stream:
            try:
                content = await answer.aread()
            finally:
                await relay.close()
            return Response(content, status_code=answer.status_code, media_type=media,
                            headers={ENGINE_HEADER: engine.engine_id})
        return StreamingResponse(relay.events(), status_code=answer.status_code,
                                 media_type=media, headers={ENGINE_HEADER: engine.engine_id},
                                 background=BackgroundTask(relay.close))
    return _error(503, f"no healthy engine could take a request for {model!r}"
                  + (f" (tried {sorted(tried)})" if tried else ""), "service_unavailable")


def _not_started(door: FrontDoor, engine: Engine, why: str) -> None:
    """The engine could not take the request: out of routing, and counted as a failover
    (the request goes on to another engine)."""
    door.registry.mark_failed(engine.engine_id, why)
    door.metrics.failovers.labels(engine.engine_id).inc()


class _Relay:
    """An engine's answer relayed to the caller: streamed, the engine's events as they
    come (an engine failure midway ends the stream with an error event). :meth:`close`
    runs once, when the answer is read, the stream ends or the caller goes away (then
    closing the engine's connection makes the engine drop the request), even if the
    caller left before the stream began."""

    def __init__(self, answer: httpx.Response, engine: Engine, door: FrontDoor) -> None:
        self.answer, self.engine, self.door = answer, engine, door
        self._open = True

    async def events(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.answer.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            engine_id = self.engine.engine_id
            self.door.metrics.stream_errors.labels(engine_id).inc()
            self.door.registry.mark_failed(engine_id, f"{type(e).__name__}: {e}")
            event = {"error": {"message": f"engine {engine_id} failed mid-stream ({e}); "
                               "retry the turn: its KV is in memkv", "type": "engine_error"}}
            yield f"data: {json.dumps(event)}\n\n".encode()
        finally:
            await self.close()

    async def close(self) -> None:
        if self._open:
            self._open = False
            self.engine.inflight -= 1
            await self.answer.aclose()
