"""Perplexity cost of each precision and codec, on the byte-level Llama trained here
(:mod:`memkv.bench.byte_llama`).

Perplexity with a codec: prefill ``prefix`` bytes of a held-out window, pass
the cache through the codec (encode then decode with memkv's real codecs on
blocks cut by :func:`~memkv.storage.layout.split_kv`), then score the next
``cont`` bytes by teacher forcing on top of the decoded cache, against the
same bytes scored on the unmodified (fp32) cache. Every scored byte is
predicted through the modified cache, so the difference is the codec's alone.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias

from memkv.bench.byte_llama import MODEL_ID
from memkv.errors import InvalidInputError
from memkv.integrations.transformers import DEFAULT_BLOCK_TOKENS
from memkv.storage.codecs import Codec
from memkv.storage.layout import KVLayout, join_blocks, split_kv
from memkv.storage.precision import convert, dequantize_int8, quantize_int8

__all__ = [
    "DEFAULT_CONT",
    "DEFAULT_PREFIX",
    "KVTransform",
    "PerplexityResult",
    "codec_transform",
    "int8_transform",
    "perplexity_with_codec",
    "perplexity_with_codecs",
    "precision_transform",
    "trained_kv_blocks",
]

#: Held-out bytes prefilled, then scored through the (transformed) cache.
DEFAULT_PREFIX = 1024
DEFAULT_CONT = 64
_EVAL_CHUNK = 8  # windows per batched forward pass in perplexity evaluation
_CI95 = 1.96  # normal quantile of a two-sided 95% interval

# --------------------------------------------------------------------------- KV transforms

#: One window's per-layer K and V ``[kv_heads, tokens, head_dim]`` (fp32) ->
#: what the model reads back (any float dtype) and the bytes stored.
KVTransform = Callable[
    [list[torch.Tensor], list[torch.Tensor]], tuple[list[torch.Tensor], list[torch.Tensor], int]
]


def _nbytes(ts: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def precision_transform(dtype: torch.dtype) -> KVTransform:
    """KV kept in ``dtype`` (precision.convert); the bytes are its in-memory size."""

    def apply(keys: list[torch.Tensor], values: list[torch.Tensor]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        k = [convert(t, dtype) for t in keys]
        v = [convert(t, dtype) for t in values]
        return k, v, _nbytes(k) + _nbytes(v)

    return apply


def _fp16_blocks(layout: KVLayout, keys: list[torch.Tensor],
                 values: list[torch.Tensor]) -> list[torch.Tensor]:
    return split_kv(layout, [convert(t, layout.torch_dtype) for t in keys],
                    [convert(t, layout.torch_dtype) for t in values])


def codec_transform(codec: Codec, layout: KVLayout) -> KVTransform:
    """KV stored as memkv blocks (``layout``'s dtype), each encoded then decoded by ``codec``.

    The bytes are the frames' (headers included).
    """

    def apply(keys: list[torch.Tensor], values: list[torch.Tensor]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        frames = [codec.encode(b) for b in _fp16_blocks(layout, keys, values)]
        k, v = join_blocks(layout, [codec.decode(f) for f in frames])
        return k, v, sum(len(f) for f in frames)

    return apply


def int8_transform(layout: KVLayout) -> KVTransform:
    """precision.py's in-memory int8 (K per channel, V per token) of the memkv blocks."""

    def apply(keys: list[torch.Tensor], values: list[torch.Tensor]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        qs = [quantize_int8(b) for b in _fp16_blocks(layout, keys, values)]
        k, v = join_blocks(layout, [dequantize_int8(q) for q in qs])
        return k, v, sum(q.nbytes for q in qs)

    return apply


# --------------------------------------------------------------------------- perplexity


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    """Perplexity of held-out bytes scored on a cache passed through one transform.

    Attributes:
        label: the transform's name.
        perplexity: exp(mean NLL) of the scored bytes on the transformed cache.
        reference: the same on the unmodified cache.
        rise_pct: 100 * (perplexity / reference - 1).
        rise_ci_pct: half-width of the rise's 95% confidence interval, from the
            spread of the per-window NLL differences (windows are independent
            text; the bytes within one are not).
        nll_delta: mean NLL difference (nats per byte).
        ratio_vs_fp16: fp16 bytes of the cache / bytes stored.
        greedy_agreement: share of scored positions whose greedy (argmax) next byte
            is the one the unmodified cache predicts.
        stored_bytes: bytes the transform stored, all windows.
        windows: windows scored.
        scored_tokens: bytes scored, all windows.
    """

    label: str
    perplexity: float
    reference: float
    rise_pct: float
    rise_ci_pct: float
    nll_delta: float
    ratio_vs_fp16: float
    greedy_agreement: float
    stored_bytes: int
    windows: int
    scored_tokens: int


def _eval_windows(held_out: torch.Tensor, n_windows: int, length: int) -> torch.Tensor:
    """``n_windows`` windows of ``length`` bytes, evenly spaced over the held-out text."""
    if n_windows < 1:
        raise InvalidInputError(f"n_windows must be >= 1, got {n_windows}")
    if len(held_out) < length:
        raise InvalidInputError(
            f"expected at least {length} held-out bytes (prefix + cont + 1), got {len(held_out)}"
        )
    last = len(held_out) - length
    starts = [round(i * last / max(1, n_windows - 1)) for i in range(n_windows)]
    return torch.stack([held_out[s : s + length] for s in starts]).long()


def _cache(config: Any, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Any:
    """A fresh DynamicCache over batched per-layer K/V (the forward extends it in place)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k, v, i)
    return cache


def _cache_kwarg(model: Any) -> str:
    """The forward's cache argument and output field (``cache`` in transformers 5)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _nll(model: Any, cont_ids: torch.Tensor, targets: torch.Tensor,
         keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-window summed NLL of ``targets`` fed ``cont_ids`` on the given cache, and argmaxes."""
    name = _cache_kwarg(model)
    out = model(input_ids=cont_ids, use_cache=True, **{name: _cache(model.config, keys, values)})
    logp = F.log_softmax(out.logits.float(), dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).sum(dim=1), logp.argmax(-1)


def perplexity_with_codecs(
    model: Any,
    held_out: torch.Tensor,
    transforms: Mapping[str, KVTransform],
    *,
    prefix: int = DEFAULT_PREFIX,
    cont: int = DEFAULT_CONT,
    n_windows: int,
) -> dict[str, PerplexityResult]:
    """Perplexity of held-out bytes with the prefix's cache passed through each transform.

    For each window of ``prefix + cont + 1`` bytes: prefill ``prefix`` bytes,
    hand the cache to the transform, then feed the next ``cont`` bytes on top
    of what it returns and score each one's successor (teacher forcing). The
    reference scores the same bytes on the unmodified cache.

    Args:
        model: a causal LM with a byte vocabulary, fp32, in eval mode.
        held_out: uint8/long ids the model was not trained on.
        transforms: label -> :data:`KVTransform`.
        prefix: cached bytes per window.
        cont: scored bytes per window.
        n_windows: windows, evenly spaced over ``held_out``.

    Returns:
        label -> :class:`PerplexityResult`, in ``transforms``' order.

    Raises:
        InvalidInputError: ``prefix``/``cont``/``n_windows`` < 1, or too little text.
    """
    if prefix < 1 or cont < 1:
        raise InvalidInputError(f"prefix and cont must be >= 1, got {prefix} and {cont}")
    windows = _eval_windows(held_out, n_windows, prefix + cont + 1)
    ref_nll = torch.zeros(())
    nll = {label: torch.zeros(()) for label in transforms}
    deltas: dict[str, list[torch.Tensor]] = {label: [] for label in transforms}
    agree = dict.fromkeys(transforms, 0)
    stored = dict.fromkeys(transforms, 0)
    fp16_bytes = 0
    with torch.no_grad():
        for chunk in windows.split(_EVAL_CHUNK):
            cache = model(input_ids=chunk[:, :prefix], use_cache=True)[_cache_kwarg(model)]
            keys = [layer.keys for layer in cache.layers]
            values = [layer.values for layer in cache.layers]
            cont_ids, targets = chunk[:, prefix : prefix + cont], chunk[:, prefix + 1 :]
            ref_sum, ref_top = _nll(model, cont_ids, targets, keys, values)
            ref_nll += ref_sum.sum()
            fp16_bytes += (_nbytes(keys) + _nbytes(values)) // keys[0].element_size() * 2
            for label, transform in transforms.items():
                per_window = [transform([k[i] for k in keys], [v[i] for v in values])
                              for i in range(len(chunk))]
                k2 = [torch.stack([w[0][layer] for w in per_window]).to(keys[0].dtype)
                      for layer in range(len(keys))]
                v2 = [torch.stack([w[1][layer] for w in per_window]).to(values[0].dtype)
                      for layer in range(len(values))]
                stored[label] += sum(w[2] for w in per_window)
                window_nll, top = _nll(model, cont_ids, targets, k2, v2)
                nll[label] += window_nll.sum()
                deltas[label].append((window_nll - ref_sum) / cont)
                agree[label] += int((top == ref_top).sum())
    scored = n_windows * cont
    ref_mean = float(ref_nll) / scored
    results: dict[str, PerplexityResult] = {}
    for label in transforms:
        mean = float(nll[label]) / scored
        window_deltas = torch.cat(deltas[label]).double()
        se = (float(window_deltas.std() / math.sqrt(len(window_deltas)))
              if len(window_deltas) > 1 else 0.0)
        results[label] = PerplexityResult(
            label=label,
            perplexity=math.exp(mean),
            reference=math.exp(ref_mean),
            rise_pct=100 * math.expm1(mean - ref_mean),
            rise_ci_pct=100 * _CI95 * se,
            nll_delta=mean - ref_mean,
            ratio_vs_fp16=fp16_bytes / stored[label],
            greedy_agreement=agree[label] / scored,
            stored_bytes=stored[label],
            windows=n_windows,
            scored_tokens=scored,
        )
    return results


def perplexity_with_codec(
    model: Any,
    held_out: torch.Tensor,
    codec_fn: KVTransform,
    *,
    prefix: int = DEFAULT_PREFIX,
    cont: int = DEFAULT_CONT,
    n_windows: int,
) -> PerplexityResult:
    """:func:`perplexity_with_codecs` for one transform (labelled ``"codec"``)."""
    return perplexity_with_codecs(model, held_out, {"codec": codec_fn}, prefix=prefix,
                                  cont=cont, n_windows=n_windows)["codec"]


def trained_kv_blocks(
    model: Any, held_out: torch.Tensor, n_blocks: int, block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> tuple[KVLayout, list[torch.Tensor]]:
    """fp16 memkv blocks of the model's KV over ``n_blocks`` held-out windows of a block each.

    Windows of one block keep every position inside what the model was trained on.

    Returns:
        The layout and the blocks, one per window.
    """
    layout = KVLayout.from_model_config(model.config, model_id=MODEL_ID, dtype="float16",
                                        block_tokens=block_tokens)
    windows = _eval_windows(held_out, n_blocks, block_tokens)
    blocks: list[torch.Tensor] = []
    with torch.no_grad():
        for chunk in windows.split(_EVAL_CHUNK):
            cache = model(input_ids=chunk, use_cache=True)[_cache_kwarg(model)]
            for i in range(len(chunk)):
                blocks += _fp16_blocks(layout, [layer.keys[i] for layer in cache.layers],
                                       [layer.values[i] for layer in cache.layers])
    return layout, blocks
