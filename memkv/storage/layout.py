"""The block view of a session's cache: per-layer K/V tensors split into blocks and back.

Per-layer tensors come in the shape transformers' ``DynamicCache`` keeps them:
``[num_kv_heads, tokens, head_dim]``, or ``[1, num_kv_heads, tokens, head_dim]``
with a batch dimension of one. :class:`~memkv.protocol.layout.KVLayout` itself
lives in the import-light protocol package.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from memkv.errors import InvalidInputError, LayoutMismatchError
from memkv.protocol.dtypes import DTYPES as _DTYPE_TABLE
from memkv.protocol.dtypes import StorageDType, torch_dtype
from memkv.protocol.layout import KV_AXIS_SIZE, KVLayout, block_token_count

__all__ = [
    "DTYPES",
    "KV_AXIS_SIZE",
    "KVLayout",
    "StorageDType",
    "block_token_count",
    "join_blocks",
    "split_kv",
]

#: The stored dtypes as torch dtypes, by name (the table is memkv.protocol.dtypes).
DTYPES: dict[str, torch.dtype] = {name: torch_dtype(name) for name in _DTYPE_TABLE}


def _as_layer_tensor(layout: KVLayout, t: object, what: str, layer: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise LayoutMismatchError(f"{what}[{layer}] must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 4:
        if t.shape[0] != 1:
            raise LayoutMismatchError(
                f"{what}[{layer}] has batch size {t.shape[0]}; memkv stores one sequence "
                f"per session (expected [1, kv_heads, tokens, head_dim])"
            )
        t = t[0]
    if t.dim() != 3 or t.shape[0] != layout.num_kv_heads or t.shape[2] != layout.head_dim:
        raise LayoutMismatchError(
            f"{what}[{layer}] must be [kv_heads={layout.num_kv_heads}, tokens, "
            f"head_dim={layout.head_dim}], got {tuple(t.shape)}"
        )
    if t.dtype != layout.torch_dtype:
        raise LayoutMismatchError(f"{what}[{layer}] must have dtype {layout.dtype}, got {t.dtype}")
    return t


def split_kv(
    layout: KVLayout, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Split per-layer K and V tensors into contiguous blocks.

    Args:
        layout: the layout the tensors must match.
        keys: one tensor per layer, ``[kv_heads, tokens, head_dim]`` (or with a
            leading batch dimension of 1).
        values: likewise.

    Returns:
        Blocks ``[layers, 2, kv_heads, t, head_dim]``, ``t == block_tokens``
        except possibly for the last one. Empty when there are no tokens.

    Raises:
        LayoutMismatchError: a tensor's count, shape or dtype disagrees with the
            layout, or K and V disagree on the token count.
    """
    if len(keys) != layout.num_layers or len(values) != layout.num_layers:
        raise LayoutMismatchError(
            f"expected {layout.num_layers} key and value tensors (one per layer), "
            f"got {len(keys)} keys and {len(values)} values"
        )
    ks = [_as_layer_tensor(layout, k, "keys", i) for i, k in enumerate(keys)]
    vs = [_as_layer_tensor(layout, v, "values", i) for i, v in enumerate(values)]
    tokens = ks[0].shape[1]
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        if k.shape[1] != tokens or v.shape[1] != tokens:
            raise LayoutMismatchError(
                f"all layers must hold the same number of tokens ({tokens}); "
                f"layer {i} has {k.shape[1]} keys and {v.shape[1]} values"
            )
    blocks: list[torch.Tensor] = []
    start = 0
    for n in block_token_count(layout, int(tokens)):
        block = torch.empty(layout.block_shape(n), dtype=layout.torch_dtype, device=ks[0].device)
        for layer in range(layout.num_layers):
            block[layer, 0].copy_(ks[layer][:, start : start + n])
            block[layer, 1].copy_(vs[layer][:, start : start + n])
        blocks.append(block)
        start += n
    return blocks


def join_blocks(
    layout: KVLayout, blocks: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Join blocks back into per-layer ``[kv_heads, tokens, head_dim]`` K and V tensors.

    Only the last block may be partial.

    Raises:
        LayoutMismatchError: a block does not match the layout, or a partial
            block is not the last one.
        InvalidInputError: no blocks.
    """
    if not blocks:
        raise InvalidInputError("join_blocks needs at least one block")
    counts = [layout.check_block(b) for b in blocks]
    for i, n in enumerate(counts[:-1]):
        if n != layout.block_tokens:
            raise LayoutMismatchError(
                f"only the last block may be partial; block {i} of {len(blocks)} has {n} "
                f"tokens, expected {layout.block_tokens}"
            )
    joined = torch.cat(list(blocks), dim=3)  # [L, 2, H, T, D], one copy
    keys = [joined[layer, 0] for layer in range(layout.num_layers)]
    values = [joined[layer, 1] for layer in range(layout.num_layers)]
    return keys, values
