"""Sessions of one block each: how the pool-level suites fill a block pool (capacity, demotion)."""

from __future__ import annotations

import time

import torch

from memkv.protocol.hashing import chain_hashes
from memkv.protocol.layout import KVLayout
from memkv.router.sessions import SessionTable
from memkv.storage.block_pool import BlockPool

__all__ = ["OneBlockSessions"]


class OneBlockSessions:
    """Appends blocks to ``pool``, each as a new session of one block.

    Each session is its own namespace, so the same bytes are stored again under
    a new key every time (content addressing would otherwise store them once).
    """

    def __init__(self, pool: BlockPool, layout: KVLayout, prefix: str) -> None:
        self._pool = pool
        self._layout = layout
        self._prefix = prefix
        self._owner = SessionTable()
        self._count = 0

    def append(self, block: torch.Tensor) -> tuple[bytes, float]:
        """Store ``block`` as the next session: its key and the seconds the pool's put took."""
        sid = f"{self._prefix}{self._count}"
        self._count += 1
        tokens = self._layout.block_tokens
        self._owner.create(sid, self._layout, namespace=sid)
        chain = [bytes(k) for k in chain_hashes(range(tokens), self._layout, sid)]
        update = self._owner.plan_append(sid, tokens, chain)
        start = time.perf_counter()
        self._pool.put(update, [block])
        elapsed = time.perf_counter() - start
        self._owner.commit_append(sid, update)
        return chain[0], elapsed
