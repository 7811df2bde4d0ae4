"""memkv's single-process storage engine: no Ray, no HTTP.

The public entry point is :class:`~memkv.storage.store.TieredStore`; the
modules below it are the building blocks it is made of (layouts and hashes,
the buddy allocator and arenas, eviction and prefetch policies, precision and
codecs, archive segments, diagnostics).
"""

from memkv.protocol.enums import Priority, SessionState, Tier
from memkv.protocol.hashing import BlockHash, chain_hashes
from memkv.storage.config import StoreConfig
from memkv.storage.layout import KVLayout, join_blocks, split_kv
from memkv.storage.store import SessionInfo, StoreStats, TieredStore

__all__ = [
    "BlockHash",
    "KVLayout",
    "Priority",
    "SessionInfo",
    "SessionState",
    "StoreConfig",
    "StoreStats",
    "Tier",
    "TieredStore",
    "chain_hashes",
    "join_blocks",
    "split_kv",
]
