"""The project's reference model: a Llama-architecture model built offline from a config.

No package ships a trained causal LM and nothing is downloaded, so demos and
benchmarks build this one with a fixed seed (random weights: right shapes and
mechanics, not meaningful text). ``--model PATH`` options elsewhere take any
local HF causal LM instead.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["REFERENCE_CONFIG", "build_reference_model", "cache_kv", "reference_layout"]

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
    model = LlamaForCausalLM(LlamaConfig(**REFERENCE_CONFIG))
    return model.to(dtype).eval()


def reference_layout(
    model: Any,
    *,
    model_id: str = "memkv-reference-llama",
    dtype: str = "float16",
    block_tokens: int = 256,
) -> Any:
    """The KVLayout of ``model``'s cache (stored in ``dtype``)."""
    from memkv.storage.layout import KVLayout

    return KVLayout.from_model_config(
        model.config,
        model_id=model_id,
        dtype=dtype,  # type: ignore[arg-type]
        block_tokens=block_tokens,
    )


def cache_kv(
    cache: Any, dtype: torch.dtype | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V ``[kv_heads, tokens, head_dim]`` of a transformers DynamicCache."""
    keys = [layer.keys[0] for layer in cache.layers]
    values = [layer.values[0] for layer in cache.layers]
    if dtype is not None:
        keys = [k.to(dtype) for k in keys]
        values = [v.to(dtype) for v in values]
    return keys, values
