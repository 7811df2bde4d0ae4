"""The gateway's OpenAI front door against two stand-in engines (real uvicorn servers
speaking vLLM's OpenAI API, /health and /metrics), the gateway over a real router
and device without Ray, driven with httpx and the official ``openai`` client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from memkv.api.app import create_app
from memkv.api.engines.front_door import EngineSpec
from memkv.protocol.ids import hashed_session_id
from memkv.protocol.layout import KVLayout
from memkv.protocol.services import CreateSession, LayoutSpec

from ..fakes import FakeHandle, device_and_router
from ..test_gateway_fakes import _Server

MODEL = "agent-llama"
LAYOUT = KVLayout("front-door", 2, 2, 8, block_tokens=4)


class FakeEngine:
    """What a ``vllm serve`` answers, with switches for faults."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[dict[str, Any]] = []
        self.healthy = True
        self.die_mid_stream = False
        self.running = 0
        #: Set: streams go on past their first event; clear: they wait there.
        self.gate = threading.Event()
        self.gate.set()
        self.stream_cancelled = threading.Event()
        app = FastAPI()

        @app.get("/health")
        async def health() -> Any:
            return PlainTextResponse("", status_code=200 if self.healthy else 503)

        @app.get("/metrics")
        async def metrics() -> Any:
            return PlainTextResponse(
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.running}\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.25\n'
                # memkv's connector counters (memkv.integrations.vllm.metrics)
                "# TYPE vllm:memkv_save_blocks counter\n"
                f'vllm:memkv_save_blocks_total{{model_name="{MODEL}"}} 40\n'
                "# TYPE vllm:memkv_save_skipped_blocks counter\n"
                f'vllm:memkv_save_skipped_blocks_total{{model_name="{MODEL}"}} 3\n'
                "# TYPE vllm:memkv_save_skipped_blocks_memkv_error counter\n"
                f'vllm:memkv_save_skipped_blocks_memkv_error_total{{model_name="{MODEL}"}} 3\n')

        @app.get("/v1/models")
        async def models() -> Any:
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await request.json()
            self.seen.append(body)
            if not body.get("stream"):
                return JSONResponse({
                    "id": f"cmpl-{self.name}", "object": "chat.completion", "created": 0,
                    "model": MODEL, "choices": [{"index": 0, "finish_reason": "stop",
                                                 "message": {"role": "assistant",
                                                             "content": f"hi from {self.name}"}}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})

            async def events() -> Any:
                try:
                    for i, word in enumerate(["hi", " from", f" {self.name}"]):
                        if self.die_mid_stream and i == 2:
                            raise RuntimeError("the engine died")  # the connection drops
                        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0,
                                 "model": MODEL, "choices": [{"index": 0,
                                                              "delta": {"content": word},
                                                              "finish_reason": None}]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                        while not self.gate.is_set():  # (a thread sets it; nothing to await)
                            await asyncio.sleep(0.005)
                        await asyncio.sleep(0.01)
                    yield "data: [DONE]\n\n"
                except asyncio.CancelledError:  # the caller (the gateway) went away
                    self.stream_cancelled.set()
                    raise

            return StreamingResponse(events(), media_type="text/event-stream")

        self.server = _Server(app)
        self.url = self.server.url


@contextlib.contextmanager
def _gateway(tmp_path, name: str, standins: Sequence[FakeEngine],
             **options: Any) -> Iterator[tuple[_Server, Any, Any, Any]]:
    """A gateway (real router and device, no Ray) with ``create_app``'s ``options``:
    ``(server, router, loop, device)``; it and the ``standins`` are stopped after."""
    device, router, loop = device_and_router(tmp_path / "cold", name, unit=4096, blocks=8)
    gateway = _Server(create_app(FakeHandle(router), max_body_bytes=1 << 20,
                                 same_node_reads=False, put_object=lambda payload: payload,
                                 **options))
    try:
        yield gateway, router, loop, device
    finally:
        for engine in standins:
            engine.server.stop()
        gateway.stop()
        device.close()
        loop.close()


@pytest.fixture
def door(tmp_path):
    engines = [FakeEngine("a"), FakeEngine("b")]
    with _gateway(tmp_path, "door-dev", engines, node_id="gateway-node") as (
            gateway, router, loop, device), httpx.Client(base_url=gateway.url, timeout=30) as http:
        for engine, node in zip(engines, ("node-a", device.node_id), strict=True):
            made = http.post("/v1/engines", json={"url": engine.url, "node": node,
                                                  "engine_id": engine.name})
            assert made.status_code == 201 and made.json()["healthy"], made.text
        yield http, engines, router, loop, device


def _chat(http: httpx.Client, session: str | None, **extra: Any) -> httpx.Response:
    headers = {"X-Memkv-Session": session} if session else {}
    return http.post("/v1/chat/completions", headers=headers, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hello"}], **extra})


def test_models_and_a_session_sticking_to_its_engine_with_its_kv_params(door):
    http, engines, *_ = door
    assert http.get("/v1/models").json()["data"] == [
        {"id": MODEL, "object": "model", "owned_by": "memkv"}]
    first = _chat(http, "agent-1")
    assert first.status_code == 200, first.text
    served_by = first.json()["choices"][0]["message"]["content"].split()[-1]
    for _ in range(3):  # every turn of the session on the same engine
        assert _chat(http, "agent-1").json()["choices"][0]["message"]["content"].endswith(
            served_by)
    engine = next(e for e in engines if e.name == served_by)
    params = engine.seen[-1]["kv_transfer_params"]
    assert params["session_id"] == "agent-1" and params["priority"] == "normal"
    assert "memkv" not in engine.seen[-1]
    metrics = http.get("/metrics").text
    assert f'memkv_routed_requests_total{{engine="{served_by}",reason="sticky"}} 3.0' in metrics


def test_a_session_goes_to_the_engine_on_the_node_of_its_kv(door):
    http, engines, router, loop, device = door
    # A memkv session with blocks on the device (whose node engine b runs on).
    sid = "kv-near"
    loop.run_until_complete(router.create_session(CreateSession(
        session_id=sid, layout=LayoutSpec.of(LAYOUT), namespace="default")))
    from memkv.protocol.hashing import chain_hashes
    from memkv.protocol.services import AppendTurn
    from memkv.storage.layout import split_kv
    from memkv.storage.payloads import to_payload
    from tests.kvdata import random_kv

    keys, values = random_kv(LAYOUT, 8, 1)
    chain = [bytes(k) for k in chain_hashes(list(range(8)), LAYOUT, "default")]
    payloads = [to_payload(k, b) for k, b in zip(chain, split_kv(LAYOUT, keys, values),
                                                  strict=True)]
    loop.run_until_complete(router.put_blocks(
        AppendTurn(session_id=sid, token_ids=AppendTurn.pack_tokens(list(range(8)))), payloads))
    answer = _chat(http, sid)
    assert answer.json()["choices"][0]["message"]["content"] == "hi from b"
    assert 'reason="kv-node"' in http.get("/metrics").text


def test_streams_are_relayed_and_an_engine_dying_midway_ends_with_an_error_event(door):
    http, engines, *_ = door
    with http.stream("POST", "/v1/chat/completions", headers={"X-Memkv-Session": "s1"},
                     json={"model": MODEL, "messages": [], "stream": True}) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 4
    engine = next(e for e in engines if e.seen and e.seen[-1].get("stream"))
    engine.die_mid_stream = True
    with http.stream("POST", "/v1/chat/completions", headers={"X-Memkv-Session": "s1"},
                     json={"model": MODEL, "messages": [], "stream": True}) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert len(events) == 3 and "engine_error" in events[-1]
    assert "failed mid-stream" in json.loads(events[-1][6:])["error"]["message"]


def test_a_request_to_a_dead_engine_goes_to_the_other_and_the_dead_one_leaves_routing(door):
    http, engines, *_ = door
    first = _chat(http, "agent-f")
    served_by = first.json()["choices"][0]["message"]["content"].split()[-1]
    dead = next(e for e in engines if e.name == served_by)
    dead.server.stop()
    answer = _chat(http, "agent-f")
    assert answer.status_code == 200
    assert not answer.json()["choices"][0]["message"]["content"].endswith(served_by)
    listed = {e["id"]: e for e in http.get("/v1/engines").json()["engines"]}
    assert not listed[served_by]["healthy"]
    assert f'memkv_routing_failovers_total{{engine="{served_by}"}} 1.0' in http.get(
        "/metrics").text


def test_bad_requests_answer_in_openais_error_shape(door):
    http, *_ = door
    bad = http.post("/v1/chat/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
    missing = http.post("/v1/chat/completions", json={"messages": []})
    assert missing.status_code == 400 and "'model' is required" in missing.json()["error"][
        "message"]
    unknown = http.post("/v1/chat/completions", json={"model": "gpt-nope", "messages": []})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    no_prompt = http.post("/v1/completions", json={"model": MODEL})
    assert no_prompt.status_code == 400 and "'prompt'" in no_prompt.json()["error"]["message"]
    engine = http.post("/v1/engines", json={"url": "ftp://nope"})
    assert engine.status_code == 422


def test_the_official_openai_client_sync_and_streaming(door):
    openai = pytest.importorskip("openai")
    http, *_ = door
    client = openai.OpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}],
        extra_body={"memkv": {"session_id": "sdk-agent"}})
    assert reply.choices[0].message.content.startswith("hi from")
    words = [chunk.choices[0].delta.content for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
        user="sdk-agent") if chunk.choices]
    assert "".join(w for w in words if w).startswith("hi from")
    assert [m.id for m in client.models.list()] == [MODEL]


def test_stock_clients_get_sessions_from_openais_own_fields(door):
    """[6/6] item 1: no memkv code in the agent. A plain ``openai`` client's
    ``prompt_cache_key``, a Responses-style ``conversation``, the ``X-Session-ID``
    routers send and ``user`` each name a session (a string that is no session id
    by its hash), and every turn of it sticks to one engine with its KV params."""
    openai = pytest.importorskip("openai")
    http, engines, *_ = door
    client = openai.OpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="unused")
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

    def turns(**extra: Any) -> set[str]:
        served = set()
        for _ in range(3):
            reply = client.chat.completions.create(**ask, **extra)
            served.add(reply.choices[0].message.content.split()[-1])
        return served

    expected = {
        "pck": ({"prompt_cache_key": "agent-7"}, "agent-7"),
        "conversation": ({"extra_body": {"conversation": {"id": "conv_abc123"}}},
                         "conv_abc123"),
        "router header": ({"extra_headers": {"X-Session-ID": "bench conv 4"}},
                          hashed_session_id("bench conv 4")),
        "user": ({"user": "alice@example.com"}, "alice@example.com"),
    }
    for what, (extra, session) in expected.items():
        for engine in engines:
            engine.seen.clear()
        assert len(turns(**extra)) == 1, what  # every turn on one engine
        (engine,) = [e for e in engines if e.seen]
        assert {b["kv_transfer_params"]["session_id"] for b in engine.seen} == {session}, what
    # memkv's own field comes first; a bad id there is refused (422), as on every route.
    for engine in engines:
        engine.seen.clear()
    client.chat.completions.create(**ask, prompt_cache_key="other",
                                   extra_headers={"X-Memkv-Session": "mine"})
    assert [b["kv_transfer_params"]["session_id"] for e in engines for b in e.seen] == ["mine"]
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(**ask, extra_headers={"X-Memkv-Session": "bad id"})


def test_engines_of_the_configuration_are_registered_on_first_use(tmp_path):
    engine = FakeEngine("configured")
    down = "http://127.0.0.1:9"  # nothing listens: tried again on the next request
    with _gateway(tmp_path, "door-cfg", [engine],
                  engines=[EngineSpec(engine.url), EngineSpec(down)]) as (gateway, *_), \
            httpx.Client(base_url=gateway.url, timeout=30) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]
        assert _chat(http, "cfg").json()["choices"][0]["message"]["content"] == (
            "hi from configured")
        assert [e["url"] for e in http.get("/v1/engines").json()["engines"]] == [engine.url]


def test_the_stats_and_memkv_status_show_each_engine_and_what_was_routed_to_it(door):
    from rich.console import Console

    from memkv.status_view import status_tables

    http, *_ = door
    assert _chat(http, "shown").status_code == 200
    stats = http.get("/v1/stats").json()
    engines = {e["id"]: e for e in stats["gateway"]["engines"]}
    assert set(engines) == {"a", "b"} and all(e["healthy"] for e in engines.values())
    assert sum(sum(e["routed"].values()) for e in engines.values()) == 1
    console = Console(record=True, width=160)
    console.print(status_tables(stats))
    shown = console.export_text()
    assert "engines (OpenAI front door)" in shown and "least-loaded 1" in shown
    assert "tenants" in shown and " all " in shown  # (auth off: every tenant's)
    # What each engine's memkv connector saved and did not, with why.
    assert all(e["connector"]["save_skipped_blocks"] == 3 for e in engines.values())
    assert "40 / 3 (memkv error 3)" in shown


def test_a_sessions_priority_goes_to_an_engine_that_schedules_by_priority(door):
    http, engines, router, loop, _ = door
    for sid, priority in (("vip", "high"), ("batch", "background")):
        loop.run_until_complete(router.create_session(CreateSession(
            session_id=sid, layout=LayoutSpec.of(LAYOUT), namespace="default")))
        loop.run_until_complete(router.set_priority(sid, priority))
    http.delete("/v1/engines/a")
    http.delete("/v1/engines/b")
    made = http.post("/v1/engines", json={"url": engines[0].url, "engine_id": "prio",
                                          "priority_scheduling": True})
    assert made.status_code == 201 and made.json()["priority_scheduling"]
    for sid, expected in (("vip", -1), ("batch", 1), ("unknown-session", 0)):
        assert _chat(http, sid).status_code == 200
        assert engines[0].seen[-1]["priority"] == expected, sid
        assert engines[0].seen[-1]["kv_transfer_params"]["priority"] in (
            "high", "background", "normal")


def test_requests_in_flight_spill_a_session_past_its_engine_s_bound_and_leaving_cancels(door):
    http, engines, *_ = door
    a, b = engines
    # Engine a takes one request at a time (its own bound, under the gateway's 32).
    again = http.post("/v1/engines", json={"url": a.url, "node": "node-a", "engine_id": "a",
                                           "max_requests": 1})
    assert again.status_code == 201 and again.json()["max_requests"] == 1
    assert "hi from a" in _chat(http, "agent-s").text  # least loaded: a (by name)
    a.gate.clear()
    with http.stream("POST", "/v1/chat/completions", headers={"X-Memkv-Session": "agent-s"},
                     json={"model": MODEL, "messages": [], "stream": True}) as held:
        lines = held.iter_lines()  # (kept: dropping the iterator closes the connection)
        assert next(lines).startswith("data: ")  # a is busy with it
        listed = {e["id"]: e for e in http.get("/v1/engines").json()["engines"]}
        assert listed["a"]["inflight"] == 1
        spilled = _chat(http, "agent-s")  # a is at its bound: the turn goes to b
        assert spilled.headers["x-memkv-engine"] == "b", spilled.text
    # The caller left mid-stream: the gateway closed a's connection, a dropped it.
    assert a.stream_cancelled.wait(10), "the engine's stream was not cancelled"
    deadline = time.monotonic() + 10
    while http.get("/v1/engines").json()["engines"][0]["inflight"] != 0:
        assert time.monotonic() < deadline, "the in-flight count never came back to 0"
        time.sleep(0.02)
    a.gate.set()
    assert 'memkv_routed_requests_total{engine="b",reason="spill"} 1.0' in http.get(
        "/metrics").text
    # Now on b, the session stays there (sticky) even with a free again.
    assert _chat(http, "agent-s").headers["x-memkv-engine"] == "b"


def test_engines_take_their_tenants_requests_only_each_under_its_own_cache_salt(tmp_path):
    from memkv.api.auth import Authenticator, TokenEntry, hash_token

    auth = Authenticator([
        TokenEntry(hash_token("tok-acme"), "acme", frozenset({"write", "read", "admin"})),
        TokenEntry(hash_token("tok-ops"), "ops", frozenset({"write", "read", "admin"})),
        TokenEntry(hash_token("tok-evil"), "evil", frozenset({"write", "read"})),
    ])
    acme_engine, shared = FakeEngine("acme-only"), FakeEngine("shared")
    with _gateway(tmp_path, "door-auth", [acme_engine, shared], auth=auth) as (gateway, *_):

        def as_(token: str) -> httpx.Client:
            return httpx.Client(base_url=gateway.url, timeout=30,
                                headers={"Authorization": f"Bearer {token}"})

        with as_("tok-acme") as acme, as_("tok-ops") as ops, as_("tok-evil") as evil:
            # acme's engine serves acme (the registering token's tenant, by default).
            made = acme.post("/v1/engines", json={"url": acme_engine.url,
                                                  "engine_id": "acme-only"})
            assert made.status_code == 201 and made.json()["tenants"] == ["acme"]
            assert evil.post("/v1/engines", json={"url": shared.url}).status_code == 403
            assert httpx.post(f"{gateway.url}/v1/chat/completions", json={
                "model": MODEL, "messages": []}).status_code == 401
            assert evil.get("/v1/models").json()["data"] == []
            refused = _chat(evil, "agent-1")
            assert refused.status_code == 404 and refused.json()["error"]["type"] == (
                "not_found_error")
            assert acme_engine.seen == []  # nothing of evil's reached acme's engine
            # A shared engine (ops registers it for every tenant) takes both, each tenant's
            # prompts under a salt of its own, which no caller's salt can reach across.
            made = ops.post("/v1/engines", json={"url": shared.url, "engine_id": "shared",
                                                 "tenants": ["*"]})
            assert made.status_code == 201 and made.json()["tenants"] is None
            assert _chat(evil, "agent-1").headers["x-memkv-engine"] == "shared"
            assert _chat(ops, "agent-1", cache_salt="mine").headers["x-memkv-engine"] == (
                "shared")
            evil_salt, ops_salt = (body["cache_salt"] for body in shared.seen[-2:])
            assert evil_salt != ops_salt.split(":")[0] and ops_salt.endswith(":mine")


def test_an_engine_that_fails_its_checks_leaves_routing_and_one_that_comes_back_resumes(
        tmp_path):
    from memkv.api.engines.front_door import FrontDoorOptions

    a, b = FakeEngine("a"), FakeEngine("b")

    def healthy_now(http: httpx.Client) -> dict[str, bool]:
        return {e["id"]: e["healthy"] for e in http.get("/v1/engines").json()["engines"]}

    def wait_for(http: httpx.Client, wanted: dict[str, bool]) -> None:
        deadline = time.monotonic() + 10
        while healthy_now(http) != wanted:
            assert time.monotonic() < deadline, f"engines never became {wanted}"
            time.sleep(0.02)

    fast_checks = FrontDoorOptions(check_interval_s=0.05, failures_to_down=2)
    with _gateway(tmp_path, "door-back", [a, b], routing=fast_checks) as (gateway, *_), \
            httpx.Client(base_url=gateway.url, timeout=30) as http:
        for engine in (a, b):
            assert http.post("/v1/engines", json={"url": engine.url,
                                                  "engine_id": engine.name}).status_code == 201
        assert _chat(http, "back").headers["x-memkv-engine"] == "a"
        a.healthy = False  # /health answers 503 from now on
        wait_for(http, {"a": False, "b": True})
        assert _chat(http, "back").headers["x-memkv-engine"] == "b"  # its turns move
        a.healthy = True
        wait_for(http, {"a": True, "b": True})
        # Back in routing: a new session goes to the least loaded of the two again.
        assert _chat(http, "another").headers["x-memkv-engine"] == "a"
