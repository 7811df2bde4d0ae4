"""The session router: one named actor per cluster.

:class:`~memkv.actors.router_state.RouterState` is the plain, separately
tested logic (the session table, placement, hotness, cluster-wide refcounts).
:class:`SessionRouterActor` is its async Ray shell: it turns each session
operation into block operations on the session's device (which keeps no
session table: an append is a :class:`~memkv.protocol.messages.ChainUpdate`),
runs the three prefetch triggers (turn input ended, block N read — done by the
device's read-ahead — and background prefetch while a device's hot tier is
under-used), and notices restarted devices (a changed incarnation, or
``RayActorError``): their archived sessions are adopted again, the others
are marked lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from msgspec.structs import asdict as msgspec_asdict
from ray.exceptions import RayActorError

from memkv.actors.router_state import RouterState, parse_layout, tenant_of
from memkv.errors import (
    BlockLostError,
    ClosedError,
    ConflictError,
    InvalidInputError,
    MemkvError,
    UnknownSessionError,
    plain_message,
)
from memkv.protocol.enums import AckMode, Priority, SessionState, Tier
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.layout import block_token_count
from memkv.protocol.messages import ChainUpdate, ReadRoute
from memkv.protocol.services import (
    AppendAnswer,
    AppendTurn,
    BlockTier,
    CreateSession,
    LayoutSpec,
    ResumeAnswer,
    SessionService,
    SessionView,
    decode,
    encode,
)
from memkv.protocol.shards import shard_name, shard_of, shard_owner
from memkv.storage.block_pool import Holder
from memkv.storage.journal import Journal
from memkv.storage.sessions import SessionRecord

__all__ = ["RouterState", "SessionRouter", "SessionRouterActor", "SessionRouterShell"]

logger = logging.getLogger(__name__)

#: Acknowledgement modes of a session's appends (docs/durability.md).
ACK_MODES = tuple(m.value for m in AckMode)
#: The journal is rewritten as a snapshot once it holds this many records.
JOURNAL_SNAPSHOT_RECORDS = 10_000
#: The largest answer :meth:`SessionRouter.echo` makes.
_ECHO_MAX_BYTES = 1 << 16

# How long the router waits for a restarted device to answer before giving up.
DEVICE_RECOVERY_TIMEOUT_S = 120.0
# A device that answered a ping this recently is not pinged again per request.
DEVICE_CHECK_INTERVAL_S = 1.0
_RECOVERY_POLL_S = 0.2


@dataclass(slots=True)
class _SessionLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class SessionRouter:
    """The async Ray shell around :class:`RouterState` (create as a named actor).

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
        default_ack: the acknowledgement mode of a session created without one.
        shard, shards: this router is shard ``shard`` of ``shards``
            (:mod:`memkv.protocol.shards`): it owns the sessions whose ids hash
            to it and refuses the others. Its block references on every
            device are its own; before the archive deletes a block, the other
            shards (found by name, ``router_name``) are asked whether one of
            their sessions still holds it.
        router_name: the Ray name of shard 0 (the others' names follow from it).
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
        default_ack: str = "memory",
        shard: int = 0,
        shards: int = 1,
        router_name: str = "memkv-router",
    ) -> None:
        if not 0 <= shard < shards:
            raise InvalidInputError(f"shard must be in 0..{shards - 1}, got {shard}")
        self.shard, self.shards = shard, shards
        self._owner = shard_owner(shard, shards)
        self._peer_names = [shard_name(router_name, i) for i in range(shards) if i != shard]
        self._peers: list[Any] | None = None
        journal = (
            Journal(Path(journal_dir), fsync=journal_fsync) if journal_dir is not None else None
        )
        self.state = RouterState(
            hotness_half_life_s=hotness_half_life_s,
            prefix_affinity=prefix_affinity,
            journal=journal,
        )
        # Devices and archives of the journal are found again by name on the
        # first call (a restarted router); until then every call waits.
        if default_ack not in ACK_MODES:
            raise InvalidInputError(f"default_ack must be one of {list(ACK_MODES)}")
        self._default_ack = default_ack
        self._restore_lock = asyncio.Lock()
        self._fresh = True  # no append taken since this process started
        self._restored = journal is None or not (
            self.state.known_devices or self.state.known_archives
        )
        self._devices: dict[str, Any] = {}
        self._archives: dict[str, Any] = {}
        self._interval = background_prefetch_interval_s
        self._hot_idle = hot_idle_fraction
        self._head_blocks = head_blocks
        self._background: asyncio.Task[None] | None = None
        self._recovering: dict[str, asyncio.Future[None]] = {}
        self._session_locks: dict[str, _SessionLock] = {}
        # Blocks of appends between their device put and their record: a delete
        # meanwhile must not send them to the archive's delete (the device may have
        # deduplicated the append against the very copy being collected).
        self._in_flight: Counter[bytes] = Counter()
        self._checked: dict[str, float] = {}  # device -> when it last answered a ping
        self.background_prefetched = 0

    # -- membership ----------------------------------------------------------------------

    async def register_device(self, device_id: str, handle: Any) -> None:
        """Add a device; registering a known one again (``memkv up`` is repeatable) checks it."""
        await self._ready()
        if device_id in self._devices:
            await self._check_incarnation(device_id, force=True)
            return
        info = await handle.ping.remote()
        self._devices[device_id] = handle
        self.state.add_device(device_id, info["incarnation"])
        await self._rehome_orphans()
        self._ensure_background()

    async def register_archive(self, archive_id: str, handle: Any) -> None:
        await self._ready()
        await handle.ping.remote()
        self._archives[archive_id] = handle
        self.state.add_archive(archive_id)
        if self._fresh and self.state.journal is not None:
            # A router that has taken no append since it started (from its journal)
            # may collect: no block of an append in flight can be mistaken for garbage.
            await self._collect_unreferenced([handle])

    async def devices(self) -> dict[str, Any]:
        return dict(self._devices)

    async def ping(self) -> str:
        return "ok"

    async def echo(self, payload: bytes, reply_bytes: int) -> bytes:
        """A call with a payload each way and no work (``reply_bytes`` zero bytes back).

        What Ray's transport costs a session operation before the router does
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

    # -- questions from the other shards -------------------------------------------------

    async def referenced(self, keys: list[bytes]) -> list[bool]:
        """Whether a session of this shard holds each block (before another shard's
        archive delete)."""
        await self._ready()
        return [self.state.referenced(k) or k in self._in_flight for k in keys]

    async def tenant_totals(self, tenant: str) -> tuple[int, int]:
        """The sessions and KV bytes ``tenant`` holds on this shard (quotas span shards)."""
        await self._ready()
        return self.state.tenant_sessions[tenant], self.state.tenant_bytes[tenant]

    # -- session lifecycle -------------------------------------------------------------

    async def create_session(self, request: CreateSession) -> SessionView:
        """A new session (:class:`CreateSession` says what each option means)."""
        await self._ready()
        session_id = request.session_id
        self._check_owned(session_id)
        ack = self._default_ack if request.ack is None else request.ack.value
        if request.quota is not None:
            quota = request.quota.limits()
            self.state.check_quota(session_id, max_sessions=quota[0], new_session=True,
                                   elsewhere=await self._usage_elsewhere(session_id, quota))
        record = self.state.create(
            session_id,
            msgspec_asdict(request.layout),
            request.namespace,
            request.priority.value,
            durable=ack == AckMode.ARCHIVE,
            exact_only=request.exact_only,
            finite_only=request.finite_only,
        )
        await self._durable(record.durable)
        return record.view()

    async def create_sessions(
        self,
        specs: list[dict[str, Any]],
        quota: tuple[int | None, int | None] | None = None,
        indices: list[int] | None = None,
    ) -> list[dict[str, Any]]:
        """Many new sessions in one call (bulk work: a fleet starting up, a restore).

        Each spec has ``session_id`` and ``layout``, and optionally ``namespace``,
        ``priority``, ``ack`` and ``exact_only`` (as :meth:`create_session`). The
        journal is made durable once, for all of them.

        Args:
            indices: each spec's index in the caller's whole list (a client that
                split one list across shards), for the error messages.

        Raises:
            InvalidInputError, ConflictError, CapacityError: naming the spec's index;
                the sessions before it are created (retry from that index).
        """
        await self._ready()
        records: list[dict[str, Any]] = []
        durable = False
        # Other shards' use, asked once per tenant and call: this shard's own count
        # grows as the loop creates, theirs is as it was when the call began.
        elsewhere: dict[str, tuple[int, int]] = {}
        try:
            for at, spec in enumerate(specs):
                i = indices[at] if indices is not None else at
                ack = spec.get("ack") or self._default_ack
                if ack not in ACK_MODES:
                    raise InvalidInputError(
                        f"spec {i}: ack must be one of {list(ACK_MODES)}, got {ack!r}"
                    )
                try:
                    self._check_owned(spec["session_id"])
                    if quota is not None:
                        tenant = tenant_of(spec["session_id"])
                        if tenant not in elsewhere:
                            elsewhere[tenant] = await self._usage_elsewhere(
                                spec["session_id"], quota)
                        self.state.check_quota(
                            spec["session_id"], max_sessions=quota[0], new_session=True,
                            elsewhere=elsewhere[tenant])
                    record = self.state.create(
                        spec["session_id"], spec["layout"], spec.get("namespace", "default"),
                        spec.get("priority", "normal"), durable=ack == "archive",
                        exact_only=bool(spec.get("exact_only", False)),
                        finite_only=bool(spec.get("finite_only", False)),
                    )
                except KeyError as e:
                    raise InvalidInputError(f"spec {i}: missing {e}") from e
                except MemkvError as e:
                    raise type(e)(f"spec {i} ({spec.get('session_id')!r}): {e}") from e
                durable = durable or record.durable
                records.append(record.as_dict())
        finally:
            await self._durable(durable)
        return records

    async def session(self, session_id: str) -> SessionView:
        await self._ready()
        return self.state.get(session_id).view()

    async def device_of(self, session_id: str) -> tuple[str, Any]:
        """The device that owns the session (readers call it directly, zero-copy)."""
        await self._ready()
        record = self.state.get(session_id)
        if record.device_id is None:
            # The session's state, not the request, is what does not fit: 409.
            raise ConflictError(f"session {session_id!r} has no blocks yet (append a turn first)")
        if record.device_id not in self._devices:
            raise ClosedError(
                f"session {session_id!r} is being recovered (its device is coming back); retry"
            )
        await self._check_incarnation(record.device_id)
        self.state.get(session_id)  # may have been marked lost by the recovery
        return record.device_id, self._devices[record.device_id]

    async def put_blocks(self, request: AppendTurn, blocks: list[Any]) -> AppendAnswer:
        """Store a turn's blocks on the session's device (blocks: payloads, refs or
        staged descriptors; :class:`AppendTurn` says what the header carries).

        Raises:
            ConflictError: the session is not the one the caller hashed for
                (``expect``: deleted and created again), or ``turn`` is not the next.
            CapacityError: the append would take the tenant over its quota.
        """
        await self._ready()
        session_id = request.session_id
        # One lock per session while appends are in flight; idle sessions keep
        # none (thousands of them would each hold one).
        entry = self._session_locks.setdefault(session_id, _SessionLock())
        entry.users += 1
        try:
            async with entry.lock:
                record = self.state.get(session_id)
                expect = request.expect
                if expect is not None and (
                    LayoutSpec.of(record.layout) != expect.layout
                    or record.namespace != expect.namespace
                ):
                    raise ConflictError(
                        f"session {session_id!r} has layout {record.layout.to_dict()} in namespace "
                        f"{record.namespace!r}, the request was made for "
                        f"{msgspec_asdict(expect.layout)} in {expect.namespace!r}"
                    )
                return await self._put_blocks(
                    session_id,
                    request.tokens(),
                    blocks,
                    request.start_block,
                    list(request.chain) if request.chain is not None else None,
                    request.turn,
                    list(request.checksums) if request.checksums is not None else None,
                    request.quota.limits() if request.quota is not None else None,
                )
        finally:
            entry.users -= 1
            if entry.users == 0 and self._session_locks.get(session_id) is entry:
                del self._session_locks[session_id]

    async def _put_blocks(
        self,
        session_id: str,
        token_ids: Sequence[int] | np.ndarray,
        blocks: list[Any],
        start_block: int,
        chain_hint: list[bytes] | None,
        turn: int | None,
        checksums: list[int] | None = None,
        quota: tuple[int | None, int | None] | None = None,
    ) -> AppendAnswer:
        record = self.state.get(session_id)
        if turn is not None and self.state.sessions.check_turn(
            session_id, turn, chain_hint, len(token_ids)
        ):
            return AppendAnswer(chain=tuple(bytes(k) for k in record.chain), turn=record.turn,
                                new_blocks=0, deduplicated_blocks=0, released_blocks=0,
                                replayed=True)
        chain = (
            chain_hint
            if chain_hint is not None
            else [bytes(k) for k in chain_hashes(token_ids, record.layout, record.namespace)]
        )
        update = self.state.sessions.plan_append(session_id, len(token_ids), chain, start_block)
        if quota is not None:
            self.state.check_quota(session_id, max_bytes=quota[1], update=update,
                                   elsewhere=await self._usage_elsewhere(session_id, quota))
        self._fresh = False
        device_id = self.state.place(session_id, chain)
        if device_id not in self._devices:
            raise ClosedError(f"session {session_id!r} is being recovered; retry")
        protected = list(dict.fromkeys(bytes(k) for k in update.chain))
        self._in_flight.update(protected)
        try:
            result, update = await self._apply_put(
                session_id, device_id, update, blocks, checksums, record.durable, token_ids,
                chain, start_block,
            )
            garbage = self.state.record_put(session_id, update)
        finally:
            self._in_flight.subtract(protected)
            for key in protected:
                if self._in_flight[key] <= 0:
                    del self._in_flight[key]
        await self._durable(record.durable)
        await self._collect(garbage)
        return AppendAnswer(
            chain=tuple(bytes(k) for k in update.chain),
            turn=self.state.get(session_id).turn,
            new_blocks=int(result["new_blocks"]),
            deduplicated_blocks=int(result["deduplicated_blocks"]),
            released_blocks=int(result["released_blocks"]),
        )

    async def _apply_put(
        self,
        session_id: str,
        device_id: str,
        update: ChainUpdate,
        blocks: list[Any],
        checksums: list[int] | None,
        durable: bool,
        token_ids: Sequence[int] | np.ndarray,
        chain: list[bytes],
        start_block: int,
    ) -> tuple[dict[str, Any], ChainUpdate]:
        """The device's put of one append; planned again once if the device restarted."""
        planned_on = self.state.devices[device_id].incarnation
        try:
            result = await self._call(
                device_id,
                session_id,
                lambda d: d.put.remote(update, blocks, checksums, durable, self._owner),
            )
        except InvalidInputError:
            # Blocks the append builds on missing: the device may have restarted
            # since it was last asked. Then the session was recovered (adopted
            # from the archive, or lost: BlockLostError) and the append is planned
            # again; otherwise the request itself was wrong.
            await self._check_incarnation(device_id, force=True)
            if self.state.devices[device_id].incarnation == planned_on:
                raise  # the same process as planned on: the request was wrong
            self.state.get(session_id)  # lost in the recovery: BlockLostError
            update = self.state.sessions.plan_append(
                session_id, len(token_ids), chain, start_block
            )
            result = await self._call(
                device_id,
                session_id,
                lambda d: d.put.remote(update, blocks, checksums, durable, self._owner),
            )
        return dict(result), update

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
            return ReadRoute("", None, 0, (), (), record.layout.to_dict(), record.turn)
        device_id, device = await self.device_of(session_id)
        self.state.touch(session_id)
        record = self.state.get(session_id)
        first = max(start, 0)
        keys = record.chain[first:end]
        bt = record.layout.block_tokens
        tokens = [min(bt, record.tokens - i * bt) for i in range(first, first + len(keys))]
        return ReadRoute(
            device_id,
            device,
            first,
            tuple(keys),
            tuple(tokens),
            record.layout.to_dict(),
            record.turn,
        )

    async def touch_sessions(self, session_ids: list[str]) -> None:
        """Reads a gateway served from its own view of these sessions (hotness)."""
        for session_id in session_ids:
            if session_id in self.state.sessions:
                self.state.touch(session_id)

    async def match_prefix(
        self, layout: dict[str, Any], namespace: str, token_ids: list[int]
    ) -> dict[str, Any]:
        """How many leading tokens are cached by any session of ``namespace``."""
        tokens, blocks = self.state.match_prefix(parse_layout(layout), namespace, token_ids)
        return {"tokens": tokens, "blocks": blocks}

    async def locate_blocks(
        self, keys: list[bytes], namespace: str | list[str] | None = None
    ) -> list[tuple[str, Any, list[bytes]]]:
        """``(device_id, handle, keys)`` groups: where to read blocks by key.

        ``namespace``: only blocks of that namespace (or of one of these) are
        found (None: any).
        """
        await self._ready()
        out = []
        for device_id, group in self.state.locate(keys, namespace).items():
            await self._check_incarnation(device_id)
            out.append((device_id, self._devices[device_id], group))
        return out

    async def notify_input_end(self, session_id: str) -> int:
        """Trigger 1: a turn's input has ended and its cache is needed now.

        Prefetches the session's head, then what the Markov model expects after
        its last block (e.g. another session that usually follows this one).
        """
        device_id, _ = await self.device_of(session_id)
        self.state.touch(session_id)
        chain = list(self.state.get(session_id).chain)
        head = chain[: self._head_blocks]
        moved = int(await self._call(device_id, session_id, lambda d: d.prefetch.remote(head)))
        if chain:
            moved += int(
                await self._call(
                    device_id, session_id, lambda d: d.prefetch_predicted.remote(chain[-1])
                )
            )
        return moved

    async def resume(self, session_id: str) -> ResumeAnswer:
        """Answer at once with the chain and where each block is; prefetch runs behind."""
        device_id, device = await self.device_of(session_id)
        record = self.state.get(session_id)
        chain = list(record.chain)
        if record.active:
            blocks = await self._call(device_id, session_id, lambda d: d.tiers_of.remote(chain))
        else:
            blocks = await self._call(
                device_id, session_id, lambda d: d.activate.remote(chain, self._owner)
            )
            self.state.record_state(session_id, SessionState.ACTIVE)
        self.state.touch(session_id)
        device.prefetch.remote(chain[: self._head_blocks])  # fire and forget
        return ResumeAnswer(
            session_id=session_id,
            device_id=device_id,
            tokens=record.tokens,
            blocks=tuple(BlockTier(bytes(k), Tier(tier), int(n)) for k, tier, n in blocks),
        )

    async def suspend(self, session_id: str, offline: bool = False) -> SessionView:
        device_id, _ = await self.device_of(session_id)
        record = self.state.get(session_id)
        chain, was_active = list(record.chain), record.active
        in_memory = await self._call(
            device_id,
            session_id,
            lambda d: d.deactivate.remote(chain, offline, was_active, self._owner),
        )
        self.state.record_state(
            session_id, SessionState.SUSPENDED if in_memory else SessionState.ARCHIVED
        )
        await self._durable(True)  # a suspended session survives a restart, in any mode
        return record.view()

    async def set_priority(self, session_id: str, priority: Priority | str) -> SessionView:
        await self._ready()
        record = self.state.set_priority(session_id, Priority(priority).value)
        if record.device_id in self._devices and record.chain:
            chain = list(record.chain)
            await self._call(
                record.device_id,
                session_id,
                lambda d: d.set_priority.remote(chain, record.priority.value, session_id),
            )
        return record.view()

    async def delete_session(self, session_id: str) -> None:
        await self._ready()
        record = self.state.sessions.lookup(session_id)
        if record is None:
            raise UnknownSessionError(f"no session {session_id!r}")
        device_id = record.device_id or ""
        released = device_id in self._devices and bool(record.chain) and not record.lost
        if released:
            chain, active = list(record.chain), record.active
            await self._call(
                device_id, None, lambda d: d.release.remote(chain, active, self._owner)
            )
        garbage = self.state.delete(session_id)
        await self._durable(True)
        if released and garbage:
            # Blocks a read still pins stay on the device, which deletes their cold
            # copies itself when the read lets go (a read that got its 200 sends
            # every block it announced).
            pinned = set(await self._devices[device_id].still_held.remote(garbage))
            garbage = [k for k in garbage if k not in pinned]
        await self._collect(garbage)

    async def stats(self, members: bool = True) -> dict[str, Any]:
        """The table's figures; ``members``: with every device's and archive's stats
        (a client merging shards asks one shard for them)."""
        await self._ready()
        devices = {d: await h.stats.remote() for d, h in self._devices.items()} if members else {}
        archives = (
            {a: await h.stats.remote() for a, h in self._archives.items()} if members else {}
        )
        states = Counter("lost" if r.lost else r.state.value for r in self.state.sessions)
        logical = sum(
            r.layout.block_nbytes(n)
            for r in self.state.sessions
            for n in block_token_count(r.layout, r.tokens)
        )
        priorities = Counter(r.priority.value for r in self.state.sessions)
        return {
            "shard": self.shard,
            "shards": self.shards,
            "sessions": len(self.state.sessions),
            "logical_bytes": logical,
            "session_states": dict(states),
            "session_priorities": dict(priorities),
            "tenants": self.state.tenant_usage(),
            "devices": devices,
            "archives": archives,
            "background_prefetched": self.background_prefetched,
        }

    async def flush_journal(self) -> None:
        """Make every journal record durable now (a planned stop)."""
        await self._ready()
        await self._durable(True)

    async def device_failed(self, device_id: str) -> None:
        """A client saw ``device_id`` fail: wait for its restart and recover its sessions."""
        if device_id not in self._devices:
            raise InvalidInputError(f"unknown device {device_id!r}")
        await self._check_incarnation(device_id, force=True)

    async def check_devices(self) -> dict[str, str]:
        """Ping every device; recover those that restarted. Returns device -> incarnation."""
        for device_id in list(self._devices):
            await self._check_incarnation(device_id, force=True)
        return {d: self.state.devices[d].incarnation or "" for d in self._devices}

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
        """A restarted router: reattach to the actors the journal names, reconcile, collect.

        A device that still answers keeps its blocks: its references are set
        again from the table (an append the router died before recording
        leaves none behind). A device that is gone (the machine restarted:
        new actors, new names) is forgotten; its sessions move to the devices
        that register next, from the archive (:meth:`_rehome_orphans`).
        """
        namespace = ray.get_runtime_context().namespace
        for name in list(self.state.known_archives):
            try:
                handle = ray.get_actor(name, namespace=namespace)
                await handle.ping.remote()
            except (ValueError, RayActorError):
                self.state.forget_archive(name)  # a new one registers itself (memkv up)
                continue
            self._archives[name] = handle
        for name in list(self.state.known_devices):
            try:
                handle = ray.get_actor(name, namespace=namespace)
            except ValueError:
                self.state.forget_device(name)  # no such actor any more (a new cluster)
                continue
            self._devices[name] = handle
            try:
                info = await handle.ping.remote()
            except RayActorError:
                info = await self._wait_for_restart(name)  # it exists, and is restarting
            self.state.add_device(name, info["incarnation"])
            self._checked[name] = time.monotonic()
            await self._resync(name)
        await self._rehome_orphans()
        await self._collect_unreferenced(list(self._archives.values()))
        logger.warning(
            "router restored %d sessions from its journal (%d devices reattached)",
            len(self.state.sessions),
            len(self._devices),
        )
        if self._devices:
            self._ensure_background()

    async def _resync(self, device_id: str) -> None:
        """Set a device's block references from the table; sessions it cannot serve are lost."""
        records = [r for r in self.state.sessions_on(device_id) if r.chain and not r.lost]
        holders = [
            Holder(
                r.layout,
                list(r.chain),
                block_token_count(r.layout, r.tokens),
                r.active,
                r.priority,
                r.exact_only,
            )
            for r in records
        ]
        device = self._devices[device_id]
        lost = await device.resync.remote(holders, self._owner)
        for i in lost:
            reason = (
                f"device {device_id} no longer has all of its blocks and the archive lacks some"
            )
            if await self._serve_what_survives(device, records[i], reason):
                self.state.record_state(records[i].session_id, SessionState.ARCHIVED)

    async def _rehome_orphans(self) -> None:
        """Sessions whose device is gone for good go to a live one, from the archive."""
        if not self._devices:
            return
        for record in list(self.state.sessions):
            if record.device_id is None or record.device_id in self._devices or record.lost:
                continue
            target = min(self._devices, key=lambda d: (self.state.devices[d].sessions, d))
            if not record.chain:
                self.state.move(record.session_id, target)
                continue
            reason = "its device is gone and the archive lacks some of its blocks"
            if not await self._serve_what_survives(self._devices[target], record, reason):
                continue
            self.state.move(record.session_id, target)
            self.state.record_state(record.session_id, SessionState.ARCHIVED)
        await self._durable(True)

    async def _collect_unreferenced(self, archives: list[Any]) -> None:
        """Delete archived blocks no session holds (left by appends a crash never recorded).

        Only right while no append is in flight (its blocks reach the archive
        before the router records them): at start, before the first append.
        A sharded table skips it: the other shards may have appends in flight
        whatever this one's state (leftovers cost disk until deleted, never a
        session).
        """
        if self._peer_names:
            return
        for handle in archives:
            keys = await handle.keys.remote()
            garbage = [k for k in keys if not self.state.referenced(k)]
            if garbage:
                await handle.delete.remote(garbage)
                logger.warning("collected %d unreferenced archive blocks", len(garbage))

    async def _durable(self, needed: bool) -> None:
        """Make the journal's records durable before answering (group commit)."""
        journal = self.state.journal
        if journal is None:
            return
        if needed:
            await asyncio.to_thread(journal.sync)
        self.state.compact_journal(every=JOURNAL_SNAPSHOT_RECORDS)

    async def _collect(self, garbage: list[bytes]) -> None:
        # A block an append in flight holds stays (if that append fails, it stays
        # archived unreferenced until a start-up sweep: disk, never a session).
        garbage = [k for k in garbage if k not in self._in_flight]
        if garbage and self._archives:
            garbage = await self._unreferenced_anywhere(garbage)
        if garbage and self._archives:
            await asyncio.gather(*(a.delete.remote(garbage) for a in self._archives.values()))

    # -- the other shards ----------------------------------------------------------------

    def _check_owned(self, session_id: str) -> None:
        owner = shard_of(session_id, self.shards)
        if owner != self.shard:
            raise InvalidInputError(
                f"session {session_id!r} belongs to router shard {owner} of {self.shards}, "
                f"not to this one ({self.shard}): find its owner with memkv.protocol.shards"
            )

    async def _peer_handles(self) -> list[Any]:
        """The other shards, found by name once they all answer."""
        if self._peers is None:
            namespace = ray.get_runtime_context().namespace
            self._peers = [ray.get_actor(n, namespace=namespace) for n in self._peer_names]
        return self._peers

    async def _unreferenced_anywhere(self, keys: list[bytes]) -> list[bytes]:
        """Of blocks no session of this shard holds, those no other shard's session holds.

        A block stays when a peer cannot be asked: an archived block kept too
        long costs disk, one deleted too early costs a session.
        """
        if not keys or not self._peer_names:
            return keys
        try:
            peers = await self._peer_handles()
            answers = await asyncio.gather(*(p.referenced.remote(keys) for p in peers))
        except (ValueError, RayActorError) as e:
            self._peers = None
            logger.warning("kept %d archive blocks: a router shard did not answer (%s)",
                           len(keys), e)
            return []
        return [k for i, k in enumerate(keys) if not any(a[i] for a in answers)]

    async def _usage_elsewhere(
        self, session_id: str, quota: tuple[int | None, int | None]
    ) -> tuple[int, int]:
        """The tenant's sessions and bytes on the other shards (quotas span them).

        Only asked when a quota applies; two shards admitting at once may each
        see the other's use before it grew (an overshoot of at most the
        requests in flight).
        """
        if not self._peer_names or quota == (None, None):
            return 0, 0
        tenant = tenant_of(session_id)
        peers = await self._peer_handles()
        totals = await asyncio.gather(*(p.tenant_totals.remote(tenant) for p in peers))
        return sum(t[0] for t in totals), sum(t[1] for t in totals)

    async def _call(
        self, device_id: str, session_id: str | None, call: Callable[[Any], Any]
    ) -> Any:
        """``call(device handle)`` (a method's ``.remote(...)``); after a restart, again.

        If the device died meanwhile it is recovered first. After a recovery the
        session may have been marked lost; it is checked again so the caller gets
        BlockLostError rather than an unknown session.
        """
        await self._check_incarnation(device_id)
        try:
            return await call(self._devices[device_id])
        except RayActorError:
            await self._check_incarnation(device_id, force=True)
            if session_id is not None:
                self.state.get(session_id)
            return await call(self._devices[device_id])

    async def _check_incarnation(self, device_id: str, *, force: bool = False) -> None:
        """Recover the device's sessions if its process was restarted since we last looked.

        A device answered within the last DEVICE_CHECK_INTERVAL_S is not pinged
        again (a ping per request costs a round trip); a restart in between
        surfaces as RayActorError on the caller's own call, and callers then
        report it with ``device_failed`` (``force``).
        """
        pending = self._recovering.get(device_id)
        if pending is not None:
            await pending
            return
        if not force and time.monotonic() - self._checked.get(device_id, -1e9) < (
            DEVICE_CHECK_INTERVAL_S
        ):
            return
        handle = self._devices[device_id]
        try:
            info = await handle.ping.remote()
        except RayActorError:
            info = await self._wait_for_restart(device_id)
        self._checked[device_id] = time.monotonic()
        if info["incarnation"] != self.state.devices[device_id].incarnation:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._recovering[device_id] = future
            try:
                await self._recover(device_id, info["incarnation"])
                future.set_result(None)
            except BaseException as e:
                future.set_exception(e)
                raise
            finally:
                del self._recovering[device_id]

    async def _wait_for_restart(self, device_id: str) -> dict[str, str]:
        handle = self._devices[device_id]
        deadline = time.monotonic() + DEVICE_RECOVERY_TIMEOUT_S
        while True:
            try:
                return dict(await handle.ping.remote())
            except RayActorError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(_RECOVERY_POLL_S)

    async def _recover(self, device_id: str, incarnation: str) -> None:
        """A device restarted empty: re-adopt its sessions from the archive, or mark them lost."""
        logger.warning("device %s restarted; recovering its sessions from the archive", device_id)
        self.state.devices[device_id].incarnation = incarnation
        device = self._devices[device_id]
        for record in self.state.sessions_on(device_id):
            if record.lost or not record.chain:
                continue
            reason = (
                f"device {device_id} restarted before all of the session's blocks reached "
                f"the archive"
            )
            if await self._serve_what_survives(device, record, reason):
                self.state.record_state(record.session_id, SessionState.ARCHIVED)

    async def _serve_what_survives(self, device: Any, record: SessionRecord, reason: str) -> bool:
        """Have ``device`` hold what is left of ``record``'s chain: the longest prefix
        some tier still has (the engine recomputes the rest), or nothing.

        Returns:
            False when not even the first block survives (the session is lost: 410).
        """
        try:
            held = await _adopt(device, record, self._owner)
        except BlockLostError as e:
            self.state.mark_lost(record.session_id, f"{reason} ({plain_message(e)})")
            return False
        if held < len(record.chain):
            tokens = record.tokens
            # Blocks after the first missing one that the archive has are garbage
            # now (no session serves past the gap).
            await self._collect(
                self.state.truncate(
                    record.session_id,
                    held,
                    f"{reason}: blocks {held}..{len(record.chain) - 1} of {len(record.chain)} "
                    f"are lost",
                )
            )
            logger.warning(
                "session %s keeps %d of its %d tokens (%s)",
                record.session_id, record.tokens, tokens, reason,
            )
        return True

    def _ensure_background(self) -> None:
        if self._background is None or self._background.done():
            self._background = asyncio.get_running_loop().create_task(self._background_prefetch())

    async def _background_prefetch(self) -> None:
        """Trigger 3, forever: every interval, one :meth:`background_round`."""
        while True:
            await asyncio.sleep(self._interval)
            await self.background_round()

    async def background_round(self) -> int:
        """While a device's hot tier is under-used, bring back its hottest idle sessions.

        Returns the blocks prefetched in this round.
        """
        moved = 0
        for device_id, handle in list(self._devices.items()):
            try:
                stats = await handle.stats.remote()
                self.state.update_load(device_id, float(stats["hot_usage"]))
                if stats["incarnation"] != self.state.devices[device_id].incarnation:
                    await self._check_incarnation(device_id, force=True)
                    continue
                if stats["hot_usage"] >= self._hot_idle:
                    continue
                for session_id in self.state.background_candidates(device_id, limit=4):
                    head = self.state.get(session_id).chain[: self._head_blocks]
                    moved += int(await handle.prefetch.remote(head))
            except (RayActorError, MemkvError) as e:
                # A device restarting or a session deleted meanwhile: the next
                # foreground call recovers it; background work just skips a round.
                logger.info("background prefetch skipped %s: %s", device_id, e)
        self.background_prefetched += moved
        return moved


async def _adopt(device: Any, record: SessionRecord, owner: str) -> int:
    """Have ``device`` hold the longest prefix of ``record``'s chain that a tier still has.

    Returns the blocks held (BlockLostError: not even the first one).
    """
    held: int = await device.adopt.remote(
        record.layout,
        list(record.chain),
        block_token_count(record.layout, record.tokens),
        record.priority.value,
        record.exact_only,
        owner,
        True,
    )
    return held


if TYPE_CHECKING:  # the router is a SessionService: mypy checks every signature
    _service: SessionService = SessionRouter()


class SessionRouterShell(SessionRouter):
    """What Ray callers reach: the session service with each message as one
    msgpack document (:class:`memkv.actors.handles.SessionServiceHandle` is
    the other end)."""

    async def create_session_wire(self, request: bytes) -> bytes:
        return encode(await self.create_session(decode(CreateSession, request)))

    async def session_wire(self, session_id: str) -> bytes:
        return encode(await self.session(session_id))

    async def put_blocks_wire(self, request: bytes, blocks: list[Any]) -> bytes:
        return encode(await self.put_blocks(decode(AppendTurn, request), blocks))

    async def resume_wire(self, session_id: str) -> bytes:
        return encode(await self.resume(session_id))

    async def suspend_wire(self, session_id: str, offline: bool) -> bytes:
        return encode(await self.suspend(session_id, offline))

    async def set_priority_wire(self, session_id: str, priority: str) -> bytes:
        return encode(await self.set_priority(session_id, priority))


#: The actor: async, so slow device calls of one session do not block others.
#: Ray restarts it if its process dies; it rebuilds its table from the journal.
SessionRouterActor = ray.remote(max_restarts=-1, max_task_retries=0)(SessionRouterShell)
