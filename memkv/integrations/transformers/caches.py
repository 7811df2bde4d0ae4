"""Layouts from a model's config, and a ``DynamicCache`` to and from per-layer K/V."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from memkv.errors import InvalidInputError, LayoutMismatchError
from memkv.storage.layout import DTYPES, KVLayout, StorageDType
from memkv.storage.precision import convert

__all__ = ["DEFAULT_BLOCK_TOKENS", "cache_to_kv", "kv_to_cache", "layout_for"]

#: Tokens per block unless the caller says otherwise (the design's default).
DEFAULT_BLOCK_TOKENS = 256

# Axes of a DynamicCache layer's tensors: [batch, kv_heads, tokens, head_dim].
_LAYER_NDIM = 4
_TOKEN_AXIS = 1  # of a per-layer tensor without the batch axis: [kv_heads, tokens, head_dim]

_NAME_OF_DTYPE: dict[torch.dtype, StorageDType] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


def _text_config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    # Multimodal wrappers keep the decoder's sizes in a sub-config.
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config(decoder=True) if callable(get_text_config) else config


def _dtype_name(dtype: torch.dtype | str, what: str) -> StorageDType:
    if isinstance(dtype, str):
        if dtype in DTYPES:
            return _NAME_OF_DTYPE[DTYPES[dtype]]
    elif dtype in _NAME_OF_DTYPE:
        return _NAME_OF_DTYPE[dtype]
    raise LayoutMismatchError(f"{what} must be one of {sorted(DTYPES)}, got {dtype!r}")


def _model_dtype(model_or_config: Any) -> torch.dtype | str | None:
    dtype = getattr(model_or_config, "dtype", None)  # a model's parameters' dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    config = _text_config(model_or_config)
    # transformers 5 names it ``dtype``, 4.x ``torch_dtype`` (reading the old
    # name in 5.x only warns); either may be unset.
    value = getattr(config, "dtype", None)
    if value is None:
        value = vars(config).get("torch_dtype")
    return value if isinstance(value, torch.dtype | str) else None


def layout_for(
    model_or_config: Any,
    *,
    model_id: str,
    dtype: torch.dtype | str | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> KVLayout:
    """The :class:`KVLayout` of a Llama-family model's cache.

    Precision: as the package docstring says (:mod:`memkv.integrations.transformers`).

    Args:
        model_or_config: a transformers model (``AutoModelForCausalLM``) or its config.
        model_id: the name blocks are fingerprinted with: use one per set of
            weights (e.g. the model directory's name and revision), since caches
            of different weights must never be shared.
        dtype: the stored KV dtype; default the model's dtype (lossless).
        block_tokens: tokens per block.

    Returns:
        The layout (layers, KV heads, head size from the config).

    Raises:
        InvalidInputError: the config lacks the attention sizes of a
            Llama-family model, or ``block_tokens`` is not a positive int.
        LayoutMismatchError: ``dtype`` (or the model's) is not float32,
            float16 or bfloat16, or none is known.
    """
    config = _text_config(model_or_config)
    missing = [
        name for name in ("num_hidden_layers", "num_attention_heads", "hidden_size")
        if getattr(config, name, None) is None
    ]
    if missing:
        raise InvalidInputError(
            f"expected a Llama-family model or config with num_hidden_layers, "
            f"num_attention_heads and hidden_size; {type(config).__name__} lacks {missing}"
        )
    chosen = dtype if dtype is not None else _model_dtype(model_or_config)
    if chosen is None:
        raise LayoutMismatchError(
            f"{type(config).__name__} does not say its dtype; pass dtype= (one of {sorted(DTYPES)})"
        )
    layout = KVLayout.from_model_config(
        config,
        model_id=model_id,
        dtype=_dtype_name(chosen, "dtype"),
        block_tokens=block_tokens,
    )
    if (
        getattr(config, "model_type", None) == "falcon"
        and getattr(config, "new_decoder_architecture", False)
        and _falcon_caches_every_head()
    ):
        # Older transformers' Falcon with the new decoder architecture caches K and V
        # already repeated to every attention head, whatever num_kv_heads says.
        layout = dataclasses.replace(layout, num_kv_heads=config.num_attention_heads)
    return layout


@functools.cache
def _falcon_caches_every_head() -> bool:
    """Whether the installed transformers' Falcon caches repeated KV heads.

    It did up to some 5.x release and caches ``num_kv_heads`` since (5.25): asked of
    a tiny model once, because no version note says when it changed.
    """
    from transformers import FalconConfig, FalconForCausalLM

    probe = FalconConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1,
                         num_attention_heads=4, num_kv_heads=1, new_decoder_architecture=True)
    with torch.no_grad():
        cache = FalconForCausalLM(probe).eval()(torch.zeros(1, 1, dtype=torch.long),
                                                use_cache=True).past_key_values
    keys, _ = cache_to_kv(cache)
    return int(keys[0].shape[0]) == probe.num_attention_heads


def cache_to_kv(cache: DynamicCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V of a one-sequence ``DynamicCache`` (views, no copy).

    Args:
        cache: a filled cache of batch size 1.

    Returns:
        ``(keys, values)``: one ``[kv_heads, tokens, head_dim]`` tensor per layer.

    Raises:
        InvalidInputError: the cache has no layers, or a layer is still empty.
        LayoutMismatchError: a batch size other than 1, a sliding-window
            layer that dropped its oldest tokens (memkv stores every token's
            KV: the message says how to keep them), or layers that hold
            different token counts.
    """
    layers = list(getattr(cache, "layers", ()))
    if not layers:
        raise InvalidInputError(f"expected a filled DynamicCache, got {type(cache).__name__} "
                                "with no layers")
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i, layer in enumerate(layers):
        k = getattr(layer, "keys", None)
        v = getattr(layer, "values", None)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.numel() == 0:
            raise InvalidInputError(f"cache layer {i} holds no KV yet (run a forward pass first)")
        if k.dim() != _LAYER_NDIM or k.shape[0] != 1 or v.shape != k.shape:
            raise LayoutMismatchError(
                f"cache layer {i}: expected K and V of shape [1, kv_heads, tokens, head_dim] "
                f"(one sequence), got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        # k still has its batch axis here: tokens are one axis further along.
        _check_kept_every_token(layer, i, int(k.shape[_TOKEN_AXIS + 1]))
        keys.append(k[0])
        values.append(v[0])
    tokens = {int(k.shape[_TOKEN_AXIS]) for k in keys}
    if len(tokens) != 1:
        raise LayoutMismatchError(
            f"cache layers hold different token counts {sorted(tokens)}; memkv stores caches "
            f"whose every layer keeps every token (no sliding-window layers)"
        )
    return keys, values


def _check_kept_every_token(layer: Any, index: int, kept: int) -> None:
    """Refuse a layer that dropped its oldest tokens (a sliding-window cache layer).

    What such a layer holds is the KV of the *last* tokens; storing it under
    the hashes of the first ones would serve wrong KV later. The remedy is a
    cache that keeps every token, which gives the same output: the attention
    mask, not the cache, applies the window.
    """
    seen = getattr(layer, "cumulative_length", None)
    if isinstance(seen, torch.Tensor):
        seen = int(seen)
    if isinstance(seen, int) and seen > kept:
        raise LayoutMismatchError(
            f"cache layer {index} ({type(layer).__name__}) kept the KV of only its last {kept} "
            f"of {seen} tokens (a sliding window); memkv stores a token's KV only under that "
            f"token, so it needs a cache that keeps every token: give the model a "
            f"DynamicCache() with no config as its cache (every layer then keeps every token, "
            f"and the attention mask still applies the window, so the output is the same), "
            f"or decode with memkv's greedy_decode, which does that"
        )


def kv_to_cache(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    config: Any = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    adopt: bool = False,
) -> DynamicCache:
    """A ``DynamicCache`` holding per-layer K and V (a copy of them, unless ``adopt``).

    Every layer of the cache is a full-attention ``DynamicLayer``, whatever the
    model's layer types: a sliding-window layer built from the config would
    drop the oldest tokens at the next step, and the session's next
    :func:`save_turn` needs every token's KV. The model's output is the same
    (its attention mask applies the window), at the memory cost of keeping
    the whole context in those layers.

    Args:
        keys: one ``[kv_heads, tokens, head_dim]`` (or ``[1, ...]``) tensor per layer.
        values: likewise.
        config: the model's config; its layer count must match.
        dtype: convert to this dtype (the model's), refusing values it cannot hold.
        device: move to this device (the model's).
        adopt: the cache may keep the given tensors themselves (the caller
            hands them over and does not change them after).

    Returns:
        The cache, of batch size 1.

    Raises:
        LayoutMismatchError: K and V disagree in count or shape, a tensor is
            not 3-d (or 4-d with batch 1), or the count disagrees with ``config``.
        PrecisionOverflowError: a value does not fit ``dtype``.
    """
    if len(keys) != len(values) or not keys:
        raise LayoutMismatchError(
            f"expected as many key as value tensors (at least one), got {len(keys)} keys "
            f"and {len(values)} values"
        )
    if config is not None:
        layers = getattr(_text_config(config), "num_hidden_layers", None)
        if layers is not None and layers != len(keys):
            raise LayoutMismatchError(
                f"the config has {layers} layers, got KV for {len(keys)} layers"
            )
    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        k4, v4 = _batched(k, "keys", i), _batched(v, "values", i)
        if k4.shape != v4.shape:
            raise LayoutMismatchError(
                f"layer {i}: keys {tuple(k4.shape)} and values {tuple(v4.shape)} differ"
            )
        if dtype is not None:
            k4, v4 = convert(k4, dtype), convert(v4, dtype)
        if device is not None:
            k4, v4 = k4.to(device), v4.to(device)
        if adopt:
            # ``update`` would concatenate onto an empty tensor: a copy of the
            # whole cache for nothing.
            layer = DynamicLayer()
            layer.lazy_initialization(k4, v4)
            layer.keys, layer.values = k4, v4
            cache.layers.append(layer)
        else:
            cache.update(k4, v4, i)
    return cache


def _batched(t: torch.Tensor, what: str, layer: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise LayoutMismatchError(f"{what}[{layer}] must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == _LAYER_NDIM - 1:
        return t.unsqueeze(0)
    if t.dim() == _LAYER_NDIM and t.shape[0] == 1:
        return t
    raise LayoutMismatchError(
        f"{what}[{layer}] must be [kv_heads, tokens, head_dim] or [1, kv_heads, tokens, "
        f"head_dim], got {tuple(t.shape)}"
    )
