"""[2/6] item 11: what schemathesis found the gateway's contract to get wrong, each fixed.

The gateway in-process (ASGI) over the real router and device classes behind fake
handles."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from memkv.api.app import create_app

from .fakes import FakeHandle, device_and_router

LAYOUT = {"model_id": "contract", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
          "block_tokens": 4}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("contract")
    device, router, loop = device_and_router(tmp / "cold", f"contract-{tmp.name[-8:]}")
    yield create_app(FakeHandle(router), same_node_reads=False, put_object=lambda p: p)
    device.close()
    loop.close()


def _call(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_options_names_every_method_of_a_path(app):
    schema = app.openapi()
    for path, operations in schema["paths"].items():
        concrete = path.replace("{session_id}", "s").replace("{lease_id}", "l") \
            .replace("{engine_id}", "e")
        answer = _call(app, "OPTIONS", concrete)
        assert answer.status_code == 405, path
        allowed = {m.strip() for m in answer.headers["allow"].split(",")}
        assert allowed == {m.upper() for m in operations}, (path, allowed)


@pytest.mark.parametrize("bad", [[1.0, 2], [True, 2], [-1, 2], ["1"]])
def test_match_takes_token_ids_as_non_negative_ints_only(app, bad):
    answer = _call(app, "POST", "/v1/match", json={"layout": LAYOUT, "token_ids": bad})
    assert answer.status_code == 422
    message = answer.json()["error"]["message"]
    assert message.startswith("token_ids.") and "{" not in message, message  # a plain line


def test_the_schema_documents_what_the_routes_answer(app):
    paths = app.openapi()["paths"]
    assert "404" in paths["/v1/sessions/{session_id}/reservations"]["post"]["responses"]
    for path, operations in paths.items():
        for method, operation in operations.items():
            if path.startswith("/v1/"):
                assert "400" in operation["responses"], (method, path)
    token = paths["/v1/match"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    resolved = app.openapi()["components"]["schemas"][token["$ref"].rsplit("/", 1)[1]]
    assert resolved["properties"]["token_ids"]["items"]["minimum"] == 0


def test_the_session_answers_are_described_from_their_one_declaration(app):
    schema = app.openapi()
    paths, components = schema["paths"], schema["components"]["schemas"]
    answers = {
        ("post", "/v1/sessions", "201"): "SessionView",
        ("get", "/v1/sessions/{session_id}", "200"): "SessionView",
        ("post", "/v1/sessions/{session_id}/suspend", "200"): "SessionView",
        ("post", "/v1/sessions/{session_id}/resume", "200"): "ResumeAnswer",
        ("post", "/v1/sessions/{session_id}/turns", "200"): "AppendAnswer",
    }
    for (method, path, status), name in answers.items():
        content = paths[path][method]["responses"][status]["content"]["application/json"]
        assert content["schema"]["$ref"] == f"#/components/schemas/{name}", (method, path)
        assert name in components
    assert components["SessionView"]["properties"]["chain"]["items"]["pattern"]


def test_a_session_is_answered_as_the_schema_says(app):
    from memkv.protocol import http_form
    from memkv.protocol.services import SessionView

    created = _call(app, "POST", "/v1/sessions", json={"session_id": "contract-s",
                                                       "layout": LAYOUT})
    assert created.status_code == 201, created.text
    view = http_form.from_builtins(created.json(), SessionView)
    assert view.session_id == "contract-s" and view.chain == () and view.state == "active"
