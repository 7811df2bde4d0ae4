"""OpenAI's Responses API, stateful across engines: ``POST /v1/responses``,
``GET``/``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A request is answered by an engine as a chat completion
(:mod:`memkv.api.responses.items`); a request that continues a chain
(``previous_response_id``) is sent with the chain's whole input, so any engine
can continue it, and loads its prefix from memkv. Each response is stored
(unless ``store`` is false) with its session, by the session's router shard,
durably, before it is answered (:mod:`memkv.router.responses`).

The session of a response: memkv's own fields, ``prompt_cache_key``,
``conversation``, the session of ``previous_response_id`` (a session of its own
for a branch: a continuation of a response its session has gone on from),
``X-Session-ID``, ``user`` (:func:`memkv.api.engines.requests.session_of`); else
the session of an earlier conversation whose history the input repeats (an agent
that resends its history each turn), else a new one. A response id names its session
(:mod:`memkv.protocol.responses`), so another tenant's id is a 404 like an unknown one.
"""

from __future__ import annotations

import json
import secrets
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTasks

from memkv.api.context import Caller, Gateway, GatewayState, Principal, scoped
from memkv.api.engines.dispatch import send_to_engine
from memkv.api.engines.front_door import FrontDoor
from memkv.api.engines.hints import after_turn, before_turn
from memkv.api.engines.requests import (
    ENGINE_HEADER,
    door_of,
    forwarded_headers,
    no_engine,
    openai_error,
    read_request,
    routed_session,
    session_of,
)
from memkv.api.responses.chains import StoredTurn
from memkv.api.responses.events import ResponseEvents, chat_chunks
from memkv.api.responses.items import (
    Item,
    chat_request,
    input_items,
    output_items,
    response_object,
    usage_of,
)
from memkv.errors import InvalidInputError
from memkv.protocol.ids import scoped_session_id
from memkv.protocol.responses import (
    UnknownResponseError,
    new_response_id,
    session_of_response,
)

__all__ = ["router"]

router = APIRouter(tags=["openai"])

_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["model", "input"], "additionalProperties": True,
    "properties": {"model": {"type": "string", "minLength": 1},
                   "input": {"anyOf": [{"type": "string"}, {"type": "array"}]},
                   "instructions": {"type": "string"},
                   "previous_response_id": {"type": "string"},
                   "store": {"type": "boolean"}, "stream": {"type": "boolean"},
                   "tools": {"type": "array"}}}}}},
    "responses": {"200": {"description": "The response (JSON), or its events (server-sent "
                                         "events) when stream is true.",
                          "content": {"application/json": {"schema": {"type": "object"}},
                                      "text/event-stream": {"schema": {"type": "string"}}}}}}


class _Turn:
    """One Responses request on its way: the caller, its session, its items."""

    def __init__(self, who: Principal, body: Item, session: str, new_items: list[Item],
                 history: list[Item]) -> None:
        self.who, self.body, self.session = who, body, session
        self.sid = scoped(who, session, "write")
        self.new_items, self.items = new_items, [*history, *new_items]
        self.response_id = new_response_id(session)
        self.created_at = int(time.time())
        self.store = body.get("store", True) is not False

    async def finish(self, gw: Gateway, door: FrontDoor, response: Item) -> None:
        """Store the response (if asked, and not failed) and remember its history."""
        turn = None
        if self.store and response["status"] != "failed":
            stored = StoredTurn.encode(self.response_id, self.body.get("previous_response_id"),
                                       self.created_at, self.new_items, response)
            await gw.routers.service(self.sid).put_response(self.sid, stored)
            turn = StoredTurn(stored)
        door.chains.remember(self.sid, self.response_id, turn, _tenant_prefix(self.who),
                             self.session, self.items, response["output"])


def _tenant_prefix(who: Principal) -> str:
    return scoped_session_id(who.tenant, "x")[:-1]  # "<tenant>/", or ""


async def _turn(request: Request, gw: Gateway, who: Principal, door: FrontDoor,
                body: Item) -> _Turn:
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise InvalidInputError("'previous_response_id' must be a string")
    history = await door.chains.history(
        gw.routers, lambda s: scoped(who, s, "read"), previous) if previous else []
    new_items = input_items(body.get("input"))
    chained = session_of_response(previous) if previous else None
    if chained is not None and previous is not None and door.chains.branches(
            scoped(who, chained, "read"), previous):
        # A branch (a retry, another plan) from an earlier response: its own session, so
        # that its turns do not replace the other branch's chain (its prefix is shared
        # by content, as any stored block is).
        chained = f"{chained[:240]}.b{secrets.token_hex(4)}"
    session = session_of(request, body, chained)
    if session is None:
        session = door.chains.session_by_history(_tenant_prefix(who), [*history, *new_items])
    return _Turn(who, body, session or f"chain-{secrets.token_hex(12)}", new_items, history)


@router.post("/v1/responses", openapi_extra=_BODY)
async def create_response(request: Request, gw: GatewayState, who: Caller) -> Response:
    """A model response (OpenAI's Responses API), continuing ``previous_response_id``'s
    chain on any engine; stored with its session unless ``store`` is false."""
    who.require("write")
    door = await door_of(gw)
    read = await read_request(request, door, who, "/v1/responses", "input")
    if isinstance(read, JSONResponse):
        return read
    body, model, hints = read
    try:
        turn = await _turn(request, gw, who, door, body)
        chat = chat_request(body, turn.items)
    except UnknownResponseError as e:
        return openai_error(404, str(e), "not_found_error", "previous_response_id")
    except InvalidInputError as e:
        return openai_error(400, str(e))
    routed = await routed_session(gw, door, who, turn.session)
    await before_turn(gw, door, turn.sid)
    after = BackgroundTasks()
    sent = await send_to_engine(door, model, "/v1/chat/completions", chat, routed,
                                forwarded_headers(request))
    if isinstance(sent, set):
        return no_engine(model, sent)
    answer, relay = sent
    headers = {ENGINE_HEADER: relay.engine.engine_id}
    if answer.status_code != 200:
        try:
            content = await answer.aread()
        finally:
            await relay.close()
        return Response(content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type"), headers=headers)
    if not chat.get("stream"):
        try:
            completion = json.loads(await answer.aread())
        finally:
            await relay.close()
        choice = (completion.get("choices") or [{}])[0]
        response = response_object(turn.response_id, body, output_items(choice),
                                   usage_of(completion.get("usage")),
                                   finish_reason=choice.get("finish_reason"),
                                   created_at=turn.created_at)
        await turn.finish(gw, door, response)
        after.add_task(after_turn, gw, door, turn.sid, hints)
        return JSONResponse(response, headers=headers, background=after)
    events = ResponseEvents(turn.response_id, body, turn.created_at)
    stream = events.translate(chat_chunks(relay.events()),
                              on_finished=lambda response: turn.finish(gw, door, response))
    after.add_task(relay.close)
    after.add_task(after_turn, gw, door, turn.sid, hints)
    return StreamingResponse(stream, media_type="text/event-stream", headers=headers,
                             background=after)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, gw: GatewayState, who: Caller) -> Item:
    """A stored response (404: never stored, deleted, or another tenant's)."""
    turn = await (await door_of(gw)).chains.turn(
        gw.routers, lambda s: scoped(who, s, "read"), response_id)
    return turn.response


@router.get("/v1/responses/{response_id}/input_items")
async def response_input_items(response_id: str, gw: GatewayState, who: Caller) -> Item:
    """The input items of a stored response (its own, not its chain's), oldest first."""
    turn = await (await door_of(gw)).chains.turn(
        gw.routers, lambda s: scoped(who, s, "read"), response_id)
    data = [{"id": item.get("id") or f"item_{i}", **item} for i, item in enumerate(turn.input)]
    return {"object": "list", "data": data, "has_more": False,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, gw: GatewayState, who: Caller) -> Item:
    """Delete a stored response (from the router's table and journal)."""
    sid = scoped(who, session_of_response(response_id), "write")
    await gw.routers.service(sid).delete_response(sid, response_id)
    (await door_of(gw)).chains.forget(sid, response_id)
    return {"id": response_id, "object": "response", "deleted": True}
