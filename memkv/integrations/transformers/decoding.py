"""Greedy decoding over a restored cache (the reference loop the tests and benches run)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from memkv.errors import InvalidInputError, LayoutMismatchError
from memkv.integrations.transformers.caches import cache_to_kv
from memkv.integrations.transformers.turns import _token_list

__all__ = ["Generation", "greedy_decode"]

# transformers renamed the cache argument and output field (``past_key_values``
# until 5.x deprecated it for ``cache``); both spellings are accepted here.
_CACHE_KWARGS = ("cache", "past_key_values")
_LOGITS_TO_KEEP = "logits_to_keep"


@dataclass(frozen=True, slots=True)
class Generation:
    """A greedy continuation.

    Attributes:
        tokens: the generated token ids.
        cache: the cache after decoding: it covers the input and every
            generated token but the last (which was never fed back).
        first_token_s: seconds from the call to the first token's id.
        total_s: seconds of the whole call.
    """

    tokens: list[int]
    cache: DynamicCache
    first_token_s: float
    total_s: float


def _forward_kwargs(model: Any) -> tuple[str, bool]:
    params = inspect.signature(model.forward).parameters
    name = next((n for n in _CACHE_KWARGS if n in params), _CACHE_KWARGS[-1])
    return name, _LOGITS_TO_KEEP in params


def greedy_decode(
    model: Any,
    input_ids: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    cache: DynamicCache | None = None,
    max_new_tokens: int,
) -> Generation:
    """Greedy decoding that prefills only what ``cache`` does not cover.

    Args:
        model: a causal LM (``AutoModelForCausalLM``), in eval mode.
        input_ids: the whole input, 1-d (or ``[1, T]``).
        cache: the cache of ``input_ids[:cache.get_seq_length()]`` (e.g.
            :attr:`Restored.cache`), or None to prefill everything. It is
            extended in place.
        max_new_tokens: tokens to generate (>= 1).

    Returns:
        :class:`Generation`.

    Raises:
        InvalidInputError: ``max_new_tokens`` < 1, or the cache covers the
            whole input (nothing left to prefill).
        LayoutMismatchError: the cache's dtype is not the model's.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    ids = _token_list(input_ids)
    cached = 0 if cache is None else int(cache.get_seq_length())
    if cached >= len(ids):
        raise InvalidInputError(
            f"the cache covers {cached} tokens of a {len(ids)}-token input; at least one token "
            f"must be left to prefill"
        )
    cache_kwarg, keep_kwarg = _forward_kwargs(model)
    weight = next(model.parameters())
    device = weight.device
    if cache is not None and cached:
        kv_dtype = cache_to_kv(cache)[0][0].dtype
        if kv_dtype != weight.dtype:
            raise LayoutMismatchError(
                f"the cache holds {kv_dtype} KV but the model computes in {weight.dtype}; "
                f"restore it with dtype={weight.dtype} (or store a layout of the model's dtype)"
            )
    extra: dict[str, Any] = {"use_cache": True}
    if keep_kwarg:
        # Logits of the last position only: the prompt's would cost a
        # [tokens, vocab] matmul that greedy decoding never reads.
        extra[_LOGITS_TO_KEEP] = 1
    state: DynamicCache = cache if cache is not None else DynamicCache()
    step = torch.tensor([ids[cached:]], dtype=torch.long, device=device)
    out_tokens: list[int] = []
    start = time.perf_counter()
    first = 0.0
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(step, **{cache_kwarg: state}, **extra)
            returned = out.get(cache_kwarg)
            if returned is not None:  # the same object, extended in place
                state = returned
            token = int(out.logits[0, -1].argmax())
            if not out_tokens:
                first = time.perf_counter() - start
            out_tokens.append(token)
            step = torch.tensor([[token]], dtype=torch.long, device=device)
    return Generation(out_tokens, state, first, time.perf_counter() - start)
