"""``/v1/responses`` through the front door: stand-in engines that speak chat completions
only (as any ``vllm serve`` does) and call tools, a gateway over a real router and
device without Ray; driven with httpx, the official ``openai`` client and the OpenAI
Agents SDK (its Responses model and its chat-completions model), with no memkv code
in the agent."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..test_gateway_fakes import _Server
from .test_front_door import MODEL, _gateway


class AgentEngine:
    """A stand-in ``vllm serve`` for an agent: offered tools and asked by a user, it calls
    the first tool; given a tool's output, it answers with it; otherwise it says how
    many messages it saw and the last one (so a test can tell what history it got)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[dict[str, Any]] = []
        app = FastAPI()

        @app.get("/health")
        async def health() -> Any:
            return PlainTextResponse("")

        @app.get("/metrics")
        async def metrics() -> Any:
            return PlainTextResponse("")

        @app.get("/v1/models")
        async def models() -> Any:
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await request.json()
            self.seen.append(body)
            messages = body["messages"]
            last = messages[-1] if messages else {"role": "user", "content": ""}
            calls, text = [], None
            if body.get("tools") and last["role"] == "user":
                tool = body["tools"][0]["function"]["name"]
                calls = [{"id": f"call_{len(self.seen)}", "type": "function",
                          "function": {"name": tool, "arguments": '{"city": "Paris"}'}}]
            elif last["role"] == "tool":
                text = f"the tool said {last['content']}"
            else:
                text = f"{self.name} saw {len(messages)}: {last['content']}"
            usage = {"prompt_tokens": 10 * len(messages), "completion_tokens": 4,
                     "total_tokens": 10 * len(messages) + 4,
                     "prompt_tokens_details": {"cached_tokens": 8}}
            finish = "tool_calls" if calls else "stop"
            if not body.get("stream"):
                return JSONResponse({
                    "id": "chatcmpl-1", "object": "chat.completion", "created": 0,
                    "model": MODEL, "usage": usage, "choices": [{
                        "index": 0, "finish_reason": finish,
                        "message": {"role": "assistant", "content": text,
                                    "tool_calls": calls or None}}]})

            async def events() -> Any:
                def chunk(delta: dict[str, Any], finish_reason: str | None = None,
                          **extra: Any) -> str:
                    return "data: " + json.dumps({
                        "id": "c", "object": "chat.completion.chunk", "created": 0,
                        "model": MODEL, "choices": [{"index": 0, "delta": delta,
                                                     "finish_reason": finish_reason}],
                        **extra}) + "\n\n"

                yield chunk({"role": "assistant"})
                if text is not None:
                    for word in text.split(" "):
                        yield chunk({"content": word + " "})
                for i, call in enumerate(calls):
                    yield chunk({"tool_calls": [{"index": i, "id": call["id"],
                                                 "type": "function", "function": {
                                                     "name": call["function"]["name"],
                                                     "arguments": ""}}]})
                    arguments = call["function"]["arguments"]
                    for part in (arguments[:5], arguments[5:]):
                        yield chunk({"tool_calls": [{"index": i,
                                                     "function": {"arguments": part}}]})
                yield chunk({}, finish)
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk",
                                                 "created": 0, "model": MODEL, "choices": [],
                                                 "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        self.server = _Server(app)
        self.url = self.server.url


@pytest.fixture
def agents(tmp_path):
    engines = [AgentEngine("a"), AgentEngine("b")]
    with _gateway(tmp_path, "responses-dev", engines, node_id="gateway-node") as (
            gateway, router, loop, device), httpx.Client(base_url=gateway.url, timeout=30) as http:
        for engine in engines:
            made = http.post("/v1/engines", json={"url": engine.url, "engine_id": engine.name})
            assert made.status_code == 201, made.text
        yield http, engines, router, gateway


def _respond(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/v1/responses", json={"model": MODEL, **body})


def _engine(engines: list[AgentEngine], answer: httpx.Response) -> AgentEngine:
    return next(e for e in engines if e.name == answer.headers["x-memkv-engine"])


def test_a_chain_is_stored_continued_with_its_whole_history_and_kept_in_one_session(agents):
    http, engines, *_ = agents
    first = _respond(http, input="hello", instructions="be brief")
    assert first.status_code == 200, first.text
    response = first.json()
    assert response["object"] == "response" and response["status"] == "completed"
    assert response["id"].startswith("resp_")
    [message] = response["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == (
        f"{first.headers['x-memkv-engine']} saw 2: hello")
    assert response["usage"]["input_tokens"] == 20
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 8
    engine = _engine(engines, first)
    assert engine.seen[-1]["messages"] == [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "hello"}]
    session = engine.seen[-1]["kv_transfer_params"]["session_id"]
    assert http.get(f"/v1/responses/{response['id']}").json() == response

    # The next turn names only the previous response: the engine gets the chain's items
    # (instructions are not inherited), under the same session, on the same engine.
    second = _respond(http, input="and then?", previous_response_id=response["id"])
    assert second.status_code == 200, second.text
    assert second.headers["x-memkv-engine"] == engine.name
    assert engine.seen[-1]["messages"] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": message["content"][0]["text"]},
        {"role": "user", "content": "and then?"}]
    assert engine.seen[-1]["kv_transfer_params"]["session_id"] == session
    assert second.json()["previous_response_id"] == response["id"]
    items = http.get(f"/v1/responses/{second.json()['id']}/input_items").json()
    assert [i["content"] for i in items["data"]] == ["and then?"]


def test_a_chain_goes_on_when_its_engine_is_gone(agents):
    http, engines, *_ = agents
    first = _respond(http, input="remember 7")
    gone = _engine(engines, first)
    gone.server.stop()  # the engine of the chain's first turn goes away
    second = _respond(http, input="what number?", previous_response_id=first.json()["id"])
    assert second.status_code == 200, second.text
    other = _engine(engines, second)
    assert other is not gone
    assert [m["content"] for m in other.seen[-1]["messages"]] == [
        "remember 7", first.json()["output"][0]["content"][0]["text"], "what number?"]


def test_unknown_deleted_unstored_and_other_tenants_responses_are_404(agents):
    http, *_ = agents
    for missing in ("resp_nope", "resp_" + "0" * 32 + "_some-session"):
        answer = _respond(http, input="x", previous_response_id=missing)
        assert answer.status_code == 404 and answer.json()["error"]["param"] == (
            "previous_response_id")
        assert http.get(f"/v1/responses/{missing}").status_code == 404
    unstored = _respond(http, input="x", store=False).json()
    assert http.get(f"/v1/responses/{unstored['id']}").status_code == 404
    kept = _respond(http, input="x").json()
    deleted = http.delete(f"/v1/responses/{kept['id']}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert http.get(f"/v1/responses/{kept['id']}").status_code == 404
    assert _respond(http, input="y", previous_response_id=kept["id"]).status_code == 404
    assert http.delete(f"/v1/responses/{kept['id']}").status_code == 404


@pytest.mark.parametrize("body,names", [
    ({"input": 3}, "'input'"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
])
def test_what_a_chat_completion_cannot_carry_is_refused_with_400_naming_it(agents, body, names):
    http, *_ = agents
    answer = _respond(http, **body)
    assert answer.status_code == 400 and names in answer.json()["error"]["message"]


def test_tool_calls_round_trip_through_the_official_client_streamed_and_not(agents):
    from openai import OpenAI

    http, engines, _, gateway = agents
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused")
    tools = [{"type": "function", "name": "weather", "description": "the weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    for stream in (False, True):
        if stream:
            with client.responses.stream(model=MODEL, input="weather?", tools=tools) as events:
                kinds = [event.type for event in events]
                first = events.get_final_response()
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            assert "response.function_call_arguments.delta" in kinds
        else:
            first = client.responses.create(model=MODEL, input="weather?", tools=tools)
        [call] = first.output
        assert call.type == "function_call" and call.name == "weather"
        assert json.loads(call.arguments) == {"city": "Paris"}
        engine = next(e for e in engines if e.seen and e.seen[-1].get("tools"))
        assert engine.seen[-1]["tools"][0]["function"]["name"] == "weather"
        second = client.responses.create(
            model=MODEL, previous_response_id=first.id, tools=tools, stream=False,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        assert second.output_text == "the tool said sunny"
        sent = engine.seen[-1]["messages"]
        assert sent[1]["tool_calls"][0]["id"] == call.call_id
        assert sent[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
        stored = client.responses.retrieve(second.id)
        assert stored.output_text == "the tool said sunny"


def test_a_streamed_text_response_is_stored_as_it_completed(agents):
    from openai import OpenAI

    http, engines, _, gateway = agents
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused")
    deltas, completed = [], None
    for event in client.responses.create(model=MODEL, input="hello", stream=True):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            completed = event.response
    assert completed is not None and "".join(deltas) == completed.output_text
    assert completed.usage.input_tokens == 10
    assert client.responses.retrieve(completed.id).output_text == completed.output_text


def _agents_sdk_run(gateway: _Server, chat_model: bool, streamed: bool) -> tuple[str, Any]:
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
    from agents.models.openai_responses import OpenAIResponsesModel
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    async def run() -> tuple[str, Any]:
        client = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused")
        model = (OpenAIChatCompletionsModel(MODEL, client) if chat_model
                 else OpenAIResponsesModel(MODEL, client))
        agent = Agent(name="forecaster", instructions="answer with the tool", tools=[weather],
                      model=model, model_settings=ModelSettings(temperature=0.0))
        if streamed:
            result = Runner.run_streamed(agent, "weather in Paris?")
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, "weather in Paris?")
        await client.close()
        return str(result.final_output), result

    return asyncio.run(run())


@pytest.mark.parametrize("chat_model,streamed", [(False, False), (False, True), (True, False)])
def test_an_agents_sdk_agent_with_a_tool_runs_through_the_front_door_in_one_session(
        agents, chat_model, streamed):
    http, engines, _, gateway = agents
    before = {e.name: len(e.seen) for e in engines}
    output, _ = _agents_sdk_run(gateway, chat_model, streamed)
    assert output.strip() == "the tool said sunny in Paris"
    turns = [body for e in engines for body in e.seen[before[e.name]:]]
    assert len(turns) == 2  # the model's tool call, then its answer
    if not chat_model:
        # The SDK sends its whole history each turn and no id: memkv tells the
        # conversation by that history, and keeps its turns in one session.
        sessions = {t["kv_transfer_params"]["session_id"] for t in turns}
        assert len(sessions) == 1, sessions


def test_another_tenants_response_is_404_on_every_route(tmp_path):
    from memkv.api.auth import Authenticator, TokenEntry, hash_token

    auth = Authenticator([
        TokenEntry(hash_token("tok-acme"), "acme", frozenset({"write", "read", "admin"})),
        TokenEntry(hash_token("tok-evil"), "evil", frozenset({"write", "read", "admin"})),
    ])
    engine = AgentEngine("shared")
    with _gateway(tmp_path, "responses-auth", [engine], auth=auth) as (gateway, *_):

        def as_(token: str) -> httpx.Client:
            return httpx.Client(base_url=gateway.url, timeout=30,
                                headers={"Authorization": f"Bearer {token}"})

        with as_("tok-acme") as acme, as_("tok-evil") as evil:
            made = acme.post("/v1/engines", json={"url": engine.url, "tenants": ["*"]})
            assert made.status_code == 201, made.text
            secret = _respond(acme, input="my secret plan").json()
            for answer in (evil.get(f"/v1/responses/{secret['id']}"),
                           evil.get(f"/v1/responses/{secret['id']}/input_items"),
                           evil.delete(f"/v1/responses/{secret['id']}"),
                           _respond(evil, input="go on", previous_response_id=secret["id"])):
                assert answer.status_code == 404, answer.text
            assert all("my secret plan" not in json.dumps(body["messages"])
                       for body in engine.seen[1:])
            assert acme.get(f"/v1/responses/{secret['id']}").status_code == 200


def test_a_branch_from_an_earlier_response_gets_a_session_of_its_own(agents):
    http, engines, *_ = agents

    def session_of(answer: httpx.Response) -> str:
        return _engine(engines, answer).seen[-1]["kv_transfer_params"]["session_id"]

    root = _respond(http, input="plan a trip")
    trunk = session_of(root)
    first = _respond(http, input="by train", previous_response_id=root.json()["id"])
    assert session_of(first) == trunk  # the chain goes on: its session
    retry = _respond(http, input="by plane", previous_response_id=root.json()["id"])
    branch = session_of(retry)
    assert branch != trunk and branch.startswith(trunk + ".b")
    # Each branch goes on in its own session, with its own history.
    assert session_of(_respond(http, input="and then?",
                               previous_response_id=first.json()["id"])) == trunk
    after = _respond(http, input="and then?", previous_response_id=retry.json()["id"])
    assert session_of(after) == branch
    assert [m["content"] for m in _engine(engines, after).seen[-1]["messages"]][-2:] == [
        retry.json()["output"][0]["content"][0]["text"], "and then?"]
