"""Park and restore a transformers ``DynamicCache`` in memkv, turn by turn.

An inference worker that serves a multi-turn session does, each turn::

    restored = restore(client, input_ids, layout=layout, namespace=tenant, session_id=sid)
    gen = greedy_decode(model, input_ids, cache=restored.cache, max_new_tokens=64)
    # prefilled only input_ids[restored.tokens:]
    save_turn(client, sid, input_ids + gen.tokens[:-1], gen.cache)

:func:`restore` returns the cache of the longest cached prefix of the input —
the session's own chain first (its partial last block included), else a prefix
that other sessions of the namespace stored (a shared system prompt) — and how
many tokens it covers. It always leaves at least one input token to prefill,
since the model needs that token's logits to produce the next one.

Works for causal LMs with one K and one V of equal width per layer and token
(Llama, Qwen2, Mistral, Phi3, Gemma2/3, GPT-NeoX, OPT, Falcon and GPT-BigCode
multi-query …; tested in ``tests/integrations/test_model_matrix.py``): sizes
come from the model's config, never from constants here. Sliding-window layers
are kept whole (every token's KV), since KV is only ever stored under the
tokens it was computed from; the model's attention mask applies the window.

The client is anything with the methods of :class:`KVClient` (the HTTP
:class:`memkv.client.Client` has them), so this module needs no server to test.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from memkv.errors import CorruptDataError, InvalidInputError, LayoutMismatchError
from memkv.protocol.hashing import chain_hashes, token_array
from memkv.protocol.ids import public_namespace_of
from memkv.storage.layout import DTYPES, KVLayout, StorageDType, block_token_count
from memkv.storage.precision import convert

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "BlockLike",
    "Generation",
    "KVClient",
    "MatchLike",
    "Restored",
    "RestoreSource",
    "SessionLike",
    "cache_to_kv",
    "greedy_decode",
    "kv_to_cache",
    "layers_from_blocks",
    "layout_for",
    "restore",
    "save_turn",
]

#: Tokens per block unless the caller says otherwise (the design's default).
DEFAULT_BLOCK_TOKENS = 256

# A cache may cover at most len(input_ids) - this many tokens: the model must be
# fed at least one token of the new input to produce logits for the next one.
_TOKENS_LEFT_TO_PREFILL = 1

# transformers renamed the cache argument and output field (``past_key_values``
# until 5.x deprecated it for ``cache``); both spellings are accepted here.
_CACHE_KWARGS = ("cache", "past_key_values")
_LOGITS_TO_KEEP = "logits_to_keep"

# Axes of a DynamicCache layer's tensors: [batch, kv_heads, tokens, head_dim].
_LAYER_NDIM = 4
_TOKEN_AXIS = 1  # of a per-layer tensor without the batch axis: [kv_heads, tokens, head_dim]

# What a block's tier reads as when the server did not say.
_UNKNOWN_TIER = "unknown"

_NAME_OF_DTYPE: dict[torch.dtype, StorageDType] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


# -- what this module needs of a client ----------------------------------------------------


class SessionLike(Protocol):
    """The fields of a session's state that :func:`restore` reads."""

    @property
    def session_id(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def layout(self) -> KVLayout: ...

    @property
    def tokens(self) -> int: ...

    @property
    def chain(self) -> Sequence[bytes]: ...


class BlockLike(Protocol):
    """One block as a client returns it."""

    @property
    def key(self) -> bytes: ...

    @property
    def tensor(self) -> torch.Tensor: ...

    @property
    def tier(self) -> Any: ...


class MatchLike(Protocol):
    """The answer of a prefix match: leading tokens cached, and their block keys."""

    @property
    def tokens(self) -> int: ...

    @property
    def blocks(self) -> Sequence[bytes]: ...


_TurnResult = TypeVar("_TurnResult", covariant=True)


class KVClient(Protocol[_TurnResult]):
    """The client methods this module calls (:class:`memkv.client.Client` has them all)."""

    def session(self, session_id: str) -> SessionLike: ...

    def append_turn(
        self,
        session_id: str,
        token_ids: Sequence[int],
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        *,
        turn: int | None = None,
    ) -> _TurnResult: ...

    def match(self, layout: KVLayout, namespace: str, token_ids: Sequence[int]) -> MatchLike: ...

    def read_blocks(
        self, session_id: str, start: int = 0, end: int | None = None
    ) -> Iterable[BlockLike]: ...

    def read_blocks_by_key(self, namespace: str, keys: Sequence[bytes]) -> Sequence[BlockLike]: ...


# -- layouts and caches ---------------------------------------------------------------------


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

    Precision (the deployment's ``device.precision``, by default): blocks of a
    session's first turn stay in the model's dtype wherever they go; blocks of
    later turns are stored as float16 once demoted from the hot tier
    (``later_dtype``), and long-idle unshared blocks as int8. An fp32 session
    that must stay exact is created with ``exact_only=True``; every restored
    block says whether it is exact (``Block.exact``, ``Block.lossy``).

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


# -- save and restore ------------------------------------------------------------------------


def save_turn(
    client: KVClient[_TurnResult],
    session_id: str,
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,
    cache: DynamicCache,
    *,
    turn: int | None = None,
    dtype: torch.dtype | str | None = None,
) -> _TurnResult:
    """Park a turn's cache: the KV of every token of the session so far.

    Only blocks the server does not hold yet travel (the client skips the
    stored part of the chain), and a retried turn is a no-op.

    Precision (the deployment's ``device.precision``, by default): blocks of a
    session's first turn stay in the model's dtype wherever they go; blocks of
    later turns are stored as float16 once demoted from the hot tier
    (``later_dtype``), and long-idle unshared blocks as int8. An fp32 session
    that must stay exact is created with ``exact_only=True``; every restored
    block says whether it is exact (``Block.exact``, ``Block.lossy``).

    Args:
        client: a memkv client.
        session_id: an existing session.
        token_ids: the tokens the cache covers, in order. After a decode the
            last generated token has no KV yet: pass ``prompt + generated[:-1]``.
        cache: the model's cache after the turn.
        turn: the turn index (makes a retry idempotent); None = the next one.
        dtype: convert the KV to this dtype first (the session layout's, when
            it differs from the model's); refuses values it cannot hold.

    Returns:
        The client's turn result (new and deduplicated blocks, the chain).

    Raises:
        InvalidInputError: ``token_ids`` and the cache disagree on the token count.
        LayoutMismatchError: the cache does not match the session's layout.
        PrecisionOverflowError: a value does not fit ``dtype``.
    """
    tokens = _token_list(token_ids)
    keys, values = cache_to_kv(cache)
    cached = int(keys[0].shape[_TOKEN_AXIS])
    if cached != len(tokens):
        raise InvalidInputError(
            f"the cache holds KV for {cached} tokens but {len(tokens)} token ids were given; "
            f"pass exactly the tokens the cache covers (after generation the last generated "
            f"token has no KV yet: token_ids[:{cached}])"
        )
    if dtype is not None:
        keys = [convert(k, dtype) for k in keys]
        values = [convert(v, dtype) for v in values]
    return client.append_turn(session_id, tokens, keys, values, turn=turn)


class RestoreSource(StrEnum):
    """Where :func:`restore` found the prefix."""

    NONE = "none"  # nothing usable was cached
    SESSION = "session"  # the session's own chain
    SHARED = "shared"  # blocks another session of the namespace stored


@dataclass(frozen=True, slots=True)
class Restored:
    """The cache of the longest cached prefix of an input.

    Attributes:
        cache: a ``DynamicCache`` covering ``input_ids[:tokens]``, or None
            when nothing was cached.
        tokens: tokens the cache covers; prefill ``input_ids[tokens:]``.
        tiers: the tier each restored block was found in, in chain order
            (``hot``, ``warm``, ``cold``).
        source: where the prefix came from.
        keys: the restored blocks' keys, in chain order.
        lossy: per block, in chain order, the lossy step its bytes went through
            (``""``: exact; else ``int8``, ``fp16``, a lossy cold codec, ... as
            :mod:`memkv.protocol.exactness` names them).
    """

    cache: DynamicCache | None
    tokens: int
    tiers: list[str]
    source: RestoreSource = RestoreSource.NONE
    keys: tuple[bytes, ...] = ()
    lossy: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        """Whether every restored block holds exactly the bytes that were saved."""
        return not any(self.lossy)


def restore(
    client: KVClient[Any],
    input_ids: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    layout: KVLayout,
    namespace: str,
    session_id: str | None = None,
    config: Any = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Restored:
    """The cache of the longest cached prefix of ``input_ids``, and its length.

    The session's own chain is tried first: it may end in a partial block
    (the previous turn's tail), which no other session shares. When that
    leaves a whole block of the input uncovered, the namespace is searched for
    a longer prefix stored by other sessions (e.g. a shared system prompt for
    a new session). The cache is cropped so that at least one input token is
    left to prefill.

    Precision (the deployment's ``device.precision``, by default): blocks of a
    session's first turn stay in the model's dtype wherever they go; blocks of
    later turns are stored as float16 once demoted from the hot tier
    (``later_dtype``), and long-idle unshared blocks as int8. An fp32 session
    that must stay exact is created with ``exact_only=True``; every restored
    block says whether it is exact (``Block.exact``, ``Block.lossy``).

    Args:
        client: a memkv client.
        input_ids: the turn's whole input (history + new message), 1-d.
        layout: the layout the caller's model stores (see :func:`layout_for`).
        namespace: the tenant whose blocks may be shared.
        session_id: the session, if it already exists; None searches the
            namespace only.
        config: the model's config, passed to :func:`kv_to_cache`.
        dtype: the model's dtype, when the layout stores another one.
        device: the model's device.

    Returns:
        :class:`Restored`; ``cache`` is None and ``tokens`` 0 when nothing of
        the input is cached.

    Raises:
        LayoutMismatchError: the session was stored under another layout, or a
            returned block does not fit ``layout``.
        InvalidInputError: the session belongs to another namespace, or
            ``input_ids`` is not a 1-d sequence of token ids.
        CorruptDataError: the server returned other blocks than those asked for.
        UnknownSessionError: no session ``session_id`` (from the client).
    """
    ids = _token_list(input_ids)
    limit = len(ids) - _TOKENS_LEFT_TO_PREFILL
    if limit <= 0:
        return Restored(None, 0, [])
    bt = layout.block_tokens

    own_keys: list[bytes] = []
    own_tokens = 0
    if session_id is not None:
        view = client.session(session_id)
        _check_session(view, session_id, layout, namespace)
        # A publisher's session in a public namespace hashes under its own corner
        # of it (``public@tenant``): the view says which.
        own_keys, own_tokens = _own_prefix(view, ids, layout, view.namespace, limit)

    if own_tokens < (limit // bt) * bt:
        # Another session may hold whole blocks of the input this one lacks.
        # Matching the input cut at ``limit`` finds only prefixes that need no
        # cropping.
        match = client.match(layout, namespace, ids[:limit])
        if match.tokens > own_tokens:
            keys = [bytes(k) for k in match.blocks]
            tokens = min(match.tokens, limit)
            return _assemble(client.read_blocks_by_key(namespace, keys), keys, tokens, layout,
                             RestoreSource.SHARED, config, dtype, device)

    if session_id is None or own_tokens == 0:
        return Restored(None, 0, [])
    # The stream is read to its end (end= bounds it): the client checks the end frame.
    return _assemble(client.read_blocks(session_id, 0, len(own_keys)), own_keys, own_tokens,
                     layout, RestoreSource.SESSION, config, dtype, device)


def _token_list(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2 and token_ids.shape[0] == 1:  # [1, T] as tokenizers return
            token_ids = token_ids[0]
        token_ids = token_ids.cpu().numpy()
    return [int(t) for t in token_array(token_ids)]


def _check_session(view: SessionLike, session_id: str, layout: KVLayout, namespace: str) -> None:
    if view.layout != layout:
        raise LayoutMismatchError(
            f"session {session_id!r} stores layout {view.layout}, but the caller's model has "
            f"{layout}"
        )
    if public_namespace_of(view.namespace) != namespace:
        raise InvalidInputError(
            f"session {session_id!r} belongs to namespace {view.namespace!r}, not {namespace!r}"
        )


def _own_prefix(
    view: SessionLike, ids: list[int], layout: KVLayout, namespace: str, limit: int
) -> tuple[list[bytes], int]:
    """The keys of the session's blocks to read for ``ids``, and the tokens they give.

    The stored tokens are not sent back, only their chain; hashing the input
    cut at the session's length gives the same chain exactly when the tokens
    agree — the partial tail included, which a whole-block match never finds.
    At most ``limit`` tokens are given (the last block read may be cropped).
    """
    if not view.chain or view.tokens <= 0:
        return [], 0
    counts = block_token_count(layout, min(len(ids), view.tokens))
    ours = chain_hashes(ids[: sum(counts)], layout, namespace)
    matched = 0
    for stored, mine in zip(view.chain, ours, strict=False):
        if bytes(stored) != bytes(mine):
            break
        matched += 1
    tokens = min(sum(counts[:matched]), limit)
    needed = math.ceil(tokens / layout.block_tokens)
    return [bytes(k) for k in ours[:needed]], tokens


def _checked(blocks: Iterable[BlockLike], keys: Sequence[bytes],
             seen: list[BlockLike]) -> Iterator[torch.Tensor]:
    """Each block's tensor as it arrives, once its key is the one asked for (into ``seen``).

    A block of another key stops the restore before its bytes are used: a cache
    is never built from blocks of other tokens.
    """
    for i, block in enumerate(blocks):
        got = bytes(block.key)
        if i >= len(keys) or got != keys[i]:
            asked = keys[i].hex() if i < len(keys) else "nothing more"
            raise CorruptDataError(
                f"asked for {len(keys)} blocks and got ones that differ from them (block {i} "
                f"is {got.hex()}, asked {asked}); a cache is never built from blocks of other "
                "tokens")
        seen.append(block)
        yield block.tensor
    if len(seen) != len(keys):
        raise CorruptDataError(f"asked for {len(keys)} blocks and got {len(seen)}")


def _lossy_step(block: BlockLike) -> str:
    """The block's lossy step (``""``: exact); a client's blocks without the flags are exact."""
    step = str(getattr(block, "lossy", "") or "")
    return step or ("" if getattr(block, "exact", True) else "unknown")


def _tier_name(tier: Any) -> str:
    if tier is None:
        return _UNKNOWN_TIER
    return str(getattr(tier, "value", tier))


def _assemble(
    stream: Iterable[BlockLike],
    asked: Sequence[bytes],
    tokens: int,
    layout: KVLayout,
    source: RestoreSource,
    config: Any,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> Restored:
    # Each block is converted into the layer tensors as it arrives, while the
    # next ones are still on the wire (it was: read all, then convert all).
    blocks: list[BlockLike] = []
    tensors = _checked(stream, asked, blocks)
    keys, values = layers_from_blocks(layout, tensors, tokens, dtype)
    for _ in tensors:  # read to the end: the count and the stream's end are checked
        pass
    # The layer tensors are fresh (built for this cache): no second copy of them.
    cache = kv_to_cache(keys, values, config, device=device, adopt=True)
    return Restored(
        cache,
        tokens,
        [_tier_name(b.tier) for b in blocks],
        source,
        tuple(bytes(b.key) for b in blocks),
        tuple(_lossy_step(b) for b in blocks),
    )


def layers_from_blocks(
    layout: KVLayout,
    blocks: Iterable[torch.Tensor],
    tokens: int,
    dtype: torch.dtype | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer ``[kv_heads, tokens, head_dim]`` K and V in ``dtype``, in one pass over the blocks.

    Joining, cropping and converting fused: each block slice is copied (and
    converted) straight into its place in the layer tensors, where joining
    first and converting after made two more passes over the whole cache.
    ``blocks`` may be a stream: each block is placed as it arrives.

    Raises:
        LayoutMismatchError: a block does not fit the layout, or a partial
            block is not the last one.
        CorruptDataError: the blocks hold fewer than ``tokens`` tokens.
        PrecisionOverflowError: a narrowing conversion (e.g. fp32 to fp16)
            meets a value the model's dtype cannot hold.
    """
    target = layout.torch_dtype if dtype is None else dtype
    narrowing = _narrows(layout.torch_dtype, target)
    shape = (layout.num_kv_heads, tokens, layout.head_dim)
    keys = [torch.empty(shape, dtype=target) for _ in range(layout.num_layers)]
    values = [torch.empty(shape, dtype=target) for _ in range(layout.num_layers)]
    done = 0
    partial: tuple[int, int] | None = None  # (index, tokens) of a partial block seen
    for i, block in enumerate(blocks):
        if partial is not None:
            raise LayoutMismatchError(
                f"only the last block may be partial; block {partial[0]} has {partial[1]} "
                f"tokens, expected {layout.block_tokens}, and block {i} follows it"
            )
        held = layout.check_block(block)
        if held != layout.block_tokens:
            partial = (i, held)
        n = min(held, tokens - done)
        if n <= 0:
            break
        part = block[:, :, :, :n]
        if narrowing:
            convert(part, target)  # refuses values the target cannot hold
        for layer in range(layout.num_layers):
            keys[layer][:, done : done + n].copy_(part[layer, 0])
            values[layer][:, done : done + n].copy_(part[layer, 1])
        done += n
    if done < tokens:
        raise CorruptDataError(f"expected blocks covering {tokens} tokens, got {done}")
    return keys, values


def _narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether converting ``source`` to ``target`` can overflow (fp16 <-> bf16 both can)."""
    if source == target or target == torch.float32:
        return False
    return True


# -- decoding ---------------------------------------------------------------------------------


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
