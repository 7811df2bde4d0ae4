"""LangChain's ``ChatOpenAI`` (``langchain-openai``) through the front door, as a LangChain
agent is written: a tool bound to the model, its call executed and answered, with no
memkv code; its chat-completions turns kept in one session by ``prompt_cache_key``,
and its Responses turns chained by ``previous_response_id``. Stand-in engines
(``test_responses.AgentEngine``); the real-engine run is in
``tests/integrations/test_responses_vllm.py``."""

from __future__ import annotations

from typing import Any

import pytest

from .test_front_door import MODEL
from .test_responses import AgentEngine, agents  # noqa: F401  (the fixture)

pytest.importorskip("langchain_openai")


def _weather_tool() -> Any:
    from langchain_core.tools import tool

    @tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    return weather


def _tool_loop(model: Any, **invoke: Any) -> tuple[Any, list[Any]]:
    """What a LangChain tool-calling agent does: ask, run the tools the model calls,
    send their outputs back, until the model answers."""
    from langchain_core.messages import HumanMessage, ToolMessage

    weather = _weather_tool()
    bound = model.bind_tools([weather])
    messages: list[Any] = [HumanMessage("weather in Paris?")]
    for _ in range(4):
        reply = bound.invoke(messages, **invoke)
        messages.append(reply)
        if not reply.tool_calls:
            return reply, messages
        for call in reply.tool_calls:
            messages.append(ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"]))
    raise AssertionError(f"no answer after 4 turns: {messages}")


def _turns(engines: list[AgentEngine], before: dict[str, int]) -> list[tuple[str, Any]]:
    return [(e.name, body) for e in engines for body in e.seen[before[e.name]:]]


def _chat_model(url: str, **kwargs: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="unused", temperature=0,
                      max_retries=0, **kwargs)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_langchain_tool_loop_keeps_its_turns_in_one_session_by_prompt_cache_key(
        agents, streaming):  # noqa: F811
    _, engines, _, gateway = agents
    before = {e.name: len(e.seen) for e in engines}
    model = _chat_model(gateway.url, streaming=streaming)
    reply, _ = _tool_loop(model, prompt_cache_key="lc-weather-1")
    assert str(reply.content).strip() == "the tool said sunny in Paris"
    turns = _turns(engines, before)
    assert len(turns) == 2  # the tool call, then the answer
    # One session, named by the cache key; both turns on one engine (affinity).
    assert {body["kv_transfer_params"]["session_id"] for _, body in turns} == {"lc-weather-1"}
    assert len({name for name, _ in turns}) == 1
    assert turns[1][1]["messages"][-1]["role"] == "tool"


def test_a_langchain_responses_chain_goes_through_previous_response_id(agents):  # noqa: F811
    http, engines, _, gateway = agents
    before = {e.name: len(e.seen) for e in engines}
    model = _chat_model(gateway.url, use_responses_api=True, use_previous_response_id=True)
    reply, messages = _tool_loop(model)
    assert reply.text.strip() == "the tool said sunny in Paris"
    turns = _turns(engines, before)
    assert len(turns) == 2
    # LangChain sent only the tool's output and the id; memkv expanded the chain's
    # history for the engine, which saw the question, its call and the output.
    second = turns[1][1]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "tool"]
    assert second[-1]["content"] == "sunny in Paris"
    assert len({body["kv_transfer_params"]["session_id"] for _, body in turns}) == 1
    # The chain is memkv's: its last response is there to read back.
    last_id = reply.response_metadata["id"]
    stored = http.get(f"/v1/responses/{last_id}")
    assert stored.status_code == 200 and stored.json()["previous_response_id"]
