"""One ``vllm serve`` and a fleet of agent sessions against it, for ``memkv bench fleet``.

    python -m memkv.bench.fleet_driver MODEL_DIR OUT_JSON SPEC_JSON   (in the vLLM venv)

Starts ``vllm serve`` (the OpenAI server, token-id prompts, its KV space set
to ``kv_blocks`` blocks, vLLM's own prefix cache on, memkv's connector when
``connector`` is given), waits for ``/health``, then runs ``sessions`` agent
sessions at once, each ``turns`` turns in sequence: a turn sends the whole
conversation so far (the previous prompt, the reply, ``turn_tokens`` new
tokens) with ``kv_transfer_params.session_id``, streamed, greedy. Writes each
request's time to first token, latency, cached tokens (vLLM's
``prompt_tokens_details``) and output token ids, the wall time of the fleet,
and the connector's counters; stops the server's process group.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request

STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0


def _serve(model: str, port: int, spec: dict, log_path: str) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--served-model-name", "fleet", "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--dtype", spec["dtype"], "--enforce-eager",
        "--block-size", str(spec["block_size"]), "--max-model-len", str(spec["max_model_len"]),
        "--num-gpu-blocks-override", str(spec["kv_blocks"]), "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--seed", "0", "--disable-log-stats",
    ]
    if spec.get("connector") is not None:
        args += ["--kv-transfer-config", json.dumps({
            "kv_connector": "MemkvConnector",
            "kv_connector_module_path": "memkv.integrations.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec["connector"],
        })]
    log = open(log_path, "ab")  # noqa: SIM115 - the server holds it
    return subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)


def _wait_healthy(proc: subprocess.Popen, port: int) -> float:
    started = time.perf_counter()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} during start")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return time.perf_counter() - started
        except OSError:
            time.sleep(0.25)  # the server is loading: nothing to wait on but its port
    raise TimeoutError(f"vllm serve did not answer /health within {STARTUP_TIMEOUT_S} s")


def _session(client, sid: str, spec: dict, rng: random.Random, out: list[dict]) -> None:
    vocab = spec["vocab_size"]
    prompt = [rng.randrange(1, vocab) for _ in range(spec["first_tokens"])]
    for turn in range(spec["turns"]):
        t0 = time.perf_counter()
        stream = client.completions.create(
            model="fleet", prompt=prompt, max_tokens=spec["reply_tokens"], temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"return_token_ids": True, "ignore_eos": True,
                        "kv_transfer_params": {"session_id": sid}},
        )
        ttft = None
        reply: list[int] = []
        cached = 0
        for event in stream:
            if event.choices:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                reply += list(getattr(event.choices[0], "token_ids", None) or [])
            if event.usage is not None and event.usage.prompt_tokens_details is not None:
                cached = int(event.usage.prompt_tokens_details.cached_tokens or 0)
        out.append({"session": sid, "turn": turn, "prompt_tokens": len(prompt),
                    "ttft_s": ttft, "latency_s": time.perf_counter() - t0,
                    "cached_tokens": cached, "reply": reply})
        prompt = prompt + reply + [rng.randrange(1, vocab) for _ in range(spec["turn_tokens"])]


def _fleet(port: int, spec: dict) -> tuple[list[dict], float]:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           timeout=REQUEST_TIMEOUT_S, max_retries=0)
    requests: list[dict] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            _session(client, f"{spec['run']}-s{i}", spec, random.Random(spec["seed"] * 1000 + i),
                     requests)
        except BaseException as e:  # noqa: BLE001 - reported below, with the others
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(spec["sessions"])]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} sessions failed; the first: {errors[0]!r}")
    return requests, wall


def main(model: str, out_path: str, spec: dict) -> None:
    port = int(spec["port"])
    stats_path = out_path + ".connector.json"
    if spec.get("connector") is not None:
        spec = {**spec, "connector": {**spec["connector"], "stats_path": stats_path}}
    proc = _serve(model, port, spec, out_path + ".log")
    try:
        start_s = _wait_healthy(proc, port)
        requests, wall = _fleet(port, spec)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    counters: dict = {}
    if spec.get("connector") is not None:
        try:
            with open(stats_path) as f:
                counters = json.load(f)
        except (OSError, ValueError):
            counters = {}
    with open(out_path, "w") as f:
        json.dump({"server_start_s": start_s, "wall_s": wall, "requests": requests,
                   "connector": counters}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
