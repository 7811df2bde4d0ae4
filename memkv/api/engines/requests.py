"""What every front-door route reads of a request: the gateway's front door, the
request's session (memkv's fields, else OpenAI's and the routers' conventions),
where that session's KV is, the headers an engine gets, OpenAI's error shape."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse

from memkv.api.context import Gateway, Principal, scoped
from memkv.api.engines.dispatch import Routed
from memkv.api.engines.front_door import FrontDoor
from memkv.api.engines.hints import TurnHints
from memkv.errors import InvalidInputError, MemkvError
from memkv.protocol.ids import hashed_session_id, is_session_id
from memkv.protocol.responses import OpenAIDocument

__all__ = [
    "ENGINE_HEADER",
    "door_of",
    "forwarded_headers",
    "no_engine",
    "openai_error",
    "read_request",
    "routed_session",
    "session_of",
    "unknown_model",
]

SESSION_HEADER = "x-memkv-session"
#: The session header routers and benchmarks send (vLLM's ``--send-conversation-id``).
ROUTER_SESSION_HEADER = "x-session-id"
#: Which engine served the request (the answer's header).
ENGINE_HEADER = "X-Memkv-Engine"
#: Headers of the caller's request that are not the engine's business.
_HOP_HEADERS = {"host", "authorization", "content-length", "connection", SESSION_HEADER,
                "accept-encoding", "transfer-encoding"}


def openai_error(status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> JSONResponse:
    """OpenAI's error shape (``error.message``, ``type``), with memkv's ``status`` too."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": None, "status": status}}, status_code=status)


def unknown_model(model: str) -> JSONResponse:
    return openai_error(404, f"the model {model!r} does not exist (GET /v1/models lists them)",
                        "not_found_error")


def no_engine(model: str, tried: set[str]) -> JSONResponse:
    return openai_error(503, f"no healthy engine could take a request for {model!r}"
                        + (f" (tried {sorted(tried)})" if tried else ""), "service_unavailable")


async def read_request(request: Request, door: FrontDoor, who: Principal, path: str,
                       needs: str) -> tuple[OpenAIDocument, str, TurnHints] | JSONResponse:
    """A front-door request's body, its model and its turn's hints; or the error that
    answers it (OpenAI's shape): not a JSON object, no model or no ``needs`` (400), a
    model none of the caller's engines serve (404), hints out of range (422)."""
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        return openai_error(400, f"the body is not JSON: {e}")
    if not isinstance(body, dict):
        return openai_error(400, "the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return openai_error(400, "'model' is required: a model name of GET /v1/models")
    if needs not in body:
        return openai_error(400, f"'{needs}' is required for {path}")
    if not any(e.model == model for e in door.registry.serving(who.tenant)):
        return unknown_model(model)
    try:
        hints = TurnHints.of(body)
    except InvalidInputError as e:
        return openai_error(422, str(e), param="memkv")
    return body, model, hints


async def door_of(gw: Gateway) -> FrontDoor:
    if gw.door is None:
        raise MemkvError("this gateway has no front door")
    await gw.door.ready()
    return gw.door


def forwarded_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}


def session_of(request: Request, body: OpenAIDocument, chained: str | None = None) -> str | None:
    """The request's session, from the first of (memkv's own, then OpenAI's and the
    routers' conventions, so that a stock client or agent SDK needs no memkv code):
    the ``X-Memkv-Session`` header, the body's ``memkv.session_id``, its
    ``prompt_cache_key``, its ``conversation`` (an id, or ``{"id": ...}``), the session
    of the response it continues (``chained``: ``previous_response_id``'s), the
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
    for found in (body.get("prompt_cache_key"), conversation):
        if isinstance(found, str) and found:
            return found if is_session_id(found) else hashed_session_id(found)
    if chained is not None:
        return chained
    for found in (request.headers.get(ROUTER_SESSION_HEADER), body.get("user")):
        if isinstance(found, str) and found:
            return found if is_session_id(found) else hashed_session_id(found)
    return None


async def routed_session(gw: Gateway, door: FrontDoor, who: Principal,
                         session: str | None) -> Routed:
    """What the engine is told of ``session`` (the caller's id; None: no session)."""
    sid = scoped(who, session, "write") if session else None
    kv_node, priority = await _kv_node(gw, door, sid) if sid else (None, "normal")
    return Routed(session=session, sid=sid, kv_node=kv_node, priority=priority,
                  tenant=who.tenant, namespace=who.write_namespace(None))


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
