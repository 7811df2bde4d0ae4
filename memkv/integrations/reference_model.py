"""The project's reference model: a Llama-architecture model built offline from a config.

No package ships a trained causal LM and nothing is downloaded, so demos and
benchmarks build this one with a fixed seed (random weights: right shapes and
mechanics, not meaningful text). ``--model PATH`` options elsewhere take any
local HF causal LM instead.
"""

from __future__ import annotations

from typing import Any

import torch

from memkv.integrations.transformers import cache_to_kv, layout_for
from memkv.storage.layout import KVLayout
from memkv.storage.precision import convert

__all__ = [
    "REFERENCE_CONFIG",
    "REFERENCE_MODEL_ID",
    "build_reference_model",
    "cache_kv",
    "reference_layout",
]

#: The model id its caches are fingerprinted with (add the seed: other seeds, other weights).
REFERENCE_MODEL_ID = "memkv-reference-llama"

#: 8 layers, hidden 512, 8 heads, 2 KV heads: a 4k-token cache is 16 MiB in fp16.
REFERENCE_CONFIG: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16384,
}


def build_reference_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """The reference LlamaForCausalLM with weights drawn from ``seed``, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(LlamaConfig(**REFERENCE_CONFIG))
    return model.to(dtype).eval()


def reference_layout(
    model: Any,
    *,
    model_id: str = REFERENCE_MODEL_ID,
    dtype: str | torch.dtype | None = None,
    block_tokens: int = 256,
) -> KVLayout:
    """The KVLayout of ``model``'s cache, stored in ``dtype`` (default: the model's, lossless)."""
    return layout_for(model, model_id=model_id, dtype=dtype, block_tokens=block_tokens)


def cache_kv(
    cache: Any, dtype: torch.dtype | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V ``[kv_heads, tokens, head_dim]`` of a DynamicCache, in ``dtype``."""
    keys, values = cache_to_kv(cache)
    if dtype is not None:
        keys = [convert(k, dtype) for k in keys]
        values = [convert(v, dtype) for v in values]
    return keys, values
