"""Sending a front-door request to an engine: the engine chosen, the session's KV
parameters added, a failover when the engine cannot take it, the answer relayed.

Shared by the OpenAI routes (:mod:`memkv.api.routes.openai`), which relay the
engine's answer as it is, and ``/v1/responses`` (:mod:`memkv.api.routes.responses`),
which translates a chat completion into a response.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from memkv.api.engines.front_door import ATTEMPTS, FrontDoor
from memkv.api.engines.policy import choose_engine
from memkv.api.engines.registry import Engine
from memkv.protocol.responses import OpenAIDocument

__all__ = ["Relay", "Routed", "VLLM_PRIORITY", "cache_salt", "send_to_engine"]

#: A session's priority as vLLM's scheduler takes it (lower first).
VLLM_PRIORITY = {"high": -1, "normal": 0, "background": 1}
#: Statuses of an engine that did not start the request (another may).
_NOT_STARTED = (502, 503, 504)


@dataclass(frozen=True)
class Routed:
    """What the engine is told of the request's session: the caller's id (the engine's
    connector is a client of memkv with its own token, which scopes it), the router's
    scoped id (affinity), where its KV is, its priority, the tenant and its namespace."""

    session: str | None
    sid: str | None
    kv_node: str | None
    priority: str
    tenant: str | None
    namespace: str | None


def partition(engine: Engine, tenant: str | None) -> str | None:
    """Where an engine's connector keeps this tenant's KV in memkv: its own namespace for
    an engine of one tenant (None); for an engine shared by tenants, a partition per
    tenant (memkv.protocol.ids), so that one tenant's prompts never hit blocks another
    computed, in memkv either (a timing channel, as through vLLM's own prefix cache)."""
    if tenant is None or (engine.tenants is not None and engine.tenants == {tenant}):
        return None
    return hashlib.blake2b(f"memkv-tenant\0{tenant}".encode(), digest_size=12).hexdigest()


def cache_salt(tenant: str, theirs: Any) -> str:
    """The engine's prefix-cache salt for the tenant (vLLM's ``cache_salt``): engines
    share their prefix caches between requests with the same salt only, so one tenant's
    prompts never hit blocks another's computed. The caller's own salt, if any, divides
    its tenant's cache further; it can never name another tenant's."""
    salt = hashlib.sha256(f"memkv-tenant\0{tenant}".encode()).hexdigest()[:32]
    return f"{salt}:{theirs}" if isinstance(theirs, str) and theirs else salt


async def send_to_engine(door: FrontDoor, model: str, path: str, body: OpenAIDocument,
                         routed: Routed, headers: Mapping[str, str]
                         ) -> tuple[httpx.Response, Relay] | set[str]:
    """POST ``body`` to the engine the policy picks for ``routed``'s session, with its
    KV parameters; one that cannot be reached (or answers 502/503/504) is taken out of
    routing and the next is tried. Returns the engine's answer, streamed (read it, or
    relay it, then :meth:`Relay.close`), or the engines tried when none took it."""
    body = dict(body)
    if routed.session is not None:
        body["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}),
                                      "session_id": routed.session,
                                      "priority": routed.priority,
                                      "namespace": routed.namespace}
    if routed.tenant is not None:
        body["cache_salt"] = cache_salt(routed.tenant, body.get("cache_salt"))
    sid = routed.sid
    tried: set[str] = set()
    for _ in range(ATTEMPTS):
        choice = choose_engine(model, [e.load() for e in door.registry.serving(routed.tenant)],
                               sticky=door.engine_of(sid) if sid else None,
                               kv_node=routed.kv_node, spill=door.spill, avoid=frozenset(tried))
        engine = door.registry.get(choice.engine_id) if choice is not None else None
        if choice is None or engine is None:
            break
        tried.add(engine.engine_id)
        sent_body = {**body, "kv_transfer_params": {
            **(body.get("kv_transfer_params") or {}),
            "partition": partition(engine, routed.tenant)}}
        if engine.priority_scheduling and sid is not None and "priority" not in body:
            sent_body["priority"] = VLLM_PRIORITY.get(routed.priority, 0)
        engine.inflight += 1  # until its answer is read or its stream ends
        try:
            sent = door.client.build_request("POST", engine.url + path, json=sent_body,
                                             headers=dict(headers))
            answer = await door.client.send(sent, stream=True)
        except BaseException as e:
            engine.inflight -= 1
            if not isinstance(e, httpx.TransportError):
                raise  # the caller went away (cancelled) while it connected
            _not_started(door, engine, f"{type(e).__name__}: {e}")
            continue
        relay = Relay(answer, engine, door)
        if answer.status_code in _NOT_STARTED:
            await relay.close()
            _not_started(door, engine, f"HTTP {answer.status_code}")
            continue
        if sid is not None:
            door.remember(sid, engine.engine_id, choice.reason)
        return answer, relay
    return tried


def _not_started(door: FrontDoor, engine: Engine, why: str) -> None:
    """The engine could not take the request: out of routing, and counted as a failover
    (the request goes on to another engine)."""
    door.registry.mark_failed(engine.engine_id, why)
    door.metrics.failovers.labels(engine.engine_id).inc()


class Relay:
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
