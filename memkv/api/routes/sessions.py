"""The session lifecycle: create, look up, delete, suspend, resume, input end."""

from __future__ import annotations

from fastapi import APIRouter, Response

from memkv.api.answers import PrefetchOut, documented, message_answer
from memkv.api.context import Caller, GatewayState, scoped
from memkv.api.models import ForkIn, RewindIn, SessionCreate, SessionIdPath, SuspendIn
from memkv.protocol.enums import parse_ack, parse_priority
from memkv.protocol.forks import fork_request
from memkv.protocol.layout import KVLayout
from memkv.protocol.services import (
    CreateSession,
    LayoutSpec,
    Quota,
    ResumeAnswer,
    RewindSession,
    SessionView,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


_SESSION = documented(SessionView, "The session.")


@router.post("", status_code=201, responses={201: documented(SessionView, "Created.")})
async def create_session(body: SessionCreate, gw: GatewayState, who: Caller) -> Response:
    sid = scoped(who, body.session_id, "write")
    namespace = who.write_namespace(body.namespace)
    layout = KVLayout.from_dict(body.layout.model_dump())
    request = CreateSession(
        session_id=sid, layout=LayoutSpec.of(layout), namespace=namespace,
        priority=parse_priority(body.priority), ack=parse_ack(body.ack),
        quota=Quota.of(who.quota), exact_only=body.exact_only, finite_only=body.finite_only,
        near_node=gw.this_node if body.near == "gateway" else body.near,
    )
    view = await gw.routers.service(sid).create_session(request)
    return message_answer(view, 201, session_id=body.session_id)


@router.get("/{session_id}", responses={200: _SESSION})
async def get_session(session_id: SessionIdPath, gw: GatewayState, who: Caller) -> Response:
    sid = scoped(who, session_id, "read")
    return message_answer(await gw.routers.service(sid).session(sid), session_id=session_id)


@router.delete("/{session_id}", status_code=204)
async def delete_session(session_id: SessionIdPath, gw: GatewayState, who: Caller) -> Response:
    sid = scoped(who, session_id, "write")
    await gw.let_go_of(sid)
    gw.sessions.drop(sid)
    gw.routes.drop(sid)
    await gw.routers.service(sid).delete_session(sid)
    return Response(status_code=204)


@router.post("/{session_id}/fork", status_code=201,
             responses={201: documented(SessionView, "The new session.")})
async def fork_session(
    session_id: SessionIdPath, body: ForkIn, gw: GatewayState, who: Caller
) -> Response:
    """A new session holding the first ``at_tokens`` tokens of this one: its blocks are
    shared (reference counts), not copied, but a partial last block's, once."""
    sid = scoped(who, session_id, "write")
    new_sid = scoped(who, body.new_id, "write")
    parent = await gw.routers.service(sid).session(sid)
    request = fork_request(parent, new_sid, body.at_tokens, tail_tokens=body.tail_tokens,
                           quota=Quota.of(who.quota))
    view = await gw.routers.service(new_sid).fork_session(request)
    return message_answer(view, 201, session_id=body.new_id)


@router.post("/{session_id}/rewind", responses={200: _SESSION})
async def rewind_session(
    session_id: SessionIdPath, body: RewindIn, gw: GatewayState, who: Caller
) -> Response:
    """Keep the session's first ``tokens`` tokens (a new turn); the blocks after them
    are let go once no other session and no read in flight holds them."""
    sid = scoped(who, session_id, "write")
    await gw.let_go_of(sid)
    gw.sessions.drop(sid)
    gw.routes.drop(sid)
    tail = tuple(body.tail_tokens) if body.tail_tokens is not None else None
    view = await gw.routers.service(sid).rewind_session(
        RewindSession(session_id=sid, tokens=body.tokens, tail_tokens=tail))
    return message_answer(view, session_id=session_id)


@router.post("/{session_id}/suspend", responses={200: _SESSION})
async def suspend(
    session_id: SessionIdPath, gw: GatewayState, who: Caller, body: SuspendIn | None = None
) -> Response:
    sid = scoped(who, session_id, "write")
    offline = body.offline if body is not None else False
    await gw.let_go_of(sid)
    view = await gw.routers.service(sid).suspend(sid, offline)
    return message_answer(view, session_id=session_id)


@router.post("/{session_id}/resume",
             responses={200: documented(ResumeAnswer, "Where each block is.")})
async def resume(session_id: SessionIdPath, gw: GatewayState, who: Caller) -> Response:
    sid = scoped(who, session_id, "write")
    answer = await gw.routers.service(sid).resume(sid)
    return message_answer(answer, session_id=session_id)


@router.post("/{session_id}/input-end")
async def input_end(session_id: SessionIdPath, gw: GatewayState, who: Caller) -> PrefetchOut:
    """A turn's input is complete: prefetch the session's cache now.

    Needs the ``write`` role: the prefetch moves blocks between tiers and may
    evict other sessions' blocks to make room (a read-only token only reads)."""
    sid = scoped(who, session_id, "write")
    return PrefetchOut(prefetched=await gw.routers.service(sid).notify_input_end(sid))
