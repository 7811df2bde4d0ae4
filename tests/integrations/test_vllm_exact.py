"""Item 15 of [1/5]: a fresh vLLM engine that loads a 2016-token prefix from memkv
computes the next token with exactly vLLM's own prefix-cache hit's logprob, bit for
bit, through either transport.

Measured while looking for "the 4.8e-7" (one float32 ulp at |logprob| ~ 5.7):
memkv's bytes never differed (every block read back exact). The ulps come from
vLLM itself: on this model an uncached run, a prefix-cache hit, and an engine
configured differently (a connector, prefix caching on or off) each land a few
ulps apart, because they compute the prompt's KV, or the last block's attention
over it, along different paths. Compared with one configuration, a fresh engine
that loads the prefix from memkv lands on vLLM's own prefix-cache hit bit for bit.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .test_vllm import VLLM_PY, run_engine

ENGINE = Path(__file__).with_name("vllm_logprobs.py")
MODEL_CACHE = Path(os.environ.get("MEMKV_DATA_DIR", "~/.cache/memkv")).expanduser() / "vllm-qwen2"

pytestmark = pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm (make vllm-venv)")


def _model() -> Path:
    # Wide enough (14 heads of 64) that vLLM's prefix-cache hit is not bit-equal
    # to its uncached run: the test then tells the two references apart.
    if not (MODEL_CACHE / "config.json").exists():
        script = (
            "import torch, sys\n"
            "from transformers import Qwen2Config, Qwen2ForCausalLM\n"
            "torch.manual_seed(0)\n"
            "cfg = Qwen2Config(vocab_size=1024, hidden_size=896, intermediate_size=1024,\n"
            "    num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2,\n"
            "    max_position_embeddings=4096)\n"
            "Qwen2ForCausalLM(cfg).save_pretrained(sys.argv[1])\n"
        )
        subprocess.run([str(VLLM_PY), "-c", script, str(MODEL_CACHE)], check=True,
                       capture_output=True)
    return MODEL_CACHE


def _engine(mode: str, out: Path, connector: dict | None = None) -> list:
    return run_engine(ENGINE, mode, _model(), out, connector)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_memkv_load_is_bit_exact_with_vllms_own_prefix_cache_hit(cluster, gateway, tmp_path):
    import ray

    # The suite's gateway takes bodies of 8 MiB; 2048 tokens of this model are 8 MiB.
    http = {"url": gateway.url, "max_request_bytes": 4 << 20}
    computed, hit = _engine("twice", tmp_path / "twice.json", http)
    assert (computed[2], hit[2]) == (0, 2016)  # the second hit vLLM's own prefix cache
    # Fresh engines: their 2016 tokens come from memkv, through either transport
    # (blocks stored through an open gateway are in namespace "default").
    loaded = {
        "gateway": _engine("once", tmp_path / "g.json", http)[0],
        "cluster": _engine("once", tmp_path / "c.json", {
            "transport": "cluster",
            "ray_address": ray.get_runtime_context().gcs_address,
            "ray_namespace": cluster.config.cluster.namespace,
            "namespace": "default",
        })[0],
    }
    for transport, run in loaded.items():
        assert run[2] == 2016, (transport, run)  # the prefix came from memkv
        assert run[:2] == hit[:2], (transport, run, hit)  # token and logprob, bit for bit
