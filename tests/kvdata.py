"""Seeded KV for tests: what a model's attention would hand memkv, without a model."""

from __future__ import annotations

import torch

from memkv.protocol.layout import KVLayout

KV = tuple[list[torch.Tensor], list[torch.Tensor]]


def random_kv(layout: KVLayout, tokens: int, seed: int = 0) -> KV:
    """Per-layer keys and values ``[kv_heads, tokens, head_dim]`` of Gaussian noise, in the
    layout's dtype; the same ``seed`` gives the same tensors."""
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_kv_heads, tokens, layout.head_dim)
    keys = [torch.randn(shape, generator=g).to(layout.torch_dtype)
            for _ in range(layout.num_layers)]
    values = [torch.randn(shape, generator=g).to(layout.torch_dtype)
              for _ in range(layout.num_layers)]
    return keys, values


def with_shared_prefix(layout: KVLayout, prefix_tokens: int, own_tokens: int, seed: int) -> KV:
    """A shared prefix's KV (seed 0, the same for every caller) followed by ``own_tokens``
    of the caller's own (``seed``), as sessions that share a system prompt hold."""
    prefix_k, prefix_v = random_kv(layout, prefix_tokens, 0)
    own_k, own_v = random_kv(layout, own_tokens, seed)
    return ([torch.cat([a, b], dim=1) for a, b in zip(prefix_k, own_k, strict=True)],
            [torch.cat([a, b], dim=1) for a, b in zip(prefix_v, own_v, strict=True)])
