"""Lifecycle hints at the front door (memkv.api.engines.hints): a long pause suspends the
session after its answer and its next turn resumes it first; a final turn makes its
blocks the first to go; hints out of range are refused with 422."""

from __future__ import annotations

import time

import httpx
import pytest

from memkv.protocol.enums import SessionState
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.services import AppendTurn, CreateSession, LayoutSpec
from memkv.storage.layout import split_kv
from memkv.storage.payloads import to_payload

from ...kvdata import random_kv
from .test_front_door import LAYOUT, MODEL, FakeEngine, _gateway


@pytest.fixture
def hinted(tmp_path):
    engine = FakeEngine("a")
    with _gateway(tmp_path, "hints-dev", [engine]) as (gateway, router, loop, device), \
            httpx.Client(base_url=gateway.url, timeout=30) as http:
        assert http.post("/v1/engines", json={"url": engine.url,
                                              "engine_id": "a"}).status_code == 201
        for sid in ("agent-1", "agent-2"):  # sessions with blocks, as a connector makes them
            loop.run_until_complete(router.create_session(CreateSession(
                session_id=sid, layout=LayoutSpec.of(LAYOUT), namespace="default")))
            tokens = list(range(8)) if sid == "agent-1" else list(range(100, 108))
            keys, values = random_kv(LAYOUT, 8, 1)
            chain = [bytes(k) for k in chain_hashes(tokens, LAYOUT, "default")]
            loop.run_until_complete(router.put_blocks(
                AppendTurn(session_id=sid, token_ids=AppendTurn.pack_tokens(tokens)),
                [to_payload(k, b) for k, b in zip(chain, split_kv(LAYOUT, keys, values),
                                                   strict=True)]))
        yield http


def _turn(http: httpx.Client, session: str, **memkv: object) -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "memkv": {"session_id": session, **memkv}})


def _becomes(http: httpx.Client, session: str, field: str, wanted: str) -> None:
    deadline = time.monotonic() + 10
    while (seen := http.get(f"/v1/sessions/{session}").json()[field]) != wanted:
        assert time.monotonic() < deadline, f"{session}'s {field} stayed {seen}"
        time.sleep(0.02)


def test_a_long_pause_suspends_and_the_next_turn_resumes_first(hinted):
    http = hinted
    assert _turn(http, "agent-1", pause={"expected_s": 30}).status_code == 200
    assert http.get("/v1/sessions/agent-1").json()["state"] == SessionState.ACTIVE.value
    assert _turn(http, "agent-1", pause={"expected_s": 300}).status_code == 200
    _becomes(http, "agent-1", "state", SessionState.ARCHIVED.value)  # out of memory
    assert http.get("/v1/sessions/agent-2").json()["state"] == SessionState.ACTIVE.value
    assert _turn(http, "agent-1").status_code == 200  # the tool's answer: resumed first
    assert http.get("/v1/sessions/agent-1").json()["state"] == SessionState.ACTIVE.value


def test_a_final_turn_makes_the_session_background(hinted):
    http = hinted
    assert _turn(http, "agent-2", final=True).status_code == 200
    _becomes(http, "agent-2", "priority", "background")


@pytest.mark.parametrize("memkv", [
    {"pause": {"expected_s": -1}}, {"pause": {"expected_s": 1e9}},
    {"pause": {"expected_s": "soon"}}, {"pause": 5}, {"final": "yes"},
    {"final": True, "pause": {"expected_s": 5}},
])
def test_hints_out_of_range_are_422_before_the_engine_is_asked(hinted, memkv):
    answer = _turn(hinted, "agent-1", **memkv)
    assert answer.status_code == 422 and "memkv." in answer.json()["error"]["message"]
