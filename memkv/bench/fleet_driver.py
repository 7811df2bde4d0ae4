"""``vllm serve`` engines and a fleet of agent sessions against them, for ``memkv bench fleet``.

    python -m memkv.bench.fleet_driver MODEL_DIR OUT_JSON SPEC_JSON   (in the vLLM venv)

Starts ``engines`` (default 1) ``vllm serve`` processes (the OpenAI server,
token-id prompts, each with a KV space of ``kv_blocks`` blocks, vLLM's own
prefix cache on, memkv's connector when ``connector`` is given), waits for
their ``/health``, then runs ``sessions`` agent sessions at once, each
``turns`` turns in sequence: a turn sends the whole conversation so far (the
previous prompt, the reply, ``turn_tokens`` new tokens), streamed, greedy.

With ``lmcache_l1_gb`` the engines use LMCache's ``LMCacheMPConnector`` against an
``lmcache server`` (that much DRAM) this driver starts first and stops last.

Long sessions (LMCache's multi-round QA shape): ``system_tokens`` shared by every
session before its own ``first_tokens``, and ``rate``: turns are sent at that
many requests/s in all (session i's turn t no earlier than ``(t * sessions + i)
/ rate`` seconds after the start, and after its previous turn's answer).
``max_num_batched_tokens`` sets vLLM's step budget (default: vllm serve's own).

``route`` says where the requests go: ``direct`` to the one engine (the
session in ``kv_transfer_params``), ``round-robin`` through a plain proxy
(:mod:`memkv.bench.round_robin_proxy`), or ``gateway``: memkv's front door at
``gateway_url``, where the engines are registered for the run (the session in
``extra_body.memkv``; the gateway passes it on). With ``kill_after_turn`` the
last engine is killed once every session has finished that turn.

Writes each request's time to first token, latency, cached tokens (vLLM's
``prompt_tokens_details``), output token ids and the engine that served it,
the wall time of the fleet, the connector's counters and the gateway's
routing counters; stops the engines' process groups.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from memkv.bench.cpu_roles import cpu_by_role, cpu_seconds
from memkv.bench.engine_cores import cores_in_log
from memkv.bench.lmcache_peer import kv_transfer_config
from memkv.bench.lmcache_peer import server as lmcache_server
from memkv.bench.process_groups import die_with_parent, exit_on_sigterm, stop_group

STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0
#: Longest wait for an engine's saves to land before it is killed (then it is killed anyway).
SAVES_LANDED_TIMEOUT_S = 60.0


def _serve(model: str, port: int, spec: dict, log_path: str) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--served-model-name", "fleet", "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--dtype", spec["dtype"], "--enforce-eager",
        "--block-size", str(spec["block_size"]), "--max-model-len", str(spec["max_model_len"]),
        "--num-gpu-blocks-override", str(spec["kv_blocks"]), "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--seed", "0",
    ]
    if spec.get("max_num_batched_tokens"):
        args += ["--max-num-batched-tokens", str(spec["max_num_batched_tokens"])]
    if spec.get("connector") is not None:
        args += ["--kv-transfer-config", json.dumps({
            "kv_connector": "MemkvConnector",
            "kv_connector_module_path": "memkv.integrations.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec["connector"],
        })]
    elif spec.get("lmcache_port") is not None:  # the peer (memkv.bench.lmcache_peer)
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config(spec["lmcache_port"]))]
    log = open(log_path, "ab")  # noqa: SIM115 - the server holds it
    return subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True,
                            preexec_fn=die_with_parent)


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


def _session(client, sid: str, index: int, spec: dict, rng: random.Random, out: list[dict],
             barrier: threading.Barrier | None, start: float) -> None:
    vocab = spec["vocab_size"]
    system = random.Random(spec["seed"]).choices(range(1, vocab), k=spec.get("system_tokens", 0))
    prompt = system + [rng.randrange(1, vocab) for _ in range(spec["first_tokens"])]
    through_gateway = spec.get("route") == "gateway"
    rate = spec.get("rate")
    for turn in range(spec["turns"]):
        if rate:  # a fixed offered load: this turn's slot, or now if its answer came late
            delay = start + (turn * spec["sessions"] + index) / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        extra: dict = {"return_token_ids": True, "ignore_eos": True}
        if through_gateway:
            extra["memkv"] = {"session_id": sid}  # the gateway sends it to the engine
        else:
            extra["kv_transfer_params"] = {"session_id": sid}
        t0 = time.perf_counter()
        raw = client.completions.with_raw_response.create(
            model="fleet", prompt=prompt, max_tokens=spec["reply_tokens"], temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra,
        )
        engine = raw.headers.get("x-memkv-engine", "")
        ttft = None
        reply: list[int] = []
        cached = 0
        for event in raw.parse():
            if event.choices:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                reply += list(getattr(event.choices[0], "token_ids", None) or [])
            if event.usage is not None and event.usage.prompt_tokens_details is not None:
                cached = int(event.usage.prompt_tokens_details.cached_tokens or 0)
        if len(reply) != spec["reply_tokens"]:
            raise RuntimeError(f"{sid} turn {turn}: {len(reply)} tokens of "
                               f"{spec['reply_tokens']} came back (an error event?)")
        out.append({"session": sid, "turn": turn, "prompt_tokens": len(prompt),
                    "sent_at_s": t0 - start,
                    "ttft_s": ttft, "latency_s": time.perf_counter() - t0,
                    "cached_tokens": cached, "reply": reply, "engine": engine})
        prompt = prompt + reply + [rng.randrange(1, vocab) for _ in range(spec["turn_tokens"])]
        if barrier is not None and turn == spec["kill_after_turn"]:
            barrier.wait(timeout=REQUEST_TIMEOUT_S)


def _fleet(base_url: str, spec: dict, kill) -> tuple[list[dict], float, list[str]]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=spec.get("token") or "none",
                           timeout=REQUEST_TIMEOUT_S, max_retries=0)
    requests: list[dict] = []
    errors: list[BaseException] = []
    barrier = (threading.Barrier(spec["sessions"], action=kill)
               if spec.get("kill_after_turn") is not None else None)

    t0 = time.perf_counter()

    def one(i: int) -> None:
        try:
            _session(client, f"{spec['run']}-s{i}", i, spec,
                     random.Random(spec["seed"] * 1000 + i), requests, barrier, t0)
        except BaseException as e:  # noqa: BLE001 - reported below, with the others
            errors.append(e)
            if barrier is not None:
                barrier.abort()  # the others must not wait for this one

    threads = [threading.Thread(target=one, args=(i,)) for i in range(spec["sessions"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return requests, wall, [repr(e) for e in errors]


def _gateway(spec: dict, method: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        spec["gateway_url"].rstrip("/") + path, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {spec['token']}"} if spec.get("token") else {})})
    with urllib.request.urlopen(request, timeout=60) as answer:
        text = answer.read()
    return json.loads(text) if text else {}


def main(model: str, out_path: str, spec: dict) -> None:
    route = spec.get("route", "direct")
    ports = spec["ports"]
    stats_paths = [f"{out_path}.connector-{i}.json" for i in range(len(ports))]
    procs: list[subprocess.Popen] = []
    extra: list[subprocess.Popen] = []
    registered: list[str] = []
    routing: dict = {}
    peers = contextlib.ExitStack()
    try:
        if spec.get("lmcache_l1_gb") is not None:  # its server first: engines connect at start
            port = peers.enter_context(lmcache_server(sys.executable, spec["lmcache_l1_gb"],
                                                      out_path + ".lmcache.log"))
            spec = {**spec, "lmcache_port": port}
        for port, stats_path in zip(ports, stats_paths, strict=True):
            one = spec
            if spec.get("connector") is not None:
                one = {**spec, "connector": {**spec["connector"], "stats_path": stats_path}}
            procs.append(_serve(model, port, one, out_path + ".log"))
        start_s = max(_wait_healthy(proc, port) for proc, port in zip(procs, ports, strict=True))
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        if route == "direct":
            base_url = urls[0] + "/v1"
        elif route == "round-robin":
            proxy_port = spec["proxy_port"]
            extra.append(subprocess.Popen(
                [sys.executable, "-m", "memkv.bench.round_robin_proxy", str(proxy_port), *urls],
                start_new_session=True, preexec_fn=die_with_parent))
            _wait_healthy(extra[-1], proxy_port)  # (its /health is the first engine's)
            base_url = f"http://127.0.0.1:{proxy_port}/v1"
        else:
            for i, url in enumerate(urls):
                engine_id = f"{spec['run']}-e{i}"
                _gateway(spec, "POST", "/v1/engines",
                         {"url": url, "model": "fleet", "engine_id": engine_id, "node": ""})
                registered.append(engine_id)
            base_url = spec["gateway_url"].rstrip("/") + "/v1"

        def kill() -> None:  # the last engine dies between two turns of every session
            # ...once the saves of the turns it served have landed: a save still in
            # flight dies with it (what memkv never received it cannot serve), and which
            # does is a race with the kill, not the failover this row measures.
            _wait_saves_landed(stats_paths[-1])
            os.killpg(procs[-1].pid, signal.SIGKILL)
            procs[-1].wait()

        cpu_before = cpu_seconds()
        requests, wall, errors = _fleet(base_url, spec, kill)
        cpu_s = cpu_by_role(cpu_before, cpu_seconds())
        sources = _prompt_sources(urls)
        if registered:
            stats = _gateway(spec, "GET", "/v1/stats")
            routing = {e["id"]: e.get("routed", {})
                       for e in stats.get("gateway", {}).get("engines", [])
                       if e["id"] in registered}
    finally:
        for engine_id in registered:
            try:
                _gateway(spec, "DELETE", f"/v1/engines/{engine_id}")
            except OSError:
                pass  # the gateway went away with the run: nothing to tidy
        for proc in procs + extra:  # the engines first: then what they use
            stop_group(proc)
        peers.close()
    counters: dict = {}
    found = 0
    for stats_path in stats_paths:
        try:
            with open(stats_path) as f:
                for name, value in json.load(f).items():
                    if isinstance(value, int | float):
                        counters[name] = counters.get(name, 0) + value
            found += 1
        except (OSError, ValueError):
            pass  # no connector, or a killed engine that never wrote its counters
    with open(out_path, "w") as f:
        log = Path(out_path + ".log").read_text(errors="replace")
        json.dump({"server_start_s": start_s, "wall_s": wall, "cpu_s": cpu_s,
                   "requests": requests,
                   "connector": counters, "connector_stats_files": found,
                   "prompt_tokens_by_source": sources, "cores": cores_in_log(log),
                   "routing": routing, "errors": errors,
                   "serve_log_memkv": _memkv_lines(out_path + ".log")}, f)


def _prompt_sources(urls: list[str]) -> dict[str, int]:
    """vLLM's own count of prompt tokens by source (computed, its prefix cache, a
    connector), summed over the engines that still answer."""
    sources: dict[str, int] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
                text = answer.read().decode()
        except OSError:
            continue  # a killed engine
        for line in text.splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total{"):
                found = re.search(r'source="([^"]+)"', line)
                if found:
                    sources[found.group(1)] = sources.get(found.group(1), 0) + int(
                        float(line.rsplit(" ", 1)[1]))
    return sources


def _wait_saves_landed(stats_path: str, timeout_s: float = SAVES_LANDED_TIMEOUT_S) -> bool:
    """Wait until an engine's connector has sent every save it queued (its stats file,
    written as saves are queued and as they land); False when that did not happen in
    ``timeout_s`` (or the engine has no connector)."""
    from memkv.integrations.vllm.stats_file import saves_settled

    return saves_settled(stats_path, timeout_s) is not None


def _memkv_lines(log_path: str, keep: int = 40) -> list[str]:
    """The serve log's last lines about memkv (the log itself is in a temporary
    directory): what a row that moved no KV is diagnosed from."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [line.rstrip() for line in f if "memkv" in line.lower()]
    except OSError:
        return []
    return [line[-400:] for line in lines[-keep:]]


if __name__ == "__main__":
    exit_on_sigterm()  # stopped by its runner: the engines it started stop too
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
