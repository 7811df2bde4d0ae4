"""A block cut from a stored one: the partial last block of a fork or a rewind.

The only bytes a fork or rewind copies: the first tokens of one block, read
where the block is (pinned meanwhile) and stored as a block of their own under
the hash of those tokens (:func:`memkv.protocol.forks.prefix_of` checked them).
"""

from __future__ import annotations

import torch

from memkv.errors import ConflictError, InvalidInputError
from memkv.protocol.hashing import BlockHash
from memkv.protocol.layout import TOKEN_AXIS
from memkv.protocol.services import BlockCut
from memkv.storage.block_pool import BlockPool

__all__ = ["cut_block"]


def cut_block(pool: BlockPool, cut: BlockCut) -> torch.Tensor:
    """The first ``cut.tokens`` tokens of block ``cut.source``, as a block of their own.

    Raises:
        UnknownBlockError: the source is not stored here (it moved meanwhile).
        ConflictError: the source is stored lossy (a cut would pass a lossy copy
            off as the tokens' exact KV).
        InvalidInputError: the cut keeps none, or all, of the block's tokens.
    """
    key = BlockHash(bytes(cut.source))
    with pool.pinned_reads([key]) as (fetched,):
        if not fetched.exact:
            raise ConflictError(
                f"block {key.hex()[:16]} is stored lossy ({fetched.lossy}): a fork or rewind "
                f"may end inside it only where it is exact (end at a block boundary instead)")
        tokens = fetched.block.shape[TOKEN_AXIS]
        if not 0 < cut.tokens < tokens:
            raise InvalidInputError(
                f"a cut of block {key.hex()[:16]} ({tokens} tokens) keeps 1 to {tokens - 1} "
                f"of them, got {cut.tokens}")
        # A copy, made while the source is pinned (its view must not outlive the pin).
        return fetched.block.narrow(TOKEN_AXIS, 0, cut.tokens).clone(
            memory_format=torch.contiguous_format)
