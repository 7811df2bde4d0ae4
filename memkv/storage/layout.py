"""KV layouts and the block view of a session's cache.

A :class:`KVLayout` says what one model's attention cache looks like. A
*block* holds the KV of ``block_tokens`` consecutive tokens for every layer in
one contiguous tensor ``[num_layers, 2, num_kv_heads, tokens, head_dim]``
(2 = K, V), so a reader can stream it layer by layer. The last block of a
session may be partial (fewer tokens).

Per-layer tensors come in the shape transformers' ``DynamicCache`` keeps them:
``[num_kv_heads, tokens, head_dim]``, or ``[1, num_kv_heads, tokens, head_dim]``
with a batch dimension of one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from memkv.errors import InvalidInputError, LayoutMismatchError

__all__ = [
    "DTYPES",
    "KVLayout",
    "StorageDType",
    "block_token_count",
    "join_blocks",
    "split_kv",
]

StorageDType = Literal["float32", "float16", "bfloat16"]

#: Model dtypes a layout may declare, by name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# Bumped whenever the fingerprint's inputs change, so old keys never alias new ones.
_FINGERPRINT_VERSION = b"memkv-layout-v1"
FINGERPRINT_BYTES = 16

# The K/V axis of a block.
KV_AXIS_SIZE = 2


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(f"KVLayout.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one model's KV cache, and the unit memkv stores it in.

    Args:
        model_id: a name for the model (weights) the cache came from. Caches of
            different models never share blocks, since the id is fingerprinted.
        num_layers: attention layers.
        num_kv_heads: key/value heads per layer (after GQA grouping).
        head_dim: size of one head.
        dtype: the model's KV dtype: ``float32``, ``float16`` or ``bfloat16``.
        block_tokens: tokens per block (the last block of a session may hold fewer).

    Example:
        >>> layout = KVLayout("llama-tiny", num_layers=8, num_kv_heads=2, head_dim=64)
        >>> layout.block_shape()
        (8, 2, 2, 256, 64)
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: StorageDType = "float16"
    block_tokens: int = 256
    fingerprint: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise InvalidInputError(
                f"KVLayout.model_id must be a non-empty str, got {self.model_id!r}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            _check_positive_int(name, getattr(self, name))
        if self.dtype not in DTYPES:
            raise InvalidInputError(
                f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}"
            )
        object.__setattr__(self, "fingerprint", self._compute_fingerprint())

    def _compute_fingerprint(self) -> bytes:
        h = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
        h.update(_FINGERPRINT_VERSION)
        for part in (
            self.model_id,
            str(self.num_layers),
            str(self.num_kv_heads),
            str(self.head_dim),
            self.dtype,
            str(self.block_tokens),
        ):
            encoded = part.encode("utf-8")
            # Length-prefix every field so ("ab", "c") and ("a", "bc") differ.
            h.update(len(encoded).to_bytes(4, "little"))
            h.update(encoded)
        return h.digest()

    @property
    def torch_dtype(self) -> torch.dtype:
        """The model dtype as a torch dtype."""
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes per element in the model dtype."""
        return torch.tensor([], dtype=self.torch_dtype).element_size()

    def block_shape(self, tokens: int | None = None) -> tuple[int, int, int, int, int]:
        """Shape of a block holding ``tokens`` tokens (a full block by default)."""
        t = self.block_tokens if tokens is None else tokens
        if isinstance(t, bool) or not isinstance(t, int) or not 0 < t <= self.block_tokens:
            raise InvalidInputError(
                f"block token count must be an int in [1, {self.block_tokens}], got {t!r}"
            )
        return (self.num_layers, KV_AXIS_SIZE, self.num_kv_heads, t, self.head_dim)

    def block_nbytes(self, tokens: int | None = None, itemsize: int | None = None) -> int:
        """Bytes of a block of ``tokens`` tokens, in the model dtype unless ``itemsize``."""
        n = 1
        for d in self.block_shape(tokens):
            n *= d
        return n * (self.itemsize if itemsize is None else itemsize)

    def token_nbytes(self) -> int:
        """Bytes of KV per token across all layers, in the model dtype."""
        return self.num_layers * KV_AXIS_SIZE * self.num_kv_heads * self.head_dim * self.itemsize

    def check_block(self, block: torch.Tensor) -> int:
        """Check that ``block`` is a block of this layout; return its token count.

        Raises:
            LayoutMismatchError: wrong dimensionality, shape or dtype.
        """
        if not isinstance(block, torch.Tensor):
            raise LayoutMismatchError(f"expected a torch.Tensor block, got {type(block).__name__}")
        if block.dim() != 5:
            raise LayoutMismatchError(
                f"expected a 5-d block [layers, 2, kv_heads, tokens, head_dim] for "
                f"{self.model_id}, got shape {tuple(block.shape)}"
            )
        tokens = int(block.shape[3])
        expected = (self.num_layers, KV_AXIS_SIZE, self.num_kv_heads, tokens, self.head_dim)
        if tuple(block.shape) != expected or not 0 < tokens <= self.block_tokens:
            raise LayoutMismatchError(
                f"expected block shape {self.block_shape()} (tokens 1..{self.block_tokens}) "
                f"for {self.model_id}, got {tuple(block.shape)}"
            )
        if block.dtype != self.torch_dtype:
            raise LayoutMismatchError(
                f"expected block dtype {self.dtype} for {self.model_id}, got {block.dtype}"
            )
        return tokens

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (for msgpack/JSON); inverse of :meth:`from_dict`."""
        return {
            "model_id": self.model_id,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        """Build a layout from :meth:`to_dict` output, rejecting unknown fields."""
        if not isinstance(data, dict):
            raise InvalidInputError(f"expected a layout dict, got {type(data).__name__}")
        allowed = {"model_id", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_tokens"}
        unknown = set(data) - allowed
        if unknown:
            raise InvalidInputError(
                f"unknown layout fields {sorted(unknown)}; expected {sorted(allowed)}"
            )
        try:
            return cls(**data)
        except TypeError as e:  # a missing required field
            raise InvalidInputError(f"incomplete layout {data!r}: {e}") from e

    @classmethod
    def from_model_config(
        cls, config: Any, *, model_id: str, dtype: StorageDType = "float16", block_tokens: int = 256
    ) -> KVLayout:
        """The layout of a transformers Llama-family model config."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            model_id=model_id,
            num_layers=config.num_hidden_layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            block_tokens=block_tokens,
        )


def block_token_count(layout: KVLayout, total_tokens: int) -> list[int]:
    """Token counts of the blocks covering ``total_tokens`` tokens (last may be partial)."""
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 0:
        raise InvalidInputError(f"token count must be a non-negative int, got {total_tokens!r}")
    full, rest = divmod(total_tokens, layout.block_tokens)
    return [layout.block_tokens] * full + ([rest] if rest else [])


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
