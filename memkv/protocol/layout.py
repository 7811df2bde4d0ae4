"""KV layouts: what one model's cache looks like, and the unit memkv stores it in.

A :class:`KVLayout` says what one model's attention cache looks like. A
*block* holds the KV of ``block_tokens`` consecutive tokens for every layer in
one contiguous tensor ``[num_layers, 2, num_kv_heads, tokens, head_dim]``
(2 = K, V), so a reader can stream it layer by layer. The last block of a
session may be partial (fewer tokens).

Import-light (no torch): the client, the wire format and the router use it.
Splitting per-layer tensors into blocks is :mod:`memkv.storage.layout`'s job.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memkv.errors import InvalidInputError, LayoutMismatchError
from memkv.protocol.dtypes import DTYPES, StorageDType, dtype_info

if TYPE_CHECKING:
    import torch

__all__ = ["FINGERPRINT_BYTES", "KV_AXIS_SIZE", "TOKEN_AXIS", "KVLayout", "block_token_count"]

# Bumped whenever the fingerprint's inputs change, so old keys never alias new ones.
_FINGERPRINT_VERSION = b"memkv-layout-v1"
FINGERPRINT_BYTES = 16

# The K/V axis of a block.
KV_AXIS_SIZE = 2
#: The axis of a block's tokens: (layers, K/V, heads, tokens, head_dim).
TOKEN_AXIS = 3


#: Bounds of a layout's sizes: far above any model's (Llama-3-405B has 126
#: layers, 8 KV heads of 128), low enough that no product of them overflows.
LAYOUT_LIMITS: dict[str, int] = {
    "num_layers": 1024,
    "num_kv_heads": 1024,
    "head_dim": 4096,
    "block_tokens": 65536,
}
#: The largest block a layout may make (all layers of block_tokens tokens).
MAX_BLOCK_BYTES = 1 << 32
MAX_MODEL_ID_CHARS = 256


def _check_positive_int(name: str, value: object) -> None:
    limit = LAYOUT_LIMITS[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
        raise InvalidInputError(
            f"KVLayout.{name} must be an int in [1, {limit}], got {value!r:.40}"
        )


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
        if (
            not isinstance(self.model_id, str)
            or not self.model_id
            or len(self.model_id) > MAX_MODEL_ID_CHARS
        ):
            raise InvalidInputError(
                f"KVLayout.model_id must be a str of 1..{MAX_MODEL_ID_CHARS} characters, "
                f"got {self.model_id!r:.80}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            _check_positive_int(name, getattr(self, name))
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise InvalidInputError(
                f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r:.40}"
            )
        block_bytes = (
            self.num_layers * 2 * self.num_kv_heads * self.block_tokens * self.head_dim
        ) * dtype_info(self.dtype).itemsize
        if block_bytes > MAX_BLOCK_BYTES:
            raise InvalidInputError(
                f"a block of this layout would be {block_bytes} bytes; at most "
                f"{MAX_BLOCK_BYTES} (fewer block_tokens)"
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
        """The model dtype as a torch dtype (imports torch)."""
        from memkv.protocol.dtypes import torch_dtype

        return torch_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per element in the model dtype."""
        return dtype_info(self.dtype).itemsize

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
        import torch

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
        """The layout of a transformers model config (Llama-family attention and its kin).

        KV heads: ``num_key_value_heads``; Falcon's ``num_kv_heads``, and one
        head for multi-query models (Falcon without its new decoder
        architecture, GPT-BigCode); else one per attention head.

        Raises:
            LayoutMismatchError: a cache whose K and V have different widths
                (DeepSeek-style multi-head latent attention): memkv's blocks
                hold K and V of one width.
        """
        heads = config.num_attention_heads
        k_width = (getattr(config, "qk_nope_head_dim", None) or 0) + (
            getattr(config, "qk_rope_head_dim", None) or 0
        )
        v_width = getattr(config, "v_head_dim", None)
        if v_width is not None and k_width and k_width != v_width:
            raise LayoutMismatchError(
                f"{type(config).__name__}: its cache's keys are {k_width} wide and its values "
                f"{v_width} (multi-head latent attention); memkv's blocks hold keys and values "
                f"of one width, so this model's KV cannot be stored"
            )
        if k_width or getattr(config, "kv_lora_rank", None):
            # Equal widths do not make it storable: what an MLA model caches is its
            # latent (a compressed KV and a rope part), not heads of K and V.
            raise LayoutMismatchError(
                f"{type(config).__name__} uses multi-head latent attention (qk_rope_head_dim / "
                f"kv_lora_rank): its cache holds a latent, not per-head keys and values, so "
                f"memkv's blocks cannot hold it"
            )
        multi_query = bool(getattr(config, "multi_query", False)) and not bool(
            getattr(config, "new_decoder_architecture", False)
        )
        kv_heads = (
            1
            if multi_query
            else getattr(config, "num_key_value_heads", None)
            or getattr(config, "num_kv_heads", None)
            or heads
        )
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

