"""One vLLM engine run for ``memkv bench vllm`` (runs in the vLLM venv, a process per engine).

    python -m memkv.bench.vllm_engine MODEL_DIR OUT_JSON SPEC_JSON

SPEC: ``connector`` (``kv_connector_extra_config``, or null for an engine
without memkv), ``lmcache_port`` (instead: LMCache's connector against that
``lmcache server``), ``prompt`` and ``warmup`` (token ids), ``block_size``,
``dtype``, ``max_model_len``, ``prefix_caching`` (vLLM's own cache on, and the
prompt sent once before the measured requests). The engine serves the warm-up prompt first (the
first request of an engine pays one-off costs), then the measured prompt with
``max_tokens=1``: the wall time of that call is the time to first token. Writes
the times, the first token, what vLLM says it had cached, and each request's
share of the connector's counters once its saves are stored. ``repeats``: the
measured prompt is sent that many times; the request of median TTFT stands for
the engine.
"""

from __future__ import annotations

import json
import sys
import time

SETTLE_S = 300.0


def _settled(stats_path: str) -> dict:
    """The connector's counters once every save it queued is stored (or failed)."""
    from memkv.integrations.vllm.stats_file import saves_settled

    counts = saves_settled(stats_path, SETTLE_S)
    if counts is None:  # not settled in time: what there is
        try:
            with open(stats_path) as f:
                counts = json.load(f)
        except (OSError, ValueError):
            counts = {}
    return counts


def main(model: str, out_path: str, spec: dict) -> None:
    from vllm import LLM, SamplingParams

    kwargs = {}
    stats_path = out_path + ".connector.json"
    if spec.get("connector") is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="MemkvConnector",
            kv_connector_module_path="memkv.integrations.vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config={**spec["connector"], "stats_path": stats_path},
        )
    elif spec.get("lmcache_port") is not None:  # the peer (memkv.bench.lmcache_peer)
        from vllm.config import KVTransferConfig

        from memkv.bench.lmcache_peer import kv_transfer_config

        kwargs["kv_transfer_config"] = KVTransferConfig(
            **kv_transfer_config(spec["lmcache_port"]))
    started = time.perf_counter()
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        block_size=spec["block_size"],
        enforce_eager=True,
        # Off: every reused prefix comes from memkv. On (``prefix_caching``): the
        # ideal a load competes with, the KV already in the engine's cache.
        enable_prefix_caching=bool(spec.get("prefix_caching", False)),
        max_num_seqs=1,
        # vLLM serve's step budget: a longer prompt is prefilled in chunks, as users see.
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        seed=0,
        **kwargs,
    )
    engine_start_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=1, temperature=0, detokenize=False)

    def timed(tokens: list[int]) -> tuple[float, int, int]:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]
        return (
            time.perf_counter() - t0,
            int(out.outputs[0].token_ids[0]),
            int(out.num_cached_tokens or 0),
        )

    connected = spec.get("connector") is not None
    warmup_s, _, _ = timed(spec["warmup"])
    if spec.get("prefix_caching"):
        timed(spec["prompt"])  # computed once: later requests hit vLLM's own cache
    before = _settled(stats_path) if connected else {}
    requests = []
    for _ in range(int(spec.get("repeats", 1))):
        ttft_s, first_token, cached = timed(spec["prompt"])
        request: dict = {"ttft_s": ttft_s, "first_token": first_token, "cached_tokens": cached}
        if connected:
            # This request's share of the connector's counters (its saves settled).
            after = _settled(stats_path)
            request["connector"] = {
                k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int | float)
            }
            before = after
        requests.append(request)
    ttfts = sorted(r["ttft_s"] for r in requests)
    median = requests[[r["ttft_s"] for r in requests].index(ttfts[len(ttfts) // 2])]
    result = {
        "engine_start_s": engine_start_s,
        "warmup_s": warmup_s,
        "prompt_tokens": len(spec["prompt"]),
        "requests": requests,
        **median,  # the request of median TTFT stands for the engine
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
