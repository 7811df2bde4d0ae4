"""Save a turn's cache, and restore the longest cached prefix of the next input."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from memkv.errors import CorruptDataError, InvalidInputError, LayoutMismatchError
from memkv.integrations.transformers.caches import _TOKEN_AXIS, cache_to_kv, kv_to_cache
from memkv.integrations.transformers.clients import BlockLike, KVClient, SessionLike, _TurnResult
from memkv.protocol.hashing import chain_hashes, token_array
from memkv.protocol.ids import public_namespace_of
from memkv.storage.layout import KVLayout, block_token_count
from memkv.storage.precision import convert

__all__ = ["Restored", "RestoreSource", "layers_from_blocks", "restore", "save_turn"]

# A cache may cover at most len(input_ids) - this many tokens: the model must be
# fed at least one token of the new input to produce logits for the next one.
_TOKENS_LEFT_TO_PREFILL = 1

# What a block's tier reads as when the server did not say.
_UNKNOWN_TIER = "unknown"


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

    Precision: as the package docstring says (:mod:`memkv.integrations.transformers`).

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

    Precision: as the package docstring says (:mod:`memkv.integrations.transformers`).

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
    stored = view.layout.layout()
    if stored != layout:
        raise LayoutMismatchError(
            f"session {session_id!r} stores layout {stored}, but the caller's model has {layout}"
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
