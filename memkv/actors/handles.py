"""Typed handles over Ray actor handles: callers never write ``.remote`` or method names.

A handle's call returns a :class:`Pending` answer, awaitable in a gateway's
event loop and resolvable with :meth:`Pending.result` in a synchronous client,
so one handle serves both (as Ray's object references do).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorUnschedulableError, RayActorError

from memkv.errors import MemberGoneError, MemberLostError
from memkv.protocol.enums import Priority
from memkv.protocol.events import BlockEvents
from memkv.protocol.layout import KVLayout
from memkv.protocol.members import DeviceInfo, SlotGrant, StoredBlocks, TierOf
from memkv.protocol.messages import ChainUpdate, ReadPlan, ReadRoute
from memkv.protocol.payload import BlockPayload
from memkv.protocol.responses import StoredResponse
from memkv.protocol.services import (
    AppendAnswer,
    AppendTurn,
    CreateSession,
    CreateSessions,
    ForkSession,
    ReserveSlots,
    ResumeAnswer,
    RewindSession,
    SessionView,
    SessionViews,
    SlotsReserved,
    decode,
    encode,
)
from memkv.protocol.stats import ArchiveStats, DeviceStats, DrainReport, RepairStats

if TYPE_CHECKING:
    from memkv.protocol.members import Holder
    from memkv.storage.segments import CompactionStats

logger = logging.getLogger(__name__)

__all__ = [
    "ACTOR_GONE_ERRORS",
    "named_actors",
    "ArchiveHandle",
    "DeviceHandle",
    "DeviceReaderHandle",
    "Fetched",
    "MemberHandle",
    "MemberPending",
    "Pending",
    "PeerHandle",
    "RayDirectory",
    "RouterOpsHandle",
    "SessionServiceHandle",
]

_T = TypeVar("_T")


class Pending(Generic[_T]):
    """An answer on its way: ``await`` it, or :meth:`result` outside an event loop."""

    __slots__ = ("_ref", "_read")

    def __init__(self, ref: Any, read: Callable[[Any], _T]) -> None:
        self._ref = ref
        self._read = read

    @property
    def ref(self) -> Any:
        """The Ray object reference (for ``ray.wait`` over many); it holds the
        undecoded answer."""
        return self._ref

    def __await__(self) -> Generator[Any, None, _T]:
        raw = yield from self._ref.__await__()
        return self._read(raw)

    def result(self, timeout: float | None = None) -> _T:
        return self._read(ray.get(self._ref, timeout=timeout))


#: What a call to an actor raises when its process is gone: it died (Ray may
#: restart it), or its node died and Ray cannot place it again (it is pinned to
#: that node: ``ActorUnschedulableError``, which is not a ``RayActorError``).
ACTOR_GONE_ERRORS = (RayActorError, ActorUnschedulableError)


class MemberPending(Pending[_T]):
    """A member's answer: an actor that died surfaces as :class:`MemberGoneError`,
    one whose node is gone as :class:`MemberLostError` (Ray cannot place an actor
    pinned to a dead node again: ``ActorUnschedulableError``, which is not a
    ``RayActorError``). The router's logic knows no Ray errors."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, _T]:
        try:
            raw = yield from self._ref.__await__()
        except ActorUnschedulableError as e:
            raise MemberLostError(str(e)) from e
        except RayActorError as e:
            raise MemberGoneError(str(e)) from e
        return self._read(raw)


def _same(value: Any) -> Any:
    return value


def _none(_: Any) -> None:
    return None


def _readers(devices: dict[str, ActorHandle]) -> dict[str, DeviceReaderHandle]:
    return {device_id: DeviceReaderHandle(actor) for device_id, actor in devices.items()}


def _located(groups: list[tuple[str, Any, list[bytes]]]
             ) -> list[tuple[str, DeviceReaderHandle, list[bytes]]]:
    return [(device_id, DeviceReaderHandle(actor), keys) for device_id, actor, keys in groups]


def _routed(route: ReadRoute) -> ReadRoute:
    return route.with_reader(None if route.device is None else DeviceReaderHandle(route.device))


def _device_reader(answer: tuple[str, Any]) -> tuple[str, DeviceReaderHandle]:
    device_id, actor = answer
    return str(device_id), DeviceReaderHandle(actor)


def _view(document: bytes) -> SessionView:
    return decode(SessionView, document)


def _views(document: bytes) -> SessionViews:
    return decode(SessionViews, document)


def _appended(document: bytes) -> AppendAnswer:
    return decode(AppendAnswer, document)


def _reserved(document: bytes) -> SlotsReserved:
    return decode(SlotsReserved, document)


def _resumed(document: bytes) -> ResumeAnswer:
    return decode(ResumeAnswer, document)


def _stored_response(document: bytes) -> StoredResponse:
    return decode(StoredResponse, document)


class SessionServiceHandle:
    """The session service (:class:`memkv.protocol.services.SessionService`) of one
    router shard, over its Ray handle: every message travels as one document to
    the ``*_wire`` methods of :class:`memkv.actors.router.SessionRouterShell`."""

    __slots__ = ("actor",)

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def create_session(self, request: CreateSession) -> Pending[SessionView]:
        return Pending(self.actor.create_session_wire.remote(encode(request)), _view)

    def create_sessions(self, request: CreateSessions) -> Pending[SessionViews]:
        return Pending(self.actor.create_sessions_wire.remote(encode(request)), _views)

    def session(self, session_id: str) -> Pending[SessionView]:
        return Pending(self.actor.session_wire.remote(session_id), _view)

    def put_blocks(self, request: AppendTurn, blocks: list[Any]) -> Pending[AppendAnswer]:
        return Pending(self.actor.put_blocks_wire.remote(encode(request), blocks), _appended)

    def reserve_slots(self, request: ReserveSlots) -> Pending[SlotsReserved]:
        return Pending(self.actor.reserve_slots_wire.remote(encode(request)), _reserved)

    def resume(self, session_id: str) -> Pending[ResumeAnswer]:
        return Pending(self.actor.resume_wire.remote(session_id), _resumed)

    def suspend(self, session_id: str, offline: bool = False) -> Pending[SessionView]:
        return Pending(self.actor.suspend_wire.remote(session_id, offline), _view)

    def set_priority(self, session_id: str, priority: Priority) -> Pending[SessionView]:
        return Pending(self.actor.set_priority_wire.remote(session_id, priority.value), _view)

    def delete_session(self, session_id: str) -> Pending[None]:
        return Pending(self.actor.delete_session.remote(session_id), _none)

    def fork_session(self, request: ForkSession) -> Pending[SessionView]:
        return Pending(self.actor.fork_session_wire.remote(encode(request)), _view)

    def rewind_session(self, request: RewindSession) -> Pending[SessionView]:
        return Pending(self.actor.rewind_session_wire.remote(encode(request)), _view)

    # -- stored responses (memkv.protocol.responses.ResponseService) ----------------------

    def put_response(self, session_id: str, response: StoredResponse) -> Pending[None]:
        return Pending(self.actor.put_response_wire.remote(session_id, encode(response)), _none)

    def get_response(self, session_id: str, response_id: str) -> Pending[StoredResponse]:
        return Pending(self.actor.get_response_wire.remote(session_id, response_id),
                       _stored_response)

    def delete_response(self, session_id: str, response_id: str) -> Pending[None]:
        return Pending(self.actor.delete_response.remote(session_id, response_id), _none)

    # -- the reader corridor and the shard's liveness (a gateway's other questions) ----

    def read_route(self, session_id: str, start: int = 0,
                   end: int | None = None) -> Pending[ReadRoute]:
        return Pending(self.actor.read_route.remote(session_id, start, end), _routed)

    def device_failed(self, device_id: str) -> Pending[None]:
        return Pending(self.actor.device_failed.remote(device_id), _none)

    def notify_input_end(self, session_id: str) -> Pending[int]:
        return Pending(self.actor.notify_input_end.remote(session_id), int)

    def ping(self) -> Pending[str]:
        return Pending(self.actor.ping.remote(), str)

    def devices(self) -> Pending[dict[str, DeviceReaderHandle]]:
        """Every device this shard places sessions on, by id, as readers."""
        return Pending(self.actor.devices.remote(), _readers)

    def device_of(self, session_id: str) -> Pending[tuple[str, DeviceReaderHandle]]:
        """The session's device (placed there now if it has none), as a reader."""
        return Pending(self.actor.device_of.remote(session_id), _device_reader)

    def locate_blocks(self, keys: list[bytes], namespace: str | list[str] | None
                      ) -> Pending[list[tuple[str, DeviceReaderHandle, list[bytes]]]]:
        """Which devices hold ``keys`` (of ``namespace``): ``(id, reader, keys)`` groups."""
        return Pending(self.actor.locate_blocks.remote(keys, namespace), _located)


class RouterOpsHandle:
    """A router shard's operator face: its members as actors, drains, replica repair
    and the journal (the planned operations of the in-cluster API)."""

    __slots__ = ("actor",)

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def device_actors(self) -> Pending[dict[str, ActorHandle]]:
        """Every live device's actor handle, by id (a client that attached finds them)."""
        return Pending(self.actor.devices.remote(), dict)

    def archive_actors(self) -> Pending[dict[str, ActorHandle]]:
        return Pending(self.actor.archives.remote(), dict)

    def drain_device(self, device_id: str) -> Pending[DrainReport]:
        return Pending(self.actor.drain_device.remote(device_id), _same)

    def retire_archive(self, archive_id: str) -> Pending[None]:
        return Pending(self.actor.retire_archive.remote(archive_id), _none)

    def repair_replicas(self) -> Pending[RepairStats]:
        return Pending(self.actor.repair_replicas.remote(), _same)

    def flush_journal(self) -> Pending[None]:
        return Pending(self.actor.flush_journal.remote(), _none)


class MemberHandle:
    """What every member actor (device, archive) answers to an operator: where it
    runs, and a clean close (devices unlink their shared memory, archives flush)."""

    __slots__ = ("actor",)

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def node(self) -> Pending[str]:
        return Pending(self.actor.node.remote(), str)

    def close(self) -> Pending[None]:
        return Pending(self.actor.close.remote(), _none)


class Fetched(Pending[list[BlockPayload]]):
    """A device's ``fetch_blocks``: its answer is a reference to the blocks it put in the
    node's object store (one copy, mapped by every reader of the node); awaiting this
    awaits both."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, list[BlockPayload]]:
        ref = yield from self._ref.__await__()
        payloads = yield from ref.__await__()
        return list(payloads)

    def result(self, timeout: float | None = None) -> list[BlockPayload]:
        return list(ray.get(ray.get(self._ref, timeout=timeout), timeout=timeout))


class DeviceReaderHandle:
    """A device actor as a :class:`memkv.protocol.members.BlockReader`: the reader
    corridor of gateways and the in-cluster API (no raw ``.remote`` calls there)."""

    __slots__ = ("actor",)

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def read_plan(self, keys: Sequence[bytes], stream: str | None, ttl_s: float,
                  ahead: Sequence[bytes] = (), owner: str | None = None) -> Pending[ReadPlan]:
        return Pending(self.actor.read_plan.remote(list(keys), stream, ttl_s, list(ahead),
                                                   owner), _same)

    def release_lease(self, lease_id: str, owner: str | None = None) -> Pending[bool]:
        return Pending(self.actor.release_lease.remote(lease_id, owner), bool)

    def hold_for_read(self, keys: Sequence[bytes], ttl_s: float) -> Pending[str]:
        return Pending(self.actor.hold_for_read.remote(list(keys), ttl_s), str)

    def get_blocks(self, keys: Sequence[bytes], stream: str | None = None
                   ) -> Pending[list[BlockPayload]]:
        return Pending(self.actor.get_blocks.remote(list(keys), stream), list)

    def fetch_blocks(self, keys: Sequence[bytes], stream: str | None = None) -> Fetched:
        return Fetched(self.actor.fetch_blocks.remote(list(keys), stream), list)

    def shared_segments(self) -> Pending[tuple[str, list[tuple[str, int, bool]]]]:
        return Pending(self.actor.shared_segments.remote(), _same)

    def node(self) -> Pending[str]:
        return Pending(self.actor.node.remote(), str)


class DeviceHandle:
    """A device actor as a :class:`memkv.protocol.members.BlockStore`."""

    __slots__ = ("actor",)

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    @property
    def endpoint(self) -> Any:
        return self.actor

    def ping(self) -> MemberPending[DeviceInfo]:
        return MemberPending(self.actor.ping.remote(), _same)

    def put(self, update: ChainUpdate, blocks: list[Any], checksums: Sequence[int] | None,
            durable: bool, owner: str,
            since: tuple[str, int] | None = None) -> MemberPending[StoredBlocks]:
        return MemberPending(
            self.actor.put.remote(update, blocks, checksums, durable, owner, since), _same)

    def block_events(self, since: tuple[str, int]) -> MemberPending[BlockEvents]:
        return MemberPending(self.actor.block_events.remote(since), _same)

    def reserve_slots(self, count: int, slot_bytes: int,
                      ttl_s: float) -> MemberPending[SlotGrant | None]:
        return MemberPending(self.actor.reserve_slots.remote(count, slot_bytes, ttl_s), _same)

    def adopt(self, layout: KVLayout, chain: Sequence[bytes], tokens: Sequence[int],
              priority: str, exact_only: bool, owner: str,
              keep_prefix: bool) -> MemberPending[int]:
        return MemberPending(self.actor.adopt.remote(
            layout, chain, tokens, priority, exact_only, owner, keep_prefix), _same)

    def resync(self, holders: Sequence[Holder], owner: str) -> MemberPending[list[int]]:
        return MemberPending(self.actor.resync.remote(holders, owner), _same)

    def release(self, keys: Sequence[bytes], active: bool, owner: str) -> MemberPending[int]:
        return MemberPending(self.actor.release.remote(keys, active, owner), _same)

    def deactivate(self, keys: Sequence[bytes], offline: bool, was_active: bool,
                   owner: str) -> MemberPending[bool]:
        return MemberPending(
            self.actor.deactivate.remote(keys, offline, was_active, owner), _same)

    def activate(self, keys: Sequence[bytes], owner: str) -> MemberPending[list[TierOf]]:
        return MemberPending(self.actor.activate.remote(keys, owner), _same)

    def tiers_of(self, keys: Sequence[bytes]) -> MemberPending[list[TierOf]]:
        return MemberPending(self.actor.tiers_of.remote(keys), _same)

    def set_priority(self, keys: Sequence[bytes], priority: str,
                     session_id: str | None) -> MemberPending[None]:
        return MemberPending(self.actor.set_priority.remote(keys, priority, session_id), _none)

    def still_held(self, keys: Sequence[bytes]) -> MemberPending[list[bytes]]:
        return MemberPending(self.actor.still_held.remote(keys), _same)

    def prefetch(self, keys: Sequence[bytes]) -> MemberPending[int]:
        return MemberPending(self.actor.prefetch.remote(keys), _same)

    def prefetch_predicted(self, key: bytes) -> MemberPending[int]:
        return MemberPending(self.actor.prefetch_predicted.remote(key), _same)

    def archive_held(self, limit: int) -> MemberPending[tuple[int, int]]:
        return MemberPending(self.actor.archive_held.remote(limit), _same)

    def stats(self) -> MemberPending[DeviceStats]:
        return MemberPending(self.actor.stats.remote(), _same)


class ArchiveHandle:
    """An archive actor as a :class:`memkv.protocol.members.Archive`."""

    __slots__ = ("actor",)

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def ping(self) -> MemberPending[str]:
        return MemberPending(self.actor.ping.remote(), _same)

    def keys(self) -> MemberPending[list[bytes]]:
        return MemberPending(self.actor.keys.remote(), _same)

    def delete(self, keys: Sequence[bytes]) -> MemberPending[int]:
        return MemberPending(self.actor.delete.remote(keys), _same)

    def compact(self, force: bool = False) -> MemberPending[CompactionStats]:
        return MemberPending(self.actor.compact.remote(force), _same)

    def stats(self) -> MemberPending[ArchiveStats]:
        return MemberPending(self.actor.stats.remote(), _same)

    def get_records(self, keys: Sequence[bytes]) -> MemberPending[list[tuple[bytes, bytes] | None]]:
        return MemberPending(self.actor.get_records.remote(list(keys)), _same)

    def put_frames(self, items: Sequence[tuple[bytes, bytes, bytes]],
                   durable: bool) -> MemberPending[int]:
        return MemberPending(self.actor.put_frames.remote(list(items), durable), _same)


class PeerHandle:
    """Another router shard as a :class:`memkv.protocol.members.RouterPeer`."""

    __slots__ = ("actor",)

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def referenced(self, keys: list[bytes]) -> MemberPending[list[bool]]:
        return MemberPending(self.actor.referenced.remote(keys), _same)

    def tenant_totals(self, tenant: str) -> MemberPending[tuple[int, int]]:
        return MemberPending(self.actor.tenant_totals.remote(tenant), _same)


def named_actors(names: Sequence[str], namespace: str | None) -> list[tuple[str, Any]]:
    """``(name, handle)`` of the actors of ``names`` Ray still knows, in order.

    One whose node died may be gone for good; it is left out (with a warning)
    rather than failing the caller: an actor constructor that raises is never
    restarted, and a device or router must come back without that archive.
    """
    found = []
    for name in names:
        try:
            found.append((name, ray.get_actor(name, namespace=namespace)))
        except ValueError as e:
            logger.warning("actor %s is gone: %s", name, e)
    return found


class RayDirectory:
    """Members found by their Ray name in the caller's namespace (a
    :class:`memkv.protocol.members.Directory`); None: no actor of that name."""

    def __init__(self, namespace: str | None = None) -> None:
        self._namespace = namespace

    def _find(self, name: str) -> Any:
        namespace = self._namespace or ray.get_runtime_context().namespace
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            return None

    def device(self, name: str) -> DeviceHandle | None:
        actor = self._find(name)
        return DeviceHandle(actor) if actor is not None else None

    def archive(self, name: str) -> ArchiveHandle | None:
        actor = self._find(name)
        return ArchiveHandle(actor) if actor is not None else None

    def peer(self, name: str) -> PeerHandle | None:
        actor = self._find(name)
        return PeerHandle(actor) if actor is not None else None
