"""What a session router asks of the cluster's other members, as ``typing.Protocol``s.

The router's logic (:class:`memkv.router.SessionRouter`) is written
against these and never against Ray: :mod:`memkv.actors.handles` adapts Ray
actor handles to them (an actor that died surfaces as
:class:`~memkv.errors.MemberGoneError`), and a single process or a test passes
local objects (the tests' fakes).

Every call returns an awaitable that is already on its way when the call
returns (as Ray's object references are): a caller that does not need the
answer (a fire-and-forget prefetch) simply does not await it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

from memkv.protocol.enums import Priority
from memkv.protocol.events import BlockEvents
from memkv.protocol.layout import KVLayout
from memkv.protocol.messages import ChainUpdate, ReadPlan
from memkv.protocol.payload import BlockPayload
from memkv.protocol.stats import ArchiveStats, DeviceStats

__all__ = [
    "Answer",
    "Archive",
    "BlockReader",
    "BlockStore",
    "DeviceInfo",
    "Directory",
    "Holder",
    "RouterPeer",
    "SlotGrant",
    "StoredBlocks",
    "TierOf",
]

_T_co = TypeVar("_T_co", covariant=True)


class Answer(Protocol[_T_co]):
    """A reader's answer on its way: awaited in a gateway's event loop, or taken
    with :meth:`result` by a synchronous caller (the in-cluster API)."""

    def __await__(self) -> Generator[Any, None, _T_co]: ...

    def result(self, timeout: float | None = None) -> _T_co: ...


class Holder(NamedTuple):
    """One session's hold on a pool's blocks, as its owner records it (see ``resync``)."""

    layout: KVLayout
    chain: Sequence[bytes]
    tokens: Sequence[int]
    active: bool
    priority: Priority
    exact_only: bool = False


#: ``(key, tier, tokens)`` of one stored block, as a device answers it.
TierOf = tuple[bytes, str, int]


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Who answered a ping: the device and its process's incarnation (a restarted
    device answers a new one, and comes back empty), and the archive its cold
    tier is (its sessions can be adopted from there by another device that uses
    it; "" when its cold tier is local)."""

    device_id: str
    incarnation: str
    archive: str = ""
    node: str = ""  # the Ray node it runs on (placement near a node); "" when unknown


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """What applying one :class:`ChainUpdate` did on a device."""

    new_blocks: int
    deduplicated_blocks: int
    released_blocks: int  # references dropped (e.g. a replaced partial tail)
    #: The device's block changes since the cursor the put was sent with (None: none asked).
    events: BlockEvents | None = None


@dataclass(frozen=True, slots=True)
class SlotGrant:
    """Slots a device set aside in its shared memory for a writer on its node to fill
    (a write reservation): the writer maps ``segment`` (``segment_bytes`` long),
    copies block i to ``offsets[i]`` (at most ``slot_bytes``), and its append names
    ``(segment, offset, reservation_id)``; the device adopts the bytes where they
    are. Slots no append names within ``ttl_s`` seconds go back."""

    reservation_id: str
    device_id: str
    node_id: str
    incarnation: str
    segment: str
    segment_bytes: int
    slot_bytes: int
    offsets: tuple[int, ...]
    ttl_s: float


class BlockStore(Protocol):
    """One device's tiers, as the owner of sessions directs them (block references
    are per router shard: ``owner``)."""

    @property
    def endpoint(self) -> Any:
        """What a reader calls directly, bypassing the router (the actor handle):
        opaque to the router, which only hands it on."""

    def ping(self) -> Awaitable[DeviceInfo]: ...

    def put(self, update: ChainUpdate, blocks: list[Any], checksums: Sequence[int] | None,
            durable: bool, owner: str,
            since: tuple[str, int] | None = None) -> Awaitable[StoredBlocks]: ...

    def block_events(self, since: tuple[str, int]) -> Awaitable[BlockEvents]:
        """The device's block changes since ``since`` (an epoch and a position)."""
        ...

    def reserve_slots(self, count: int, slot_bytes: int,
                      ttl_s: float) -> Awaitable[SlotGrant | None]:
        """A write reservation of ``count`` slots (None: no shared-memory room)."""
        ...

    def adopt(self, layout: KVLayout, chain: Sequence[bytes], tokens: Sequence[int],
              priority: str, exact_only: bool, owner: str, keep_prefix: bool) -> Awaitable[int]:
        ...

    def resync(self, holders: Sequence[Holder], owner: str) -> Awaitable[list[int]]: ...

    def release(self, keys: Sequence[bytes], active: bool, owner: str) -> Awaitable[int]: ...

    def deactivate(self, keys: Sequence[bytes], offline: bool, was_active: bool,
                   owner: str) -> Awaitable[bool]: ...

    def activate(self, keys: Sequence[bytes], owner: str) -> Awaitable[list[TierOf]]: ...

    def tiers_of(self, keys: Sequence[bytes]) -> Awaitable[list[TierOf]]: ...

    def set_priority(self, keys: Sequence[bytes], priority: str,
                     session_id: str | None) -> Awaitable[None]: ...

    def still_held(self, keys: Sequence[bytes]) -> Awaitable[list[bytes]]: ...

    def archive_held(self, limit: int) -> Awaitable[tuple[int, int]]:
        """Durable cold copies of up to ``limit`` memory-only held blocks:
        ``(written, left)`` (a drain, a planned stop)."""
        ...

    def prefetch(self, keys: Sequence[bytes]) -> Awaitable[int]: ...

    def prefetch_predicted(self, key: bytes) -> Awaitable[int]: ...

    def stats(self) -> Awaitable[DeviceStats]: ...


class Archive(Protocol):
    """A node's cold tier, as a router collects its garbage and repairs its replicas."""

    def ping(self) -> Awaitable[str]: ...

    def keys(self) -> Awaitable[list[bytes]]: ...

    def delete(self, keys: Sequence[bytes]) -> Awaitable[int]: ...

    def stats(self) -> Awaitable[ArchiveStats]: ...

    def get_records(self, keys: Sequence[bytes]) -> Awaitable[list[tuple[bytes, bytes] | None]]:
        """``(frame, fingerprint)`` per key, None where not stored whole (repair's source)."""
        ...

    def put_frames(self, items: Sequence[tuple[bytes, bytes, bytes]],
                   durable: bool) -> Awaitable[int]:
        """Store ``(key, frame, fingerprint)`` triples (repair's destination)."""
        ...


class RouterPeer(Protocol):
    """Another shard of the session table, as one shard asks it before deleting
    archived blocks or admitting past a quota."""

    def referenced(self, keys: list[bytes]) -> Awaitable[list[bool]]: ...

    def tenant_totals(self, tenant: str) -> Awaitable[tuple[int, int]]: ...


class Directory(Protocol):
    """Members by name, as a restarted router finds those its journal names
    (None: no member of that name any more)."""

    def device(self, name: str) -> BlockStore | None: ...

    def archive(self, name: str) -> Archive | None: ...

    def peer(self, name: str) -> RouterPeer | None: ...


class BlockReader(Protocol):
    """What a reader (a gateway, the in-cluster API) asks of a device: blocks by key,
    where they lie in shared memory under a lease (a read plan), and the pins of a
    read. The reader corridor: :class:`memkv.actors.handles.DeviceReaderHandle`
    adapts a device actor to it; tests pass fakes."""

    def read_plan(self, keys: Sequence[bytes], stream: str | None, ttl_s: float,
                  ahead: Sequence[bytes] = (), owner: str | None = None
                  ) -> Answer[ReadPlan]: ...

    def release_lease(self, lease_id: str, owner: str | None = None) -> Answer[bool]: ...

    def hold_for_read(self, keys: Sequence[bytes], ttl_s: float) -> Answer[str]: ...

    def get_blocks(self, keys: Sequence[bytes], stream: str | None = None
                   ) -> Answer[list[BlockPayload]]: ...

    def fetch_blocks(self, keys: Sequence[bytes], stream: str | None = None
                     ) -> Answer[list[BlockPayload]]: ...

    def shared_segments(self) -> Answer[tuple[str, list[tuple[str, int, bool]]]]: ...

    def node(self) -> Answer[str]: ...
