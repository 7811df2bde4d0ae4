"""``memkv bench front-door``: what the gateway's OpenAI front door costs a request.

A stand-in engine (:mod:`memkv.bench.standin_engine`, its own process: answers at
once) is registered with the gateway; the same tiny chat request is sent
straight to it and through the gateway, alternately, one at a time on kept-alive
connections, so both paths see the same machine at the same moments. With a
session (``X-Memkv-Session``) the gateway also asks the router where the
session's KV is. Streams: the gap between consecutive events at the client.
Targets (TARGETS.md, [5/5]): ≤ 2 ms p50 added per request, ≤ 1 ms p99 added per
streamed event.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from memkv.api.engines.front_door import KV_LOOKUP_TTL_S
from memkv.bench.context import BenchContext
from memkv.bench.report import PlotKind, PlotSpec, SuiteResult, percentile
from memkv.bench.standin_engine import MODEL
from memkv.errors import MemkvError

__all__ = ["run"]

FULL = {"requests": 2000, "streams": 100, "events": 32}
QUICK = {"requests": 100, "streams": 10, "events": 16}
TARGET_MS, TARGET_EVENT_MS = 2.0, 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_engine(events: int) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "memkv.bench.standin_engine", str(port),
                             str(events)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise MemkvError("the stand-in engine did not start")


def _timed(client: httpx.Client, url: str, headers: dict[str, str]) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    started = time.perf_counter()
    answer = client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    elapsed = time.perf_counter() - started
    if answer.status_code != 200:
        raise MemkvError(f"{url}: {answer.status_code} {answer.text[:200]}")
    return elapsed * 1e3


def _gaps(client: httpx.Client, url: str, headers: dict[str, str]) -> list[float]:
    body = {"model": MODEL, "messages": [], "stream": True}
    gaps, last = [], None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                       headers=headers) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) * 1e3)
            last = now
    return gaps


def run(ctx: BenchContext) -> SuiteResult:
    sizes = QUICK if ctx.quick else FULL
    gateway = ctx.get_gateway_url()
    engine, engine_url = _start_engine(sizes["events"])
    try:
        with httpx.Client(timeout=30) as client:
            made = client.post(f"{gateway}/v1/engines",
                               json={"url": engine_url, "engine_id": "standin"})
            if made.status_code != 201:
                raise MemkvError(f"registering the stand-in engine: {made.text[:200]}")
            paths = {"direct": (engine_url, {}), "gateway": (gateway, {}),
                     "gateway, with a session": (gateway, {"X-Memkv-Session": "bench-fd"})}
            for url, headers in paths.values():  # warm: connections, caches
                for _ in range(20):
                    _timed(client, url, headers)
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(sizes["requests"]):
                for name, (url, headers) in paths.items():
                    times[name].append(_timed(client, url, headers))
            gaps: dict[str, list[float]] = {"direct": [], "gateway": []}
            for _ in range(sizes["streams"]):
                gaps["direct"] += _gaps(client, engine_url, {})
                gaps["gateway"] += _gaps(client, gateway, {"X-Memkv-Session": "bench-fd"})
            client.delete(f"{gateway}/v1/engines/standin")
    finally:
        engine.kill()
        engine.wait()
    p50 = {n: percentile(t, 50) for n, t in times.items()}
    p99 = {n: percentile(t, 99) for n, t in times.items()}
    rows: list[list[Any]] = [
        [name, round(p50[name], 3), round(p99[name], 3),
         round(p50[name] - p50["direct"], 3) if name != "direct" else "-",
         ("yes" if p50[name] - p50["direct"] <= TARGET_MS else "no") if name != "direct" else "-"]
        for name in paths
    ]
    gap99 = {n: percentile(g, 99) for n, g in gaps.items()}
    added_gap = gap99["gateway"] - gap99["direct"]
    rows.append(["stream: gap between events, p99 (gateway vs direct)",
                 round(gap99["direct"], 3), round(gap99["gateway"], 3), round(added_gap, 3),
                 "yes" if added_gap <= TARGET_EVENT_MS else "no"])
    notes = [
        f"{sizes['requests']} requests per path, alternating paths request by request "
        f"(kept-alive connections, one at a time), after 20 warm-up requests each; a stand-in "
        f"engine in its own process answers at once, so the difference is the gateway's: its "
        f"auth, body parse, engine choice and a second HTTP hop on loopback. With a session "
        f"the gateway also asks the router where the session's KV is, at most every "
        f"{KV_LOOKUP_TTL_S:.0f} s per session (asked on every request, it added 6.7 ms p50 "
        f"here: a router call, and an error answer for a new session).",
        f"Streams: {sizes['streams']} streams of {sizes['events']} events through each path; "
        f"the row's first two figures are the p99 gap direct and through the gateway.",
        f"Targets: <= {TARGET_MS} ms p50 added per request, <= {TARGET_EVENT_MS} ms p99 added "
        f"per streamed event.",
    ]
    return SuiteResult(
        suite="front-door",
        title="The OpenAI front door's cost per request: through the gateway vs straight to "
              "the engine (ms)",
        columns=["path", "p50 ms", "p99 ms", "added p50 ms", "within target"],
        rows=rows,
        figures={"sizes": sizes, "p50_ms": p50, "p99_ms": p99, "gap_p99_ms": gap99},
        notes=notes,
        plot=PlotSpec(PlotKind.BAR, "path", "ms", list(paths),
                      {"p50": [p50[n] for n in paths], "p99": [p99[n] for n in paths]}),
        quick=ctx.quick,
    )
