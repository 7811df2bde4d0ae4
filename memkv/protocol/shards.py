"""Which router shard owns a session: a stable hash of its id.

The session table can be split across N router actors (``router.shards``).
Every process that talks to a router — gateways, the in-cluster API, the
routers themselves — finds a session's owner by :func:`shard_of`, with no
central hop. The hash is CRC32 of the id's UTF-8 bytes: stable across
processes and Python versions (``hash()`` is salted per process), and fast
beside the actor call it picks.

The shard count is fixed for a deployment's life: changing it would move
sessions between shards, and no migration of the tables exists.
"""

from __future__ import annotations

import zlib

__all__ = ["shard_name", "shard_of", "shard_owner"]


def shard_of(session_id: str, shards: int) -> int:
    """The index (``0 .. shards-1``) of the shard that owns ``session_id``."""
    if shards == 1:
        return 0
    return zlib.crc32(session_id.encode()) % shards


def shard_name(router_name: str, index: int) -> str:
    """The Ray actor name of shard ``index``: shard 0 keeps the router's own name,
    so a deployment of one shard is named as before shards existed."""
    return router_name if index == 0 else f"{router_name}-{index}"


def shard_owner(index: int, shards: int) -> str:
    """The name a shard's block references go under on a device ("" for one shard)."""
    return "" if shards == 1 else f"shard-{index}"
