"""memkv's block engine: no Ray, no HTTP, nothing above it.

Layouts and hashes, the buddy allocator and arenas, the tiers and the block pool,
eviction and prefetch policies, precision and codecs, archive segments and
diagnostics. The services of the router, device and archive processes are built
on it (memkv.router, memkv.device, memkv.archive); :class:`memkv.store.TieredStore`
composes them in one process.
"""

import importlib
from typing import Any

#: Re-exported names and where they live: imported on first use, so that importing
#: one building block (the journal, say, in the router's torch-free process) never
#: imports the others.
_WHERE = {
    "Priority": "memkv.protocol.enums", "SessionState": "memkv.protocol.enums",
    "Tier": "memkv.protocol.enums", "BlockHash": "memkv.protocol.hashing",
    "chain_hashes": "memkv.protocol.hashing", "StoreConfig": "memkv.storage.config",
    "KVLayout": "memkv.storage.layout", "join_blocks": "memkv.storage.layout",
    "split_kv": "memkv.storage.layout",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BlockHash",
    "KVLayout",
    "Priority",
    "SessionState",
    "StoreConfig",
    "Tier",
    "chain_hashes",
    "join_blocks",
    "split_kv",
]
