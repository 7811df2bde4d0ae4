"""Every suite in quick mode on the session's small cluster: figures exist and are sane.

Never timing thresholds: only that each suite measured what it claims, with
finite positive figures and the files written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from memkv.bench import SUITES
from memkv.bench.context import BenchContext
from memkv.bench.report import SCHEMA, load_results
from memkv.bench.runner import run, run_suite
from memkv.errors import InvalidInputError


@pytest.fixture()
def ctx(cluster: Any, gateway: Any, tmp_path: Path) -> BenchContext:
    return BenchContext(
        quick=True, out=tmp_path / "results", cluster=cluster, gateway_url=gateway.url
    )


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def _written(ctx: BenchContext, suite: str) -> dict[str, Any]:
    doc = json.loads((ctx.out / f"{suite}.json").read_text())
    assert doc["schema"] == SCHEMA and doc["suite"] == suite and doc["quick"]
    assert (ctx.out / f"{suite}.png").stat().st_size > 0
    assert doc["rows"] and all(len(r) == len(doc["columns"]) for r in doc["rows"])
    return doc


def test_resume_quick(ctx: BenchContext) -> None:
    result = run_suite("resume", ctx)
    doc = _written(ctx, "resume")
    assert [s["cached_tokens"] for s in doc["figures"]["sizes"]] == [256, 512]
    for size in result.figures["sizes"]:
        assert _positive(size["recompute_s"]) and _positive(size["ideal_s"])
        assert _positive(size["gateway_restore_e2e_s"])
        for path in ("gateway", "in_cluster", "in_process"):
            t = size[path]
            assert all(_positive(t[k]) for k in ("fetch_s", "decode_s", "copy_s", "prefill_s"))
            assert t["ttft_s"] == pytest.approx(
                t["fetch_s"] + t["decode_s"] + t["copy_s"] + t["prefill_s"]
            )
        assert sum(size["gateway_tiers"].values()) > 0


@pytest.mark.slow
def test_dataplane_quick(ctx: BenchContext) -> None:
    result = run_suite("dataplane", ctx)
    doc = _written(ctx, "dataplane")
    found = {(r["target"], r["op"], r["concurrency"]) for r in doc["figures"]["results"]}
    for op in ("get", "put"):
        assert {("gateway (HTTP)", op, 1), ("raw socket", op, 1)} <= found
        assert {("bare ASGI (uvicorn)", op, 1), ("gateway (block port)", op, 1)} <= found
        assert ("gateway (block port, 2 workers)", op, 1) in found  # the top level: 1 in quick
    by_target = {(row[0], row[1]): row for row in doc["rows"]}
    vs_bare, vs_raw = doc["columns"].index("vs bare ASGI"), doc["columns"].index("vs ceiling")
    assert _positive(by_target[("gateway (HTTP)", "put")][vs_bare])
    assert _positive(by_target[("gateway (block port)", "put")][vs_raw])
    assert _positive(by_target[("gateway (block port, 2 workers)", "put")][vs_raw])
    appends = {r[0].rsplit(" (", 1)[0]: r for r in doc["rows"] if r[1] == "append"}
    assert set(appends) == {"raw socket", "gateway (HTTP)", "gateway (block port)",
                            "gateway (same-host staging)"}
    assert any("same-host staging): a writer on the gateway's host" in n for n in result.notes)
    assert _positive(appends["gateway (block port)"][vs_raw])
    assert set(doc["figures"]["measured"]) == set(doc["figures"]["targets"])
    for path in ("same_node", "in_cluster"):  # the session reads against memcpy
        assert _positive(doc["figures"]["measured"][f"{path}_session_read_vs_memcpy"])
    assert "block_port_put_vs_raw" in " ".join(result.notes)
    reads = {r["target"].split(" (")[0] for r in doc["figures"]["results"] if r["op"] == "read"}
    assert reads == {"same-node", "in-cluster", "gateway HTTP", "gateway block port"}
    for r in result.figures["results"]:
        assert r["ops"] > 0 and (_positive(r["gb_s"]) or r["op"] == "lock wait")
        assert 0 < r["p50_ms"] <= r["p99_ms"]
    demoting = {r["target"] for r in result.figures["results"] if "demoting" in r["target"]}
    modes = {"inline", "write-behind"}
    assert demoting == {f"append demoting to cold ({mode})" for mode in modes}
    assert result.figures["ray_hop_ms"] > 0 and result.figures["crc32_gb_s"] > 0
    # One connection with puts in flight, beside the raw socket with as many.
    assert {("pipelined raw socket", "put", 4), ("pipelined gateway (block port)", "put", 4)} \
        <= found
    assert _positive(doc["figures"]["measured"]["block_port_put_vs_raw_pipelined"])
    # Where a put's CPU goes, per process.
    cpu = result.figures["put_cpu_ms"]
    assert {"gateway", "router", "device", "archive", "client", "raw socket client"} == set(cpu)
    assert all(_positive(cpu[k]) for k in ("gateway", "router", "device", "client"))
    assert any(n.startswith("CPU per") for n in result.notes)
    if not result.figures["redis"]:
        assert "not measured" in " ".join(result.notes)


def test_codecs_quick(ctx: BenchContext) -> None:
    result = run_suite("codecs", ctx)
    _written(ctx, "codecs")
    by_label = {r["label"]: r for r in result.figures["results"]}
    for r in by_label.values():
        assert _positive(r["ratio_vs_fp16"]) and _positive(r["encode_mb_s"])
        assert _positive(r["decode_mb_s"])
    assert by_label["zstd-3+shuffle"]["max_abs_err"] == 0  # lossless
    assert by_label["delta_rl default"]["ratio_vs_fp16"] > 1
    trained = {r["label"]: r for r in result.figures["trained_results"]}
    assert set(trained) == set(by_label)
    assert trained["zstd-3+shuffle"]["max_abs_err"] == 0
    (name, ppl), = result.figures["perplexity"].items()  # --quick: one tiny model
    assert ppl["fp32 (unmodified)"]["rise_pct"] == 0  # the reference itself
    assert ppl["fp32 (unmodified)"]["greedy_agreement"] == 1
    assert ppl["fp32 (unmodified)"]["ratio_vs_fp16"] == pytest.approx(0.5)
    assert ppl["fp16"]["ratio_vs_fp16"] == pytest.approx(1.0)
    # Lossless codecs of fp16 blocks score exactly as fp16 does.
    assert ppl["zstd-3+shuffle"]["perplexity"] == ppl["fp16"]["perplexity"]
    for p in ppl.values():
        assert _positive(p["perplexity"]) and _positive(p["ratio_vs_fp16"])
        assert p["windows"] == 2 and math.isfinite(p["rise_pct"])
        assert 0 <= p["greedy_agreement"] <= 1 and p["rise_ci_pct"] >= 0
    assert ppl["delta_rl default"]["ratio_vs_fp16"] > ppl["int8 (precision.py)"]["ratio_vs_fp16"]
    # Capacity: a real pool holds more tokens per byte as its warm precision drops.
    capacity = result.figures["capacity"]
    for split in {(r["hot_bytes"], r["warm_bytes"]) for r in capacity}:
        by_mode = {r["mode"]: r for r in capacity if (r["hot_bytes"], r["warm_bytes"]) == split}
        fp16, int8, frames = (by_mode[m]["vs_fp16"] for m in (
            "fp16 (no idle step)", "int8 after idle", "Delta+RL frames after idle"))
        assert 0.5 < fp16 <= 1.0 < int8 < frames
    # Stepped int8 codes entropy-code to fewer bytes than plain int8 with zstd.
    assert ppl["delta_rl stepped 0.5"]["ratio_vs_fp16"] > ppl["delta_rl 8b +delta+rl+zstd"][
        "ratio_vs_fp16"]
    cols = result.columns
    assert f"ppl rise % ({name})" in cols and f"greedy agree % ({name})" in cols
    worst = cols.index("worst ppl rise %")
    assert all(r[worst] == r[cols.index(f"ppl rise % ({name})")] for r in result.rows)
    model = result.figures["trained_models"][name]
    assert model["steps"] >= 1
    assert model["path"] is not None  # saved in a scratch dir
    home = str(Path.home() / ".cache")
    assert not model["path"].startswith(home)


def test_byte_llama_is_cached_and_reused(tmp_path: Path) -> None:
    import torch

    from memkv.bench.byte_llama import MANIFEST, train_byte_llama

    model, info = train_byte_llama(tmp_path, quick=True)
    assert not info.cached and info.path is not None and (info.path / MANIFEST).is_file()
    assert info.path.parent == tmp_path / "models" and info.path.name.startswith("byte-llama-")
    again, info2 = train_byte_llama(tmp_path, quick=True)
    assert info2.cached and info2.path == info.path and info2.manifest == info.manifest
    x = info.corpus.held_out[:64].long().unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, again(input_ids=x).logits)
    # A manifest of another recipe is not a finished training: it trains again.
    doc = json.loads((info.path / MANIFEST).read_text())
    doc["recipe"]["seed"] = 99
    (info.path / MANIFEST).write_text(json.dumps(doc))
    _, info3 = train_byte_llama(tmp_path, quick=True)
    assert not info3.cached


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from memkv.bench.byte_llama import default_cache_dir

    monkeypatch.delenv("MEMKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "memkv"
    monkeypatch.setenv("MEMKV_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


def test_perplexity_is_scored_on_the_transformed_cache() -> None:
    import torch

    from memkv.bench.accuracy import perplexity_with_codecs, precision_transform
    from memkv.bench.byte_llama import train_byte_llama
    from memkv.errors import InvalidInputError

    model, info = train_byte_llama(None, quick=True, minutes=0.01)
    assert info.path is None  # quick without a directory: nothing saved

    def noisy(
        keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        gen = torch.Generator().manual_seed(0)
        return (
            [k + torch.randn(k.shape, generator=gen) * 3 for k in keys],
            [v + torch.randn(v.shape, generator=gen) * 3 for v in values],
            1,
        )

    res = perplexity_with_codecs(
        model,
        info.corpus.held_out,
        {"same": precision_transform(torch.float32), "noisy": noisy},
        prefix=32,
        cont=16,
        n_windows=3,
    )
    assert res["same"].rise_pct == 0 and res["same"].scored_tokens == 48
    # A barely trained model need not get worse, but it must see the damaged cache.
    assert res["noisy"].perplexity != res["same"].perplexity
    # fp16 bytes of 3 windows x 2 layers x (K, V) x 2 KV heads x 32 tokens x 16 dims,
    # over the 1 byte per window the transform claims to store.
    assert res["noisy"].stored_bytes == 3
    assert res["noisy"].ratio_vs_fp16 == pytest.approx(3 * 2 * 2 * 2 * 32 * 16 * 2 / 3)
    with pytest.raises(InvalidInputError):
        perplexity_with_codecs(
            model, info.corpus.held_out[:10], {}, prefix=32, cont=16, n_windows=1
        )


@pytest.mark.slow
def test_scale_quick(ctx: BenchContext) -> None:
    result = run_suite("scale", ctx)
    _written(ctx, "scale")
    f = result.figures
    for key in ("create_ops_s", "lookup_ops_s", "turn_ops_s", "delete_ops_s",
                "bare_call_ops_s", "echo_ops_s", "table_bytes_per_idle_session"):
        assert _positive(f[key])
    assert any(row[0].startswith("no-op call with a packed create's bytes") for row in result.rows)
    assert f["gateway"]["requests"] > 0 and _positive(f["gateway"]["req_s"])
    assert all(0 <= u <= 1 for u in f["hot_usage"].values())


def test_eviction_quick_on_a_trace_file(ctx: BenchContext, tmp_path: Path) -> None:
    from memkv.bench.eviction import synthetic_trace

    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": r.timestamp,
                    "input_length": 0,
                    "output_length": 0,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
            for r in synthetic_trace(40)
        )
    )
    ctx.trace = trace
    result = run_suite("eviction", ctx)
    _written(ctx, "eviction")
    for row in result.figures["rows"]:
        ratios = {k: v["hit_ratio"] for k, v in row["policies"].items()}
        assert all(0 <= r <= 1 for r in ratios.values())
        if "Belady (optimum)" in ratios:  # capacities under the reference minimum skip them
            assert ratios["Belady (optimum)"] >= ratios["LRU (libcachesim)"]
            # The same LRU through two implementations: the replays agree exactly.
            assert ratios["memkv LRU"] == pytest.approx(ratios["LRU (libcachesim)"])
        # Keeping only blocks that return: at least LRU's hits on this (fixed) trace.
        assert ratios["memkv LRU"] <= ratios["LRU + oracle admission"]


def test_main_writes_markdown_from_all_results(ctx: BenchContext, tmp_path: Path) -> None:
    md = tmp_path / "BENCHMARKS.md"
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        json.dumps({"timestamp": 0, "hash_ids": [1, 2, 3]})
        + "\n"
        + json.dumps({"timestamp": 5, "hash_ids": [1, 2, 4]})
        + "\n"
    )
    # A 4-block trace: memkv's policies run, the reference ones are skipped (too small).
    (ctx.out).mkdir(parents=True)
    (ctx.out / "legacy.json").write_text('{"benchmark": "old format"}')
    status = run("eviction", quick=True, trace=trace, out=ctx.out, markdown=md, ctx=ctx)
    assert status == 0
    row = load_results(ctx.out)[0]["figures"]["rows"][0]
    # Below the reference minimum: memkv's own policies and the offline admission bound.
    assert set(row["policies"]) == {"memkv horizon (default)", "memkv LRU-K",
                                    "memkv LRU-K (K=2)", "memkv LRU", "LRU + oracle admission"}
    text = md.read_text()
    assert "## eviction" in text and "| capacity |" in text
    assert [d["suite"] for d in load_results(ctx.out)] == ["eviction"]


@pytest.mark.skipif(
    not Path(__file__).resolve().parents[2].joinpath(".venv-vllm/bin/python").exists(),
    reason="no .venv-vllm (make vllm-venv)",
)
@pytest.mark.slow
@pytest.mark.timeout(600)  # five engine starts: 184 s on an idle machine here
def test_vllm_quick(ctx: BenchContext) -> None:
    """Five real engines: the warm ones load the prefix and answer the baseline's token (the
    block port and cluster transports are left to tests/integrations/test_vllm.py)."""
    result = run_suite("vllm", ctx)
    doc = _written(ctx, "vllm")
    runs = {(r["engine"], r["transport"]): r for r in doc["figures"]["runs"]}
    assert runs[("baseline", "-")]["cached_tokens"] == 0
    assert runs[("memkv cold", "gateway")]["cached_tokens"] == 0
    assert runs[("vLLM prefix-cache hit", "-")]["cached_tokens"] == 480
    assert {t for _, t in runs} == {"-", "gateway", "gateway, shared memory", "gateway, HTTP"}
    for transport in ("gateway, shared memory", "gateway, HTTP"):
        warm = runs[("memkv warm", transport)]
        assert warm["cached_tokens"] == 480  # 15 of the 16 blocks: the last token is computed
        assert warm["connector"]["hit_tokens"] == 480 and warm["connector"]["load_failures"] == 0
    assert runs[("memkv cold", "gateway")]["connector"]["save_bytes"] > 0
    same = result.columns.index("same first token")
    assert all(row[same] == "yes" for row in result.rows)  # the same first token everywhere
    figures = doc["figures"]
    # Every engine on the same cores, as its log says (memkv.bench.engine_cores).
    assert figures["same_cores"] and all(r["cores"] for r in figures["runs"])
    assert figures["memcpy_gb_s"] > 0 and "ttft_vs_prefix_cache_hit" in figures["targets"]


@pytest.mark.skipif(
    not Path(__file__).resolve().parents[2].joinpath(".venv-vllm/bin/python").exists(),
    reason="no .venv-vllm (make vllm-venv)",
)
@pytest.mark.slow
# Seven real `vllm serve` starts (each ~30 s here, more on a busy CI machine) and their
# fleets: 254 s on an idle machine, past the suite's 300 s default on a loaded one.
@pytest.mark.timeout(900)
def test_fleet_quick(ctx: BenchContext) -> None:
    """Real `vllm serve`s driven over the OpenAI API: with memkv the resumed turns load
    what the small KV space lost, recompute less, and reply exactly as vLLM alone; through
    the gateway a killed engine's sessions go on on the other."""
    result = run_suite("fleet", ctx)
    doc = _written(ctx, "fleet")
    runs = {r["engine"]: r for r in doc["figures"]["runs"] if r["setting"] != "long sessions "
            "(prompts > step budget, fixed rate)"}
    alone, memkv = runs["vLLM alone"], runs["vLLM + memkv (same node)"]
    assert alone["requests"] == memkv["requests"] == 6  # 3 sessions x 2 turns
    assert alone["loaded_bytes"] is None and not alone["moved_nothing"]  # (no connector)
    assert memkv["saved_bytes"] > 0 and memkv["loaded_bytes"] > 0, memkv["moved_nothing"]
    # Same node: every save copied once into this host's staging and named there.
    assert memkv["saved_blocks_staged"] == memkv["saved_blocks"] > 0
    assert memkv["recomputed_tokens"] < alone["recomputed_tokens"]
    assert memkv["same_replies"] and alone["same_replies"]
    assert all(r["requests_per_s"] > 0 and r["ttft_p50_s"] > 0 for r in runs.values())
    assert "requests_per_s_vs_vllm_alone_not_fitting" in doc["figures"]["targets"]
    # The peer as its users run it (make vllm-venv installs it): LMCache's multiprocess
    # server beside vllm serve; its fresh engine loads what its server kept.
    lmcache = runs["vLLM + LMCache (multiprocess mode)"]
    assert lmcache["requests"] == 6 and lmcache["requests_per_s"] > 0
    assert lmcache["loaded_bytes"] is None  # its bytes are LMCache's, not counted here
    assert doc["figures"]["targets"]["requests_per_s_vs_lmcache_not_fitting"]["measured"] > 0
    assert any("LMCacheMPConnector" in note for note in result.notes)
    # Two engines behind memkv's gateway, one killed between turns: no session lost, the
    # ones it served go on on the other engine with their prefix loaded from memkv.
    failover = runs["2 engines, memkv gateway, one killed"]
    assert failover["requests"] == 6 and failover["sessions_lost"] == 0
    assert failover["sessions_moved"] >= 1 and failover["moved_tokens_loaded"] > 0
    assert failover["killed_engine"] not in failover["moved_turn_served_by"]
    assert failover["same_replies"]
    assert failover["routing"][failover["killed_engine"]].get("failovers", 0) >= 1
    # Long sessions, every prompt prefilled in chunks (a step budget of 256 in the quick
    # run): memkv serves their resumed turns' prefixes, as vLLM counts it, and so does
    # LMCache; every row on the same cores.
    long = {r["engine"]: r for r in doc["figures"]["runs"]
            if r["setting"].startswith("long sessions")}
    assert long["vLLM alone"]["connector_tokens"] == 0
    assert long["vLLM + memkv (same node)"]["connector_tokens"] > 0
    assert long["vLLM + memkv (same node)"]["same_replies"]
    assert long["vLLM + LMCache (multiprocess mode)"]["connector_tokens"] is not None
    assert doc["figures"]["same_cores"] and all(r["cores"] for r in doc["figures"]["runs"])
    assert "long_connector_tokens_vs_lmcache" in doc["figures"]["targets"]


def test_unknown_suite_or_missing_trace_is_refused(tmp_path) -> None:
    with pytest.raises(InvalidInputError, match="suite must be one of"):
        run("nope")
    with pytest.raises(InvalidInputError, match="expected a JSONL file"):
        run("eviction", trace=tmp_path / "absent.jsonl")
    assert set(SUITES) == {
        "resume", "dataplane", "codecs", "eviction", "eviction-agents", "scale", "prefetch",
        "kernels", "vllm", "fleet", "cluster", "front-door", "timing",
    }


def test_front_door_quick(ctx: BenchContext) -> None:
    run_suite("front-door", ctx)
    doc = _written(ctx, "front-door")
    p50 = doc["figures"]["p50_ms"]
    assert set(p50) == {"direct", "gateway", "gateway, with a session"}
    assert all(v > 0 for v in p50.values()) and doc["figures"]["gap_p99_ms"]["gateway"] > 0


@pytest.mark.slow
def test_cluster_quick(ctx: BenchContext) -> None:
    """Six Ray nodes of its own (a subprocess), three faults: nothing acknowledged lost."""
    run_suite("cluster", ctx)
    doc = _written(ctx, "cluster")
    figures = doc["figures"]
    assert figures["paths"]["not_exact"] == 0 and figures["paths"]["socket_gbps"] > 0
    assert len(figures["paths"]["cross_node"]) == 3 and figures["paths"]["same_node"]
    for fault in ("node_loss", "drain", "router_loss"):
        assert figures[fault]["acked_blocks_lost"] == 0, fault
    assert figures["node_loss"]["archive_sessions"] > 0
    assert figures["drain"]["sessions"] > 0 and figures["router_loss"]["seconds"] > 0


def test_prefetch_quick(ctx: BenchContext) -> None:
    result = run_suite("prefetch", ctx)
    doc = _written(ctx, "prefetch")
    rows = doc["figures"]["rows"]
    assert {r["setting"] for r in rows} == {"none", "article (w5, p0.6, 8)", "window 3",
                                           "permissive (w8, p0.05, 32)"}
    for r in rows:
        assert 0 <= r["used"] <= r["prefetched"] and r["wasted"] == r["prefetched"] - r["used"]
        assert 0.0 <= r["hit_ratio"] <= 1.0
    assert all(r["prefetched"] == 0 for r in rows if r["setting"] == "none")
    assert result.rows


def test_prefetching_replay_counts_what_it_brought_in_and_what_was_read() -> None:
    from memkv.bench import trace_replay as rt
    from memkv.storage.config import EvictionConfig, PrefetchConfig
    from memkv.storage.eviction import make_policy
    from memkv.storage.prefetch import MarkovPrefetcher

    # A loop A B C D, A B C D, ...: after D comes A, which a tiny cache has evicted.
    loop = [rt.Request(float(t), (i,)) for t, i in enumerate([1, 2, 3, 4] * 20)]
    config = PrefetchConfig(lookahead_window=1, prefetch_threshold=0.5, max_prefetch_blocks=1)
    plain = rt.replay_prefetching(loop, 2, make_policy(EvictionConfig(policy="lru")), None)
    smart = rt.replay_prefetching(loop, 2, make_policy(EvictionConfig(policy="lru")),
                                  MarkovPrefetcher(config))
    assert plain.result.hit_blocks == 0 and plain.prefetched == 0
    assert smart.prefetched > 0 and smart.used > 0 and smart.accuracy > 0.9
    assert smart.result.hit_blocks == smart.used


def test_agent_fleet_trace_is_seeded_and_shaped_like_a_fleet() -> None:
    from memkv.bench.agent_trace import AgentFleet, agent_fleet_trace

    fleet = AgentFleet(agents=40, turns=(2, 6))
    a, b = agent_fleet_trace(fleet, seed=3), agent_fleet_trace(fleet, seed=3)
    assert a == b and a != agent_fleet_trace(fleet, seed=4)
    assert [r.timestamp for r in a] == sorted(r.timestamp for r in a)
    prefixes = {r.hash_ids[: fleet.system_blocks] for r in a}
    assert len(prefixes) <= fleet.system_prompts  # system prompts are shared
    # A session's turns extend its previous context.
    by_head = {}
    for r in a:
        by_head.setdefault(r.hash_ids[fleet.system_blocks + fleet.tool_blocks], []).append(r)
    grown = [rs for rs in by_head.values() if len(rs) > 1]
    assert grown and all(rs[i].hash_ids == rs[i + 1].hash_ids[: len(rs[i].hash_ids)]
                         for rs in grown for i in range(len(rs) - 1))


def test_eviction_agents_quick(ctx: BenchContext) -> None:
    result = run_suite("eviction-agents", ctx)
    doc = _written(ctx, "eviction-agents")
    assert "agent fleet" in doc["figures"]["trace"]
    for row in doc["figures"]["rows"]:
        for policy in ("memkv horizon (default)", "memkv LRU-K", "memkv LRU"):
            assert 0.0 <= row["policies"][policy]["hit_ratio"] <= 1.0
    assert result.rows


def test_kernels_quick(ctx: BenchContext) -> None:
    result = run_suite("kernels", ctx)
    doc = _written(ctx, "kernels")
    assert doc["figures"]["backend"] in ("cpu", "cuda")
    assert all(_positive(c["gb_per_s"]) for c in doc["figures"]["cases"])
    assert result.rows[0][0] == "copy (anchor)" and result.rows[0][-1] == 1.0


def test_eviction_fit_ranks_settings_on_fit_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    from memkv.bench import eviction_fit
    from memkv.bench.eviction import synthetic_trace

    monkeypatch.setattr(eviction_fit, "GRID", {"decay": (0.5, 0.95), "horizon_share": (2.0,),
                                               "ghosts_per_block": (4.0,)})
    ranked = eviction_fit.fit({"small": synthetic_trace(40, seed=3)})
    assert [r["decay"] for r in ranked] in ([0.5, 0.95], [0.95, 0.5])
    assert ranked[0]["min_margin"] >= ranked[1]["min_margin"]
    assert all(r["min_margin"] <= r["mean_margin"] for r in ranked)


@pytest.mark.slow
def test_timing_quick(ctx: BenchContext) -> None:
    """[2/6] item 6's bench row: the attacker's AUC through the gateway's routes and (the
    vLLM venv being there) the front door with a shared engine, beside the control."""
    result = run_suite("timing", ctx)
    doc = _written(ctx, "timing")
    paths = {r["path"]: r for r in doc["figures"]["results"]}
    assert {"gateway /v1/match", "gateway /v1/blocks/read"} <= set(paths)
    assert all(0.5 <= r["auc"] <= 1.0 for r in paths.values())
    assert all(r["hits"] == 0 for p, r in paths.items() if "control" not in p)
    assert doc["figures"]["public_prefix_hits"] == 16  # a declared public prefix still hits
    if Path(__file__).resolve().parents[2].joinpath(".venv-vllm/bin/python").exists():
        assert "front door, engine shared by tenants" in paths
        assert paths["front door, the victim itself (control)"]["hits"] > 0
    assert result.rows
