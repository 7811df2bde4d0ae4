"""The session router: the one owner of sessions (one per cluster, or per shard).

It turns each session operation into block operations on the session's
device (which keeps no session table: an append is a
:class:`~memkv.protocol.messages.ChainUpdate`). The parts it is made of are
plain and separately tested: the table (:class:`RouterState`), the devices
and their recovery (:class:`Members`), the archives and garbage
(:class:`Collector`), the other shards (:class:`ShardPeers`) and the
background prefetcher. It talks to devices, archives and peers only through
the protocols of :mod:`memkv.protocol.members`; :mod:`memkv.actors.router`
is the Ray actor around it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memkv.errors import (
    ClosedError,
    ConflictError,
    InvalidInputError,
    MemkvError,
    UnknownBlockError,
    UnknownSessionError,
)
from memkv.protocol.enums import AckMode, Priority, SessionState, Tier
from memkv.protocol.layout import KVLayout
from memkv.protocol.members import Archive, BlockStore, Directory
from memkv.protocol.messages import PrefixMatch, ReadRoute
from memkv.protocol.services import (
    AppendAnswer,
    AppendTurn,
    BlockTier,
    CreateSession,
    CreateSessions,
    ForkSession,
    ReserveSlots,
    ResumeAnswer,
    RewindSession,
    SessionService,
    SessionView,
    SessionViews,
    SlotsReserved,
)
from memkv.protocol.shards import shard_owner
from memkv.protocol.stats import ClusterStats, DrainReport, RepairStats
from memkv.router.admission import Admission
from memkv.router.appends import Appends
from memkv.router.background import BackgroundPrefetch
from memkv.router.collector import Collector
from memkv.router.drain import Drainer
from memkv.router.figures import device_stats, reattach, table_stats
from memkv.router.forks import Forks
from memkv.router.members import Members
from memkv.router.peers import ShardPeers
from memkv.router.repair import ReplicaRepair
from memkv.router.responses import Responses
from memkv.router.state import RouterState
from memkv.storage.journal import Journal, TableJournal

__all__ = ["JOURNAL_SNAPSHOT_RECORDS", "SessionRouter"]

logger = logging.getLogger(__name__)

#: Acknowledgement modes of a session's appends (docs/durability.md).
ACK_MODES = tuple(m.value for m in AckMode)
#: The journal is rewritten as a snapshot once it holds this many records.
JOURNAL_SNAPSHOT_RECORDS = 10_000
#: The largest answer :meth:`SessionRouter.echo` makes.
_ECHO_MAX_BYTES = 1 << 16


class SessionRouter:
    """The session service over the cluster's devices and archives.

    Args:
        hotness_half_life_s, prefix_affinity: see :class:`RouterState`.
        background_prefetch_interval_s: how often the background prefetcher runs.
        hot_idle_fraction: background prefetch only while a device's hot-tier
            use is below this.
        head_blocks: how many blocks of a session's head a resume prefetches.
        journal_dir: where the session table's journal lives; the table is
            rebuilt from it when the router starts (None: memory only, lost
            with the process).
        journal_fsync: fsync the journal (group-committed) before answering a
            change of an ``archive``-mode session, a suspend or a delete.
        journal: the journal itself (replaces ``journal_dir``: a router's
            journal on archives of other nodes).
        archive_replicas, repair_interval_s: see :class:`ReplicaRepair` (shard 0).
        rebalance_on_join: a device that registers for the first time takes
            sessions from the busiest devices, in the background
            (:meth:`rebalance_device`).
        default_ack: the acknowledgement mode of a session created without one.
        shard, shards: this router is shard ``shard`` of ``shards``
            (:mod:`memkv.protocol.shards`): it owns the sessions whose ids hash
            to it and refuses the others. Its block references on every
            device are its own; before the archive deletes a block, the other
            shards (found by name, ``router_name``) are asked whether one of
            their sessions still holds it.
        router_name: the name of shard 0 (the others' names follow from it).
        directory: finds members by name: the journal's devices and archives
            after a restart, and the other shards (None: none can be found).
        clock: seconds, monotonic (hotness; injectable for tests).
    """

    def __init__(
        self,
        *,
        hotness_half_life_s: float = 300.0,
        prefix_affinity: bool = True,
        background_prefetch_interval_s: float = 2.0,
        hot_idle_fraction: float = 0.3,
        head_blocks: int = 8,
        journal_dir: str | None = None,
        journal_fsync: bool = True,
        journal: TableJournal | None = None,
        default_ack: str = "memory",
        archive_replicas: int = 1,
        repair_interval_s: float = 10.0,
        rebalance_on_join: bool = False,
        shard: int = 0,
        shards: int = 1,
        router_name: str = "memkv-router",
        directory: Directory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if default_ack not in ACK_MODES:
            raise InvalidInputError(f"default_ack must be one of {list(ACK_MODES)}")
        self.peers = ShardPeers(shard, shards, router_name, directory)
        self.shard, self.shards = shard, shards
        self._owner = shard_owner(shard, shards)
        if journal is None and journal_dir is not None:
            journal = Journal(Path(journal_dir), fsync=journal_fsync)
        self.state = RouterState(
            hotness_half_life_s=hotness_half_life_s,
            prefix_affinity=prefix_affinity,
            journal=journal,
            clock=clock,
        )
        self.collector = Collector(self.state, self.peers)
        self.members = Members(self.state, self._owner, self.collector.collect)
        self.background = BackgroundPrefetch(
            self.state, self.members, interval_s=background_prefetch_interval_s,
            hot_idle_fraction=hot_idle_fraction, head_blocks=head_blocks,
        )
        # One shard repairs the cold tier's replicas (each knows every archive).
        self.repair = ReplicaRepair(self.collector, replicas=archive_replicas,
                                    interval_s=repair_interval_s) if shard == 0 else None
        self._directory = directory
        self._default_ack = default_ack
        self._head_blocks = head_blocks
        # Devices and archives of the journal are found again by name on the
        # first call (a restarted router); until then every call waits.
        self._restore_lock = asyncio.Lock()
        self._restored = journal is None or not (
            self.state.known_devices or self.state.known_archives
        )
        self.appends = Appends(self.state, self.members, self.collector, self.peers,
                               self._owner, self._durable)
        self.drainer = Drainer(self.state, self.members, self.appends)
        self.admission = Admission(self.state, self.members, self.peers, self._owner,
                                   default_ack)
        self.forks = Forks(self.state, self.admission, self.appends)
        self.responses = Responses(self.state, self._durable)  # (the front door's chains)
        self._rebalance_on_join = rebalance_on_join
        self._rebalancing: set[asyncio.Task[int]] = set()

    # -- membership ----------------------------------------------------------------------

    async def register_device(self, device_id: str, device: BlockStore) -> None:
        """Add a device; registering a known one again (``memkv up`` is repeatable) checks it."""
        await self._ready()
        if device_id in self.members.devices:
            await self.members.check(device_id, force=True)
            return
        info = await device.ping()
        self.members.add(device_id, device, info)
        await self.members.rehome_orphans()
        await self._durable(True)
        self.background.ensure_running()
        if self._rebalance_on_join and len(self.members.devices) > 1:
            # In the background: registration (memkv up) answers at once.
            task = asyncio.get_running_loop().create_task(self.rebalance_device(device_id))
            self._rebalancing.add(task)
            task.add_done_callback(self._rebalance_done)

    async def register_archive(self, archive_id: str, archive: Archive) -> None:
        await self._ready()
        await archive.ping()
        self.collector.archives[archive_id] = archive
        self.collector.lost_archives.discard(archive_id)
        self.state.add_archive(archive_id)
        if self.repair is not None:
            self.repair.ensure_running()
        if not self.appends.taken and self.state.journal is not None:
            # A router that has taken no append since it started (from its journal)
            # may collect: no block of an append in flight can be mistaken for garbage.
            await self.collector.collect_unreferenced([archive])

    async def devices(self) -> dict[str, Any]:
        """Each device's endpoint (what readers call directly)."""
        await self._ready()
        return {d: device.endpoint for d, device in self.members.devices.items()}

    async def ping(self) -> str:
        return "ok"

    async def echo(self, payload: bytes, reply_bytes: int) -> bytes:
        """A call with a payload each way and no work (``reply_bytes`` zero bytes back).

        What the transport costs a session operation before the router does
        anything: the scale suite sends a packed create's argument here and gets
        an answer of a packed create's size.
        """
        if (isinstance(reply_bytes, bool) or not isinstance(reply_bytes, int)
                or not 0 <= reply_bytes <= _ECHO_MAX_BYTES):
            raise InvalidInputError(f"reply_bytes must be 0..{_ECHO_MAX_BYTES}, got {reply_bytes}")
        return bytes(reply_bytes)

    async def shard_info(self) -> dict[str, int]:
        """Which shard this is, of how many (clients find the others by name)."""
        return {"shard": self.shard, "shards": self.shards}

    async def background_round(self) -> int:
        """One round of the background prefetcher now (blocks prefetched)."""
        return await self.background.round()

    # -- questions from the other shards -------------------------------------------------

    async def referenced(self, keys: list[bytes]) -> list[bool]:
        """Whether a session of this shard holds each block (before another shard's
        archive delete)."""
        await self._ready()
        return self.collector.referenced(keys)

    async def tenant_totals(self, tenant: str) -> tuple[int, int]:
        """The sessions and KV bytes ``tenant`` holds on this shard (quotas span shards)."""
        await self._ready()
        return self.state.tenant_sessions[tenant], self.state.tenant_bytes[tenant]

    # -- session lifecycle -------------------------------------------------------------

    async def create_session(self, request: CreateSession) -> SessionView:
        """A new session (:class:`CreateSession` says what each option means)."""
        await self._ready()
        record = await self.admission.admit(request, {})
        await self._durable(record.durable)
        return record.view()

    async def create_sessions(self, request: CreateSessions) -> SessionViews:
        """Many new sessions in one call; the journal is made durable once, for all.

        Raises:
            InvalidInputError, ConflictError, CapacityError: naming the request's
                index; the sessions before it are created (retry from that index).
        """
        await self._ready()
        views: list[SessionView] = []
        durable = False
        # Other shards' use, asked once per tenant and call: this shard's own count
        # grows as the loop creates, theirs is as it was when the call began.
        elsewhere: dict[str, tuple[int, int]] = {}
        try:
            for at, one in enumerate(request.requests):
                i = request.indices[at] if request.indices is not None else at
                try:
                    record = await self.admission.admit(one, elsewhere)
                except MemkvError as e:
                    raise type(e)(f"spec {i} ({one.session_id!r}): {e}") from e
                durable = durable or record.durable
                views.append(record.view())
        finally:
            await self._durable(durable)
        return SessionViews(sessions=tuple(views))

    async def adopt_session(self, request: CreateSession, chain: list[bytes], tokens: int,
                            turn: int) -> SessionView:
        """A session whose blocks are all in the cold tier already (an earlier
        version's records, another store's): registered archived, its chain held
        whole by a device (:meth:`Admission.adopt`)."""
        await self._ready()
        record = await self.admission.adopt(request, chain, tokens, turn)
        await self._durable(True)
        return record.view()

    async def session(self, session_id: str) -> SessionView:
        await self._ready()
        return self.state.get(session_id).view()

    async def device_of(self, session_id: str) -> tuple[str, Any]:
        """The device that owns the session and its endpoint (readers call it
        directly, zero-copy)."""
        device_id = await self._device_id_of(session_id)
        return device_id, self.members.devices[device_id].endpoint

    async def _device_id_of(self, session_id: str) -> str:
        await self._ready()
        record = self.state.get(session_id)
        if record.device_id is None:
            # The session's state, not the request, is what does not fit: 409.
            raise ConflictError(f"session {session_id!r} has no blocks yet (append a turn first)")
        if record.device_id not in self.members.devices:
            raise ClosedError(
                f"session {session_id!r} is being recovered (its device is coming back); retry"
            )
        await self.members.check(record.device_id)
        self.state.get(session_id)  # may have been marked lost by the recovery
        return record.device_id

    async def put_blocks(self, request: AppendTurn, blocks: list[Any]) -> AppendAnswer:
        """Store a turn's blocks on the session's device (:meth:`Appends.put`)."""
        await self._ready()
        return await self.appends.put(request, blocks)

    async def reserve_slots(self, request: ReserveSlots) -> SlotsReserved:
        """Slots on the session's device for a writer on its node (:meth:`Appends.reserve`)."""
        await self._ready()
        return await self.appends.reserve(request)

    async def read_route(
        self, session_id: str, start: int = 0, end: int | None = None
    ) -> ReadRoute:
        """Where to read a session's blocks ``start .. end``: the device and the keys in order.

        Block reads then go to the device directly, never through the router.
        A session with no blocks yet has an empty route (its read is an empty stream).
        """
        await self._ready()
        record = self.state.get(session_id)
        if record.device_id is None or not record.chain:
            self.state.touch(session_id)
            return ReadRoute("", None, 0, (), (), record.layout, record.turn)
        device_id, endpoint = await self.device_of(session_id)
        self.state.touch(session_id)
        record = self.state.get(session_id)
        first = max(start, 0)
        keys = record.chain[first:end]
        bt = record.layout.block_tokens
        tokens = [min(bt, record.tokens - i * bt) for i in range(first, first + len(keys))]
        return ReadRoute(
            device_id, endpoint, first, tuple(keys), tuple(tokens), record.layout, record.turn,
        )

    async def touch_sessions(self, session_ids: list[str]) -> None:
        """Reads a gateway served from its own view of these sessions (hotness)."""
        for session_id in session_ids:
            if session_id in self.state.sessions:
                self.state.touch(session_id)

    async def match_prefix(
        self, layout: KVLayout, namespace: str, token_ids: list[int]
    ) -> PrefixMatch:
        """How many leading tokens are cached by any session of ``namespace`` and held by
        a live device (never blocks only a session's table still names)."""
        tokens, blocks, behind = self.state.match_prefix(layout, namespace, token_ids)
        if behind:
            # Stored since this shard last read the devices' logs, or lost: read them.
            await self.members.follow_block_events()
            tokens, blocks, _ = self.state.match_prefix(layout, namespace, token_ids)
        return PrefixMatch(tokens, tuple(blocks), namespace)

    async def locate_blocks(
        self, keys: list[bytes], namespace: str | list[str] | None = None
    ) -> list[tuple[str, Any, list[bytes]]]:
        """``(device_id, endpoint, keys)`` groups: where to read blocks by key.

        ``namespace``: only blocks of that namespace (or of one of these) are
        found (None: any).
        """
        await self._ready()
        by_device, unplaced = self.state.locate(keys, namespace)
        if unplaced:
            # Stored (or adopted) since this shard last read the devices' logs.
            await self.members.follow_block_events()
            by_device, unplaced = self.state.locate(keys, namespace)
        if unplaced:
            raise UnknownBlockError(
                f"no device holds block {unplaced[0].hex()} (a session does: its device "
                f"lost it; the session's read says what survives)"
            )
        out = []
        for device_id, group in by_device.items():
            await self.members.check(device_id)
            out.append((device_id, self.members.devices[device_id].endpoint, group))
        return out

    async def notify_input_end(self, session_id: str) -> int:
        """Trigger 1: a turn's input has ended and its cache is needed now
        (:meth:`BackgroundPrefetch.input_ended`). Returns the blocks prefetched."""
        device_id = await self._device_id_of(session_id)
        self.state.touch(session_id)
        return await self.background.input_ended(device_id, session_id)

    async def resume(self, session_id: str) -> ResumeAnswer:
        """Answer at once with the chain and where each block is; prefetch runs behind."""
        device_id = await self._device_id_of(session_id)
        record = self.state.get(session_id)
        chain = list(record.chain)
        # Whether to activate is read when the call goes out: a device lost meanwhile
        # moves the session (archived) to another, and the call is made again there.
        blocks = await self.members.call(
            device_id, session_id,
            lambda d: d.tiers_of(chain) if record.active else d.activate(chain, self._owner),
        )
        if not record.active:
            self.state.record_state(session_id, SessionState.ACTIVE)
            await self._durable(False)
        self.state.touch(session_id)
        # The device that answered: the session moved if its own was lost meanwhile.
        device_id = record.device_id or device_id
        # Fire and forget: the call is on its way; its answer is not waited for.
        self.members.devices[device_id].prefetch(chain[: self._head_blocks])
        return ResumeAnswer(
            session_id=session_id,
            device_id=device_id,
            tokens=record.tokens,
            blocks=tuple(BlockTier(bytes(k), Tier(tier), int(n)) for k, tier, n in blocks),
        )

    async def suspend(self, session_id: str, offline: bool = False) -> SessionView:
        device_id = await self._device_id_of(session_id)
        record = self.state.get(session_id)
        chain, was_active = list(record.chain), record.active
        in_memory = await self.members.call(
            device_id, session_id,
            lambda d: d.deactivate(chain, offline, was_active, self._owner),
        )
        self.state.record_state(
            session_id, SessionState.SUSPENDED if in_memory else SessionState.ARCHIVED
        )
        await self._durable(True)  # a suspended session survives a restart, in any mode
        return record.view()

    async def set_priority(self, session_id: str, priority: Priority | str) -> SessionView:
        await self._ready()
        record = self.state.set_priority(session_id, Priority(priority).value)
        await self._durable(False)
        device_id = record.device_id
        if device_id is not None and device_id in self.members.devices and record.chain:
            chain, value = list(record.chain), record.priority.value
            await self.members.call(
                device_id, session_id, lambda d: d.set_priority(chain, value, session_id))
        return record.view()

    async def fork_session(self, request: ForkSession) -> SessionView:
        """A new session sharing a prefix of another's blocks (:meth:`Forks.fork`)."""
        await self._ready()
        return await self.forks.fork(request)

    async def rewind_session(self, request: RewindSession) -> SessionView:
        """Keep a session's first tokens, release the rest (:meth:`Forks.rewind`)."""
        await self._device_id_of(request.session_id)  # live, and not being recovered
        return await self.forks.rewind(request)

    async def delete_session(self, session_id: str) -> None:
        await self._ready()
        record = self.state.sessions.lookup(session_id)
        if record is None:
            raise UnknownSessionError(f"no session {session_id!r}")
        device_id = record.device_id or ""
        released = device_id in self.members.devices and bool(record.chain) and not record.lost
        if released:
            chain, active = list(record.chain), record.active
            await self.members.call(
                device_id, None, lambda d: d.release(chain, active, self._owner))
        device_id = record.device_id or ""  # (moved, if its device was lost meanwhile)
        garbage = self.state.delete(session_id)
        await self._durable(True)
        if released and garbage and device_id in self.members.devices:
            # Blocks a read still pins stay on the device, which deletes their cold
            # copies itself when the read lets go (a read that got its 200 sends
            # every block it announced).
            pinned = set(await self.members.devices[device_id].still_held(garbage))
            garbage = [k for k in garbage if k not in pinned]
        await self.collector.collect(garbage)

    async def stats(self, members: bool = True) -> ClusterStats:
        """The table's figures; ``members``: with every device's and archive's stats
        (a client merging shards asks one shard for them)."""
        await self._ready()
        devices = await device_stats(self.members) if members else {}
        archives = await self.collector.each_archive(lambda a: a.stats()) if members else {}
        return table_stats(
            self.state, self.shard, self.shards, devices, archives,
            background_prefetched=self.background.prefetched,
            repair=self.repair.stats if self.repair is not None else None,
        )

    async def drain_device(self, device_id: str) -> DrainReport:
        """Move this shard's sessions off a device that is leaving, then retire it
        (:mod:`memkv.router.drain`); the journal is durable before the answer."""
        await self._ready()
        report = await self.drainer.drain(device_id)
        await self._durable(True)
        return report

    async def rebalance_device(self, device_id: str) -> int:
        """Move sessions to a device (one that joined) from the busiest until loads are
        even; returns how many moved (the journal durable before the answer)."""
        await self._ready()
        if device_id not in self.members.devices:
            raise InvalidInputError(f"unknown device {device_id!r}")
        moved = await self.drainer.rebalance(device_id)
        await self._durable(True)
        return moved

    def _rebalance_done(self, task: asyncio.Task[int]) -> None:
        self._rebalancing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("rebalancing a joined device failed: %s", task.exception())

    async def retire_archive(self, archive_id: str) -> None:
        """An archive whose node is leaving: no longer counted as a replica (repair
        copies its blocks elsewhere while it can still be read)."""
        await self._ready()
        if self.repair is not None:
            self.repair.leaving.add(archive_id)

    async def repair_replicas(self) -> RepairStats:
        """One replica-repair pass now (the shard that repairs: shard 0)."""
        await self._ready()
        if self.repair is None:
            raise InvalidInputError(
                f"replica repair runs on router shard 0, this is shard {self.shard}")
        return await self.repair.run()

    async def flush_journal(self) -> None:
        """Make every journal record durable now (a planned stop)."""
        await self._ready()
        await self._durable(True)

    async def device_failed(self, device_id: str) -> None:
        """A client saw ``device_id`` fail: wait for its restart and recover its sessions."""
        await self._ready()  # a restarted router knows its devices once restored
        if device_id in self.members.lost:
            return  # lost already: its sessions moved (the caller asks for the route again)
        if device_id not in self.members.devices:
            raise InvalidInputError(f"unknown device {device_id!r}")
        await self.members.check(device_id, force=True)

    async def check_devices(self) -> dict[str, str]:
        """Ping every device; recover those that restarted. Returns device -> incarnation."""
        await self._ready()
        for device_id in list(self.members.devices):
            await self.members.check(device_id, force=True)
        return {d: self.state.devices[d].incarnation or "" for d in self.members.devices}

    # -- internals ---------------------------------------------------------------------

    async def _ready(self) -> None:
        """Once per start: find the journal's devices and archives again by name."""
        if self._restored:
            return
        async with self._restore_lock:
            if self._restored:
                return
            await self._restore()
            self._restored = True

    async def _restore(self) -> None:
        """A restarted router: reattach to the members the journal names, reconcile, collect."""
        await reattach(self.state, self.collector, self.members, self._directory)
        await self._durable(True)
        await self.collector.collect_unreferenced(list(self.collector.archives.values()))
        logger.warning(
            "router restored %d sessions from its journal (%d devices reattached)",
            len(self.state.sessions),
            len(self.members.devices),
        )
        if self.members.devices:
            self.background.ensure_running()
        if self.repair is not None and self.collector.archives:
            self.repair.ensure_running()

    async def _durable(self, needed: bool) -> None:
        """Make the journal's records durable before answering (group commit)."""
        journal = self.state.journal
        if journal is None:
            return
        if needed or journal.buffered:  # buffered: out of this process before the answer
            await journal.commit(fsync=needed)
        await self.state.compact_journal_async(every=JOURNAL_SNAPSHOT_RECORDS)


if TYPE_CHECKING:  # the router is a SessionService: mypy checks every signature
    _service: SessionService = SessionRouter()
