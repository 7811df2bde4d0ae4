"""Resume suite: time to first token of a returning session, recomputed or restored.

For sessions of 1k, 2k, 4k and 8k cached tokens plus a new turn of 64 tokens,
one run measures the time to the first new token of:

* **recompute**: prefill the whole prompt (what an engine without memkv does);
* **ideal**: prefill only the 64 new tokens with the cache already in place
  (the floor any restore can approach);
* **gateway**: :func:`memkv.integrations.transformers.restore` through the HTTP
  gateway, then the 64-token prefill (the path an inference worker uses);
* **in-cluster**: the session's blocks through Ray's object store;
* **in-process**: the blocks from a :class:`TieredStore` in this process.

Each restore is split into fetch (blocks from the store into this process),
decode (join blocks into per-layer K/V, crop, convert fp16 to the model dtype)
and copy (into a ``DynamicCache``); the prefill of the 64 new tokens follows.
Blocks are stored in fp16, the design's precision for later turns.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from memkv.bench.context import BenchContext
from memkv.bench.report import PlotKind, PlotSpec, SuiteResult, track

__all__ = [
    "NEW_TOKENS",
    "QUICK_MODEL_CONFIG",
    "RestoreTiming",
    "run",
]

SIZES = (1024, 2048, 4096, 8192)
QUICK_SIZES = (256, 512)
NEW_TOKENS = 64
#: Timed repetitions per figure (the best is kept: other processes share the cores).
REPS = 3
QUICK_REPS = 2
#: Recomputing 8k tokens takes seconds: one repetition above this many tokens.
LONG_PROMPT_TOKENS = 4096
BLOCK_TOKENS = 256
#: Small blocks in quick mode, so a tiny model still spans many blocks.
QUICK_BLOCK_TOKENS = 16
STORED_DTYPE = "float16"
SEED = 0
WARMUP_TOKENS = 64
NAMESPACE = "bench-resume"
MIB = 1 << 20
#: In-process store: room for the largest session twice over (no demotion while timing).
_STORE_HEADROOM = 2
_STORE_MIN_BYTES = 64 * MIB

#: The tiny Llama of ``--quick`` (random weights; same code paths, milliseconds per pass).
QUICK_MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}


@dataclass(frozen=True, slots=True)
class RestoreTiming:
    """Seconds of one restore and the first-token prefill after it."""

    fetch_s: float
    decode_s: float
    copy_s: float
    prefill_s: float

    @property
    def restore_s(self) -> float:
        return self.fetch_s + self.decode_s + self.copy_s

    @property
    def ttft_s(self) -> float:
        return self.restore_s + self.prefill_s


def _model(ctx: BenchContext) -> tuple[Any, str]:
    if ctx.model is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(ctx.model)).eval()
        return model, ctx.model.name
    if ctx.quick:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(SEED)
        return LlamaForCausalLM(LlamaConfig(**QUICK_MODEL_CONFIG)).eval(), "tiny-llama (quick)"
    from memkv.integrations.reference_model import build_reference_model

    return build_reference_model(SEED), "reference llama (8 layers, hidden 512, 8/2 heads)"


def _best(samples: Sequence[RestoreTiming]) -> RestoreTiming:
    return min(samples, key=lambda t: t.ttft_s)


def _first_token_s(model: Any, ids: list[int], cache: Any) -> float:
    from memkv.integrations.transformers import greedy_decode

    return greedy_decode(model, ids, cache=cache, max_new_tokens=1).first_token_s


def _timed_restore(
    fetch: Callable[[], list[torch.Tensor]], layout: Any, tokens: int, model: Any, ids: list[int]
) -> RestoreTiming:
    """Fetch blocks, rebuild the cache step by step, prefill the new tokens; time each step.

    The steps are restore()'s own: decode is the one pass that joins, crops and
    converts the blocks into per-layer tensors; copy is the DynamicCache build.
    """
    from memkv.integrations.transformers import kv_to_cache, layers_from_blocks

    model_dtype = next(model.parameters()).dtype
    t0 = time.perf_counter()
    blocks = fetch()
    t1 = time.perf_counter()
    keys, values = layers_from_blocks(layout, blocks, tokens, model_dtype)
    t2 = time.perf_counter()
    cache = kv_to_cache(keys, values, model.config, adopt=True)
    t3 = time.perf_counter()
    if int(cache.get_seq_length()) != tokens:
        raise RuntimeError(f"restored {cache.get_seq_length()} tokens, expected {tokens}")
    prefill = _first_token_s(model, ids, cache)
    return RestoreTiming(t1 - t0, t2 - t1, t3 - t2, prefill)


def _measure_size(
    ctx: BenchContext, model: Any, layout: Any, n: int, reps: int, client: Any
) -> dict[str, Any]:
    from memkv.integrations.reference_model import cache_kv
    from memkv.integrations.transformers import greedy_decode, kv_to_cache, restore, save_turn
    from memkv.storage.config import ArchiveConfig, StoreConfig, validated
    from memkv.store import TieredStore

    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(SEED + n)
    ids = torch.randint(0, vocab, (n + NEW_TOKENS,), generator=gen).tolist()
    model_dtype = next(model.parameters()).dtype
    cached = greedy_decode(model, ids[:n], max_new_tokens=1).cache  # KV of ids[:n]
    keys, values = cache_kv(cached)
    keys16, values16 = cache_kv(cached, torch.float16)
    reps_here = 1 if n > LONG_PROMPT_TOKENS else reps

    recompute = min(_first_token_s(model, ids, None) for _ in range(reps_here))
    ideal = min(
        _first_token_s(model, ids, kv_to_cache(keys, values, model.config)) for _ in range(reps)
    )

    sid = f"resume-{n}-{uuid.uuid4().hex[:8]}"
    client.create_session(sid, layout, namespace=NAMESPACE)
    save_turn(client, sid, ids[:n], cached, dtype=torch.float16)
    n_blocks = -(-n // layout.block_tokens)
    cluster = ctx.get_cluster()
    try:
        e2e: list[float] = []
        tiers: Counter[str] = Counter()
        for _ in range(reps):
            t0 = time.perf_counter()
            restored = restore(client, ids, layout=layout, namespace=NAMESPACE, session_id=sid,
                               config=model.config, dtype=model_dtype)
            if restored.tokens != n:
                raise RuntimeError(f"gateway restore covered {restored.tokens} of {n} tokens")
            greedy_decode(model, ids, cache=restored.cache, max_new_tokens=1)
            e2e.append(time.perf_counter() - t0)
            tiers.update(restored.tiers)
        gateway = _best([
            _timed_restore(lambda: [b.tensor for b in client.read_blocks(sid, 0, n_blocks)],
                           layout, n, model, ids) for _ in range(reps)])
        in_cluster = _best([
            _timed_restore(lambda: [b for _, b in cluster.read_session(sid, 0, n_blocks)],
                           layout, n, model, ids) for _ in range(reps)])
    finally:
        client.delete_session(sid)

    session_bytes = n_blocks * layout.block_nbytes()
    capacity = max(_STORE_MIN_BYTES, _STORE_HEADROOM * session_bytes)
    with tempfile.TemporaryDirectory(prefix="memkv-bench-resume-") as tmp:
        config = validated(StoreConfig, hot_capacity_bytes=capacity, warm_capacity_bytes=capacity,
                           archive=ArchiveConfig(directory=Path(tmp), fsync="never"))
        with TieredStore(config) as store:
            store.create_session(sid, layout, namespace=NAMESPACE)
            store.put_kv(sid, ids[:n], keys16, values16)
            in_process = _best([
                _timed_restore(lambda: [b for _, b in store.read_session(sid)],
                               layout, n, model, ids) for _ in range(reps)])
    return {
        "cached_tokens": n,
        "new_tokens": NEW_TOKENS,
        "kv_mib_fp16": session_bytes / MIB,
        "recompute_s": recompute,
        "ideal_s": ideal,
        "gateway_restore_e2e_s": min(e2e),
        "gateway": asdict(gateway) | {"ttft_s": gateway.ttft_s},
        "in_cluster": asdict(in_cluster) | {"ttft_s": in_cluster.ttft_s},
        "in_process": asdict(in_process) | {"ttft_s": in_process.ttft_s},
        "gateway_tiers": dict(tiers),
    }


def run(ctx: BenchContext) -> SuiteResult:
    """Measure every size; the table is TTFT (ms) and speedup over recompute."""
    from memkv.client import Client
    from memkv.integrations.reference_model import reference_layout

    sizes = QUICK_SIZES if ctx.quick else SIZES
    reps = QUICK_REPS if ctx.quick else REPS
    model, model_name = _model(ctx)
    block_tokens = QUICK_BLOCK_TOKENS if ctx.quick else BLOCK_TOKENS
    model_id = f"bench-{model_name}-seed{SEED}".replace(" ", "_")[:100]
    layout = reference_layout(model, model_id=model_id, dtype=STORED_DTYPE,
                              block_tokens=block_tokens)
    threads = torch.get_num_threads()
    # One untimed pass first: the first forward pays for lazy initialisation (kernels,
    # allocator), which would otherwise land on the first size's recompute figure.
    _first_token_s(model, list(range(WARMUP_TOKENS)), None)
    measured: list[dict[str, Any]] = []
    with Client(ctx.get_gateway_url()) as client:
        for n in track(sizes, "resume: session sizes"):
            measured.append(_measure_size(ctx, model, layout, n, reps, client))

    ms = 1000.0
    rows: list[list[Any]] = []
    for m in measured:
        rec = m["recompute_s"]
        rows.append([
            m["cached_tokens"], m["kv_mib_fp16"], rec * ms, m["ideal_s"] * ms,
            m["gateway_restore_e2e_s"] * ms, m["in_cluster"]["ttft_s"] * ms,
            m["in_process"]["ttft_s"] * ms,
            rec / m["gateway_restore_e2e_s"], rec / m["in_cluster"]["ttft_s"],
            rec / m["in_process"]["ttft_s"], rec / m["ideal_s"],
            m["gateway_restore_e2e_s"] / m["ideal_s"],
        ])
    notes = [f"model: {model_name}; KV stored as {STORED_DTYPE} in blocks of {block_tokens} "
             f"tokens; new turn: {NEW_TOKENS} tokens; torch threads: {threads}; best of {reps}."]
    for m in measured:
        parts = []
        for path in ("gateway", "in_cluster", "in_process"):
            t = m[path]
            parts.append(f"{path} fetch {t['fetch_s'] * ms:.1f} / decode {t['decode_s'] * ms:.1f}"
                         f" / copy {t['copy_s'] * ms:.1f} / prefill {t['prefill_s'] * ms:.1f}")
        notes.append(f"{m['cached_tokens']} tokens, where the time goes (ms): " + "; ".join(parts)
                     + f"; gateway blocks found in {m['gateway_tiers']}.")
    notes.append("gateway TTFT is restore() + greedy_decode end to end (session lookup, prefix "
                 "check, streamed read); the split comes from the same steps timed one by one.")
    xs = [m["cached_tokens"] for m in measured]
    series: dict[str, list[float | None]] = {
        "recompute": [m["recompute_s"] * ms for m in measured],
        "gateway (HTTP)": [m["gateway_restore_e2e_s"] * ms for m in measured],
        "in-cluster (Ray)": [m["in_cluster"]["ttft_s"] * ms for m in measured],
        "in-process": [m["in_process"]["ttft_s"] * ms for m in measured],
        "ideal (cache in place)": [m["ideal_s"] * ms for m in measured],
    }
    return SuiteResult(
        suite="resume",
        title=f"time to first token of a {NEW_TOKENS}-token turn after N cached tokens (ms)",
        columns=["cached tokens", "KV MiB (fp16)", "recompute ms", "ideal ms", "gateway ms",
                 "in-cluster ms", "in-process ms", "gateway ×", "in-cluster ×", "in-process ×",
                 "ideal ×", "gateway / ideal"],
        rows=rows,
        figures={"model": model_name, "block_tokens": block_tokens, "reps": reps,
                 "torch_threads": threads, "sizes": measured},
        notes=notes,
        plot=PlotSpec(PlotKind.LINE, "cached tokens", "time to first token (ms)", xs, series,
                      log_y=True),
        quick=ctx.quick,
    )
