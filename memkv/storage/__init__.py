"""memkv's single-process storage engine: no Ray, no HTTP.

The public entry point is :class:`~memkv.storage.store.TieredStore`; the
modules below it are the building blocks it is made of (layouts and hashes,
the buddy allocator and arenas, eviction and prefetch policies, precision and
codecs, archive segments, diagnostics).
"""

from typing import TYPE_CHECKING, Any

from memkv.protocol.enums import Priority, SessionState, Tier
from memkv.protocol.hashing import BlockHash, chain_hashes
from memkv.storage.config import StoreConfig
from memkv.storage.layout import KVLayout, join_blocks, split_kv

if TYPE_CHECKING:
    from memkv.storage.store import SessionInfo, StoreStats, TieredStore

_FROM_STORE = ("SessionInfo", "StoreStats", "TieredStore")


def __getattr__(name: str) -> Any:
    # The store is a shell over the session service and a device, which read
    # memkv.config, which reads building blocks of this package: imported on
    # first use, so importing a building block never imports the whole service.
    if name in _FROM_STORE:
        from memkv.storage import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
