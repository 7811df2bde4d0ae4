"""Engines as users run them ([1/6]): prompts several times vLLM's step budget,
prefilled in chunks beside each other, with preemptions; every block the engine
computes is saved, and a fresh engine loads exactly what it lacks.

Each engine is a fresh process of ``vllm_chunked.py`` in the vLLM venv with a
256-token step budget, against this suite's ``memkv up`` deployment.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_vllm import VLLM_PY, _model, run_engine

ENGINE = Path(__file__).with_name("vllm_chunked.py")
BLOCK, PROMPT, ANSWER, NEW, LOCAL = 32, 700, 48, 60, 160
#: Turn 1 computes KV for every position but its last token: these full blocks.
TURN1_BLOCKS_TOKENS = (PROMPT + ANSWER - 1) // BLOCK * BLOCK
#: Turn 2's prompt: every full block but the one with its last token (recomputed).
TURN2_USABLE = (PROMPT + ANSWER + NEW - 1) // BLOCK * BLOCK

pytestmark = pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm (make vllm-venv)")


def _engine(mode: str, out: Path, connector: dict) -> dict:
    return run_engine(ENGINE, mode, _model(), out, connector)


def _no_skips(run: dict) -> None:
    counters = run["connector"]
    assert counters.get("save_skipped_blocks", 0) == 0, counters
    assert counters["save_failures"] == counters["load_failures"] == 0, counters
    assert counters["saves_done"] == counters["saves_queued"] > 0, counters


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chunked_prefills_with_preemptions_save_every_block_a_fresh_engine_loads(
    memkv_deployment, tmp_path
):
    deployment = {"url": memkv_deployment.url, "token": memkv_deployment.token,
                  "model_id": "chunked-concurrent"}
    # 3 prompts of 700 tokens (each 3 steps of the 256-token budget) at once, in a KV
    # space of 45 blocks of 32: two prompts fit (vLLM admits a prompt only if it fits
    # whole), their answers do not, and vLLM preempts one of them.
    first = _engine("turn1", tmp_path / "turn1.json", {**deployment, "kv_blocks": 45})
    assert first["vllm"].get("preemptions", 0) > 0, first["vllm"]
    _no_skips(first)
    # Every full block of each prompt and of each answer (its KV computed) was saved.
    saved = first["connector"]["save_blocks"]
    assert saved >= 3 * TURN1_BLOCKS_TOKENS // BLOCK, first["connector"]

    answers = [r["tokens"] for r in first["requests"]]
    second = _engine("turn2", tmp_path / "turn2.json", {**deployment, "answers": answers})
    # A fresh engine: each turn 2 gets all of turn 1's complete blocks from memkv.
    assert [r["cached"] for r in second["requests"]] == [TURN1_BLOCKS_TOKENS] * 3, second
    assert second["vllm"]["external_kv_transfer"] == 3 * TURN1_BLOCKS_TOKENS, second["vllm"]
    assert second["connector"]["hit_tokens"] == second["vllm"]["external_kv_transfer"]
    _no_skips(second)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_fresh_engine_loads_exactly_what_it_lacks_bit_exact_with_the_prefix_cache_hit(
    memkv_deployment, tmp_path
):
    deployment = {"url": memkv_deployment.url, "token": memkv_deployment.token,
                  "model_id": "chunked-exact"}
    # Turn 1, turn 2 and turn 2 again of each session, one request at a time, in one
    # engine: turn 2 hits vLLM's own prefix cache for turn 1's blocks, the repeat for
    # all of turn 2's (the reference); every block was saved to memkv on the way.
    twice = _engine("twice", tmp_path / "twice.json", deployment)
    _no_skips(twice)
    turn1, turn2, again = (twice["requests"][i::3] for i in range(3))
    assert [r["cached"] for r in turn2] == [TURN1_BLOCKS_TOKENS] * 3, turn2
    assert [r["cached"] for r in again] == [TURN2_USABLE] * 3, again
    assert twice["vllm"]["external_kv_transfer"] == 0 == twice["connector"]["hit_tokens"]

    answers = [r["tokens"] for r in turn1]
    fresh = _engine("fresh", tmp_path / "fresh.json", {**deployment, "answers": answers})
    _no_skips(fresh)
    loaded = fresh["requests"]
    assert [r["cached"] for r in loaded] == [TURN2_USABLE] * 3, loaded
    # Sessions 0 and 1: every token and logprob as vLLM's own prefix-cache hit, bit for bit.
    for got, want in zip(loaded[:2], again[:2], strict=True):
        assert (got["tokens"], got["logprobs"]) == (want["tokens"], want["logprobs"])
    # Session 2: its first 160 tokens were in vLLM's cache (128 loaded, 32 computed by the
    # request before it): memkv wrote only the rest, and says so as vLLM counts it.
    local = fresh["local"]
    assert local["cached"] == LOCAL - BLOCK
    external = fresh["vllm"]["external_kv_transfer"]
    assert external == (LOCAL - BLOCK) + 2 * TURN2_USABLE + (TURN2_USABLE - LOCAL)
    assert fresh["vllm"]["local_cache_hit"] == LOCAL
    assert fresh["connector"]["hit_tokens"] == external
    assert fresh["connector"]["load_blocks"] * BLOCK == external
