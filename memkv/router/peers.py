"""The other shards of a sharded session table, as one shard asks them.

Sessions are split across router shards by the hash of their id
(:mod:`memkv.protocol.shards`); blocks and tenants are not. Before an archived
block is deleted every shard is asked whether one of its sessions still holds
it, and a quota counts a tenant's use on every shard.
"""

from __future__ import annotations

import asyncio
import logging

from memkv.errors import InvalidInputError, MemberGoneError
from memkv.protocol.members import Directory, RouterPeer
from memkv.protocol.shards import shard_name, shard_of
from memkv.router.state import tenant_of

__all__ = ["ShardPeers"]

logger = logging.getLogger(__name__)


class ShardPeers:
    """Shard ``shard`` of ``shards`` and the others (found by name through ``directory``)."""

    def __init__(self, shard: int, shards: int, router_name: str,
                 directory: Directory | None) -> None:
        if not 0 <= shard < shards:
            raise InvalidInputError(f"shard must be in 0..{shards - 1}, got {shard}")
        self.shard, self.shards = shard, shards
        self.names = [shard_name(router_name, i) for i in range(shards) if i != shard]
        self._directory = directory
        self._peers: list[RouterPeer] | None = None

    def check_owned(self, session_id: str) -> None:
        owner = shard_of(session_id, self.shards)
        if owner != self.shard:
            raise InvalidInputError(
                f"session {session_id!r} belongs to router shard {owner} of {self.shards}, "
                f"not to this one ({self.shard}): find its owner with memkv.protocol.shards"
            )

    def _handles(self) -> list[RouterPeer]:
        """The other shards, found by name once they all exist."""
        if self._peers is None:
            found = [self._directory.peer(n) if self._directory else None for n in self.names]
            missing = [n for n, p in zip(self.names, found, strict=True) if p is None]
            if missing:
                raise MemberGoneError(f"router shards {missing} are not running")
            self._peers = [p for p in found if p is not None]
        return self._peers

    async def unreferenced(self, keys: list[bytes]) -> list[bytes]:
        """Of blocks no session of this shard holds, those no other shard's session holds.

        A block stays when a peer cannot be asked: an archived block kept too
        long costs disk, one deleted too early costs a session.
        """
        if not keys or not self.names:
            return keys
        try:
            answers = await asyncio.gather(*(p.referenced(keys) for p in self._handles()))
        except MemberGoneError as e:
            self._peers = None
            logger.warning("kept %d archive blocks: a router shard did not answer (%s)",
                           len(keys), e)
            return []
        return [k for i, k in enumerate(keys) if not any(a[i] for a in answers)]

    async def usage_elsewhere(
        self, session_id: str, quota: tuple[int | None, int | None]
    ) -> tuple[int, int]:
        """The tenant's sessions and bytes on the other shards (quotas span them).

        Only asked when a quota applies; two shards admitting at once may each
        see the other's use before it grew (an overshoot of at most the
        requests in flight).
        """
        if not self.names or quota == (None, None):
            return 0, 0
        tenant = tenant_of(session_id)
        totals = await asyncio.gather(*(p.tenant_totals(tenant) for p in self._handles()))
        return sum(t[0] for t in totals), sum(t[1] for t in totals)
