"""The OpenAI-compatible front door: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, forwarded to registered engines (``/v1/engines``); ``/v1/responses``
is :mod:`memkv.api.routes.responses`.

A request's session comes from memkv's ``X-Memkv-Session`` header or the body's
``memkv.session_id`` (the OpenAI client's ``extra_body={"memkv": {...}}``), else
from what stock clients send: ``prompt_cache_key``, ``conversation``, an
``X-Session-ID`` header, ``user`` (:func:`memkv.api.engines.requests.session_of`);
it is the caller's tenant's session, as on every other route, and goes to the
engine as ``kv_transfer_params`` (the memkv connector appends each turn to it).
The engine is chosen by :mod:`memkv.api.engines.policy`; one that cannot be
reached before the request starts is taken out of routing and the request goes
to another (its session's KV is loaded there from memkv). A stream whose engine
fails midway ends with an error event. A client that goes away closes the
engine's connection, and the engine drops the request. Errors answer in
OpenAI's shape (``{"error": {"message": ...}}``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field
from starlette.background import BackgroundTasks

from memkv.api.context import Caller, Gateway, GatewayState
from memkv.api.engines.dispatch import send_to_engine
from memkv.api.engines.hints import after_turn, before_turn
from memkv.api.engines.requests import (
    ENGINE_HEADER,
    door_of,
    forwarded_headers,
    no_engine,
    read_request,
    routed_session,
    session_of,
)
from memkv.api.models import _Model
from memkv.errors import NotFoundError

__all__ = ["router"]

router = APIRouter(tags=["openai"])


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


def _body_schema(needs: str) -> dict[str, Any]:
    """The OpenAPI request body of a completion route (the engine checks the rest)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": ["model", needs], "additionalProperties": True,
        "properties": {"model": {"type": "string", "minLength": 1},
                       needs: {"type": "array"} if needs == "messages" else {},
                       "stream": {"type": "boolean"},
                       "user": {"type": "string"},
                       "memkv": {"type": "object", "properties": {
                           "session_id": {"type": "string"},
                           "pause": {"type": "object", "properties": {"expected_s": {
                               "type": "number", "minimum": 0, "maximum": 86400}}},
                           "final": {"type": "boolean"}}}}}}}},
        "responses": {"200": {"description": "The engine's answer (JSON, or server-sent "
                                             "events when stream is true).",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {"schema": {"type": "string"}}}}}}


@router.post("/v1/engines", status_code=201, tags=["engines"])
async def register_engine(body: EngineIn, gw: GatewayState, who: Caller) -> dict[str, Any]:
    """Add an engine to route to (admin); checked now, then every few seconds."""
    who.require("admin")
    tenants = body.tenants if body.tenants is not None else (
        [who.tenant] if who.tenant is not None else ["*"])
    engine = await (await door_of(gw)).registry.register(
        body.url, model=body.model, node=body.node, engine_id=body.engine_id,
        priority_scheduling=body.priority_scheduling, max_requests=body.max_requests,
        tenants=None if "*" in tenants else frozenset(tenants))
    return engine.document()


@router.get("/v1/engines", tags=["engines"])
async def list_engines(gw: GatewayState, who: Caller) -> dict[str, Any]:
    who.require("admin")
    return {"engines": [e.document() for e in (await door_of(gw)).registry.engines()]}


@router.delete("/v1/engines/{engine_id}", status_code=204, tags=["engines"])
async def unregister_engine(engine_id: str, gw: GatewayState, who: Caller) -> Response:
    who.require("admin")
    if (await door_of(gw)).registry.get(engine_id) is None:
        raise NotFoundError(f"no engine {engine_id!r} is registered")
    await (await door_of(gw)).registry.unregister(engine_id)
    return Response(status_code=204)


@router.get("/v1/models")
async def models(gw: GatewayState, who: Caller) -> dict[str, Any]:
    """The models the caller's healthy engines serve (OpenAI's list shape)."""
    who.require("read")
    served = sorted({e.model for e in (await door_of(gw)).registry.serving(who.tenant)
                     if e.healthy})
    return {"object": "list",
            "data": [{"id": m, "object": "model", "owned_by": "memkv"} for m in served]}


@router.post("/v1/chat/completions", openapi_extra=_body_schema("messages"))
async def chat_completions(request: Request, gw: GatewayState, who: Caller) -> Response:
    return await _forward(request, gw, who, "/v1/chat/completions", "messages")


@router.post("/v1/completions", openapi_extra=_body_schema("prompt"))
async def completions(request: Request, gw: GatewayState, who: Caller) -> Response:
    return await _forward(request, gw, who, "/v1/completions", "prompt")


async def _forward(request: Request, gw: Gateway, who: Any, path: str, needs: str) -> Response:
    who.require("write")
    door = await door_of(gw)
    read = await read_request(request, door, who, path, needs)
    if isinstance(read, JSONResponse):
        return read
    body, model, hints = read
    routed = await routed_session(gw, door, who, session_of(request, body))
    if routed.sid is not None:
        await before_turn(gw, door, routed.sid)
    body.pop("memkv", None)
    sent = await send_to_engine(door, model, path, body, routed, forwarded_headers(request))
    if isinstance(sent, set):
        return no_engine(model, sent)
    answer, relay = sent
    media = answer.headers.get("content-type", "application/json")
    headers = {ENGINE_HEADER: relay.engine.engine_id}
    after = BackgroundTasks()
    if body.get("stream") is not True:
        try:
            content = await answer.aread()
        finally:
            await relay.close()
        if routed.sid is not None and answer.status_code == 200:
            after.add_task(after_turn, gw, door, routed.sid, hints)
        return Response(content, status_code=answer.status_code, media_type=media,
                        headers=headers, background=after)
    after.add_task(relay.close)
    if routed.sid is not None and answer.status_code == 200:
        after.add_task(after_turn, gw, door, routed.sid, hints)
    return StreamingResponse(relay.events(), status_code=answer.status_code, media_type=media,
                             headers=headers, background=after)
