"""A device in the caller's own process, as the session service directs devices.

:class:`~memkv.router.service.SessionRouter` talks to devices through
the :class:`~memkv.protocol.members.BlockStore` protocol, whose calls answer
awaitables (an actor call's reference, in a cluster). :class:`LocalBlockStore`
gives it a :class:`~memkv.device.service.DeviceService` of the same
process: each call runs when it is made, as an actor call is sent when it is
made (the router fires some and never awaits them), and its answer or error
waits in a finished future. :class:`LocalDirectory` finds it again by name,
so a router reopened on its journal reattaches to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from memkv.device.service import DeviceService
from memkv.protocol.events import BlockEvents
from memkv.protocol.layout import KVLayout
from memkv.protocol.members import DeviceInfo, Holder, SlotGrant, StoredBlocks, TierOf
from memkv.protocol.messages import ChainUpdate
from memkv.protocol.stats import DeviceStats

__all__ = ["LocalBlockStore", "LocalDirectory"]

_T = TypeVar("_T")


def _now(call: Callable[[], _T]) -> asyncio.Future[_T]:
    """``call()`` run at once; its answer (or error) in a finished future."""
    future: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
    try:
        future.set_result(call())
    except Exception as e:  # noqa: BLE001 - handed to whoever awaits it
        future.set_exception(e)
    return future


class LocalBlockStore:
    """A :class:`DeviceService` of this process as a
    :class:`~memkv.protocol.members.BlockStore`."""

    __slots__ = ("service",)

    def __init__(self, service: DeviceService) -> None:
        self.service = service

    @property
    def endpoint(self) -> DeviceService:
        return self.service

    def ping(self) -> asyncio.Future[DeviceInfo]:
        return _now(self.service.ping)

    def put(self, update: ChainUpdate, blocks: list[Any], checksums: Sequence[int] | None,
            durable: bool, owner: str,
            since: tuple[str, int] | None = None) -> asyncio.Future[StoredBlocks]:
        return _now(lambda: self.service.put(update, blocks, checksums, durable, owner, since))

    def block_events(self, since: tuple[str, int]) -> asyncio.Future[BlockEvents]:
        return _now(lambda: self.service.block_events(since))

    def reserve_slots(self, count: int, slot_bytes: int,
                      ttl_s: float) -> asyncio.Future[SlotGrant | None]:
        return _now(lambda: self.service.reserve_slots(count, slot_bytes, ttl_s))

    def adopt(self, layout: KVLayout, chain: Sequence[bytes], tokens: Sequence[int],
              priority: str, exact_only: bool, owner: str,
              keep_prefix: bool) -> asyncio.Future[int]:
        return _now(lambda: self.service.adopt(
            layout, chain, tokens, priority, exact_only, owner, keep_prefix))

    def resync(self, holders: Sequence[Holder], owner: str) -> asyncio.Future[list[int]]:
        return _now(lambda: self.service.resync(holders, owner))

    def archive_held(self, limit: int) -> asyncio.Future[tuple[int, int]]:
        return _now(lambda: self.service.archive_held(limit))

    def release(self, keys: Sequence[bytes], active: bool, owner: str) -> asyncio.Future[int]:
        return _now(lambda: self.service.release(keys, active, owner))

    def deactivate(self, keys: Sequence[bytes], offline: bool, was_active: bool,
                   owner: str) -> asyncio.Future[bool]:
        return _now(lambda: self.service.deactivate(keys, offline, was_active, owner))

    def activate(self, keys: Sequence[bytes], owner: str) -> asyncio.Future[list[TierOf]]:
        return _now(lambda: self.service.activate(keys, owner))

    def tiers_of(self, keys: Sequence[bytes]) -> asyncio.Future[list[TierOf]]:
        return _now(lambda: self.service.tiers_of(keys))

    def set_priority(self, keys: Sequence[bytes], priority: str,
                     session_id: str | None) -> asyncio.Future[None]:
        return _now(lambda: self.service.set_priority(keys, priority, session_id))

    def still_held(self, keys: Sequence[bytes]) -> asyncio.Future[list[bytes]]:
        return _now(lambda: self.service.still_held(keys))

    def prefetch(self, keys: Sequence[bytes]) -> asyncio.Future[int]:
        return _now(lambda: self.service.prefetch(keys))

    def prefetch_predicted(self, key: bytes) -> asyncio.Future[int]:
        return _now(lambda: self.service.prefetch_predicted(key))

    def stats(self) -> asyncio.Future[DeviceStats]:
        return _now(self.service.stats)


class LocalDirectory:
    """Finds this process's one device by its name (no archives, no other shards)."""

    def __init__(self, device_id: str, device: LocalBlockStore) -> None:
        self._device_id = device_id
        self._device = device

    def device(self, name: str) -> LocalBlockStore | None:
        return self._device if name == self._device_id else None

    def archive(self, name: str) -> None:
        return None

    def peer(self, name: str) -> None:
        return None
