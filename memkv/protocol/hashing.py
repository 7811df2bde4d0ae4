"""Chained content hashes of KV blocks.

``h_i = blake2b(h_{i-1} || layout fingerprint || namespace || token ids of block i)``

The same token prefix under the same layout and namespace gives the same
chain, so sessions share their common prefix blocks. The namespace is the
tenant by default, so tenants never share (or probe for) each other's blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import NewType

import numpy as np

from memkv.errors import InvalidInputError
from memkv.protocol.layout import KVLayout

__all__ = [
    "HASH_BYTES",
    "ROOT_HASH",
    "BlockHash",
    "chain_hashes",
    "hash_block",
    "token_array",
]

BlockHash = NewType("BlockHash", bytes)

HASH_BYTES = 16

#: The parent of a session's first block.
ROOT_HASH = BlockHash(bytes(HASH_BYTES))

# blake2b's personalisation keeps these hashes apart from any other use of blake2b.
_PERSON = b"memkv-block-v1"


_MAX_TOKEN_ID = 2**63 - 1


def token_array(token_ids: Iterable[int] | np.ndarray | Sequence[int]) -> np.ndarray:
    """Token ids as a 1-d little-endian int64 array (the canonical hashing input).

    Raises:
        InvalidInputError: not a 1-d sequence of non-negative integers.
    """
    try:
        arr = np.asarray(token_ids)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"token ids must be a 1-d sequence of ints: {e}") from e
    if arr.ndim != 1:
        raise InvalidInputError(f"token ids must be 1-d, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidInputError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and int(arr.min()) < 0:
        raise InvalidInputError("token ids must be non-negative")
    if arr.size and int(arr.max()) > _MAX_TOKEN_ID:
        # numpy holds 2**63 .. 2**64-1 as uint64; the int64 cast would wrap them negative.
        raise InvalidInputError(f"token ids must be below 2**63, got {int(arr.max())}")
    return arr.astype("<i8", copy=False)


def hash_block(
    parent: BlockHash, token_ids: np.ndarray, fingerprint: bytes, namespace: str
) -> BlockHash:
    """The hash of one block given its parent's hash.

    Args:
        parent: hash of the previous block (``ROOT_HASH`` for the first).
        token_ids: this block's token ids, as returned by :func:`token_array`.
        fingerprint: the layout fingerprint.
        namespace: the tenant (or a public namespace).
    """
    if len(parent) != HASH_BYTES:
        raise InvalidInputError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    ns = namespace.encode("utf-8")
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=_PERSON)
    # Fixed-width fields first, the variable ones length-prefixed: unambiguous.
    h.update(parent)
    h.update(fingerprint)
    h.update(len(ns).to_bytes(4, "little"))
    h.update(ns)
    h.update(np.ascontiguousarray(token_ids, dtype="<i8").tobytes())
    return BlockHash(h.digest())


def chain_hashes(
    token_ids: Iterable[int] | np.ndarray,
    layout: KVLayout,
    namespace: str,
    parent: BlockHash = ROOT_HASH,
) -> list[BlockHash]:
    """Hashes of the blocks covering ``token_ids`` (the last block may be partial).

    Args:
        token_ids: the session's tokens, from the first token of the block that
            follows ``parent``.
        layout: fixes ``block_tokens`` and the fingerprint.
        namespace: the tenant.
        parent: hash of the block before the first one.

    Example:
        >>> layout = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=2)
        >>> len(chain_hashes([1, 2, 3], layout, "tenant-a"))
        2
    """
    if not isinstance(namespace, str):
        raise InvalidInputError(f"namespace must be a str, got {type(namespace).__name__}")
    tokens = token_array(token_ids)
    hashes: list[BlockHash] = []
    prev = parent
    bt = layout.block_tokens
    for start in range(0, tokens.size, bt):
        prev = hash_block(prev, tokens[start : start + bt], layout.fingerprint, namespace)
        hashes.append(prev)
    return hashes

