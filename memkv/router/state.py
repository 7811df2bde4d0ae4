"""The router's plain logic: sessions, placement, hotness and the blocks sessions hold.

:class:`RouterState` holds the session table
(:class:`~memkv.router.sessions.SessionTable`, the one owner of sessions),
places sessions on devices (prefix affinity, then least loaded), keeps each
session's hotness (an exponentially decayed access rate) and counts, per
block, the sessions of this shard that hold it (a view of its own chains: the
archive deletes a block only when no session of any shard holds it). Where a
block sits is not counted here: the devices' pools own their blocks, and the
:class:`~memkv.router.block_index.BlockIndex` follows what they say.
Tested without Ray;
:class:`~memkv.router.service.SessionRouter` is the service around it.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from memkv.errors import (
    CapacityError,
    InvalidInputError,
    MemkvError,
    UnknownBlockError,
)
from memkv.protocol.enums import Priority, SessionState
from memkv.protocol.hashing import BlockHash, chain_hashes
from memkv.protocol.ids import TENANT_SEPARATOR
from memkv.protocol.layout import KVLayout, block_token_count
from memkv.protocol.messages import ChainUpdate
from memkv.protocol.stats import TenantUse
from memkv.router.block_index import BlockIndex
from memkv.router.layouts import LAYOUTS
from memkv.router.records import (
    ArchiveForgotten,
    ArchiveKnown,
    ChainPut,
    DeviceForgotten,
    DeviceKnown,
    JournalRecord,
    PriorityChanged,
    SessionCreated,
    SessionDeleted,
    SessionLost,
    SessionMoved,
    SessionTruncated,
    StateChanged,
    apply_record,
    decode_record,
    encode_record,
    snapshot_records,
)
from memkv.router.response_table import ResponseTable
from memkv.router.sessions import SessionRecord, SessionTable, parse_priority
from memkv.storage.journal import TableJournal

__all__ = ["DeviceLoad", "RouterState", "SessionRecord"]


#: Tenants named in stats and metrics (the largest by bytes); the rest are summed as
#: "(other)", so a fleet of tenants cannot blow up a metrics label set.
STATS_TENANTS = 20
OTHER_TENANTS = "(other)"


@dataclass(slots=True)
class DeviceLoad:
    """What placement knows of a device.

    ``live``: registered with this router process (it holds a handle that
    answered). A journal replay only names devices; placement never chooses
    one that no live process answers for (a previous run's device would wedge
    every append to the session placed there).
    """

    sessions: int = 0
    hot_usage: float = 0.0
    incarnation: str | None = None
    live: bool = False


class RouterState:
    """Session table, placement, hotness and cluster-wide block refcounts.

    Args:
        hotness_half_life_s: the access rate's half-life.
        prefix_affinity: place a new session on the device that already holds
            the longest prefix of its chain.
        clock: seconds (injectable for tests).
        journal: where every change of the table is recorded; the table is
            rebuilt from it here (a restarted router, or a restarted machine).
            None keeps the table in memory only.
    """

    def __init__(
        self,
        *,
        hotness_half_life_s: float = 300.0,
        prefix_affinity: bool = True,
        clock: Callable[[], float] = time.monotonic,
        journal: TableJournal | None = None,
    ) -> None:
        if hotness_half_life_s <= 0:
            raise InvalidInputError(f"hotness_half_life_s must be > 0, got {hotness_half_life_s}")
        self._decay = math.log(2) / hotness_half_life_s
        self._prefix_affinity = prefix_affinity
        self._clock = clock
        self.sessions = SessionTable(clock)
        self.responses = ResponseTable()  # the front door's response chains, by session
        self.devices: dict[str, DeviceLoad] = {}
        # block -> how many sessions of this shard hold it (derived from their chains)
        self._refcounts: Counter[bytes] = Counter()
        # What each device's pool holds, from its own change log (placement, reads by key).
        self.blocks = BlockIndex()
        # block -> the namespace its hash was salted with (by-key reads are
        # served only within the namespaces the caller may read)
        self._block_namespace: dict[bytes, str] = {}
        # Per tenant (the part of a session id before '/'): sessions and the bytes
        # of their chains in the model dtype, checked against quotas.
        self.tenant_sessions: Counter[str] = Counter()
        self.tenant_bytes: Counter[str] = Counter()
        # Devices and archives the journal knew (a restarted router finds them by name).
        self.known_devices: list[str] = []
        self.known_archives: list[str] = []
        # Each device's Ray node, from its pings (placement near a node; not journaled).
        self.node_of: dict[str, str] = {}
        self.journal = journal
        self._compacting = False  # a snapshot is being written (compact_journal_async)
        if journal is not None:
            self._replaying = True
            try:
                for entry in journal.replay():
                    apply_record(self, decode_record(entry))
            finally:
                self._replaying = False
            self.compact_journal()

    # -- devices -------------------------------------------------------------------

    def add_device(self, device_id: str, incarnation: str | None = None) -> None:
        """A device whose process answered this router (placement may choose it)."""
        load = self.devices.setdefault(device_id, DeviceLoad())
        if load.incarnation is not None and incarnation != load.incarnation:
            # Another process: what the old one held went with it. Nothing is held
            # there until the new one's log is read (matches and reads by key ask it).
            self.blocks.forget(device_id)
        load.incarnation, load.live = incarnation, True
        if device_id not in self.known_devices:
            self.known_devices.append(device_id)
            self._log(DeviceKnown(name=device_id))

    def add_archive(self, name: str) -> None:
        if name not in self.known_archives:
            self.known_archives.append(name)
            self._log(ArchiveKnown(name=name))

    def forget_archive(self, name: str) -> None:
        if name in self.known_archives:
            self.known_archives.remove(name)
            self._log(ArchiveForgotten(name=name))

    def forget_device(self, device_id: str) -> None:
        """A journaled device that no longer exists (a machine restarted: new names)."""
        self.devices.pop(device_id, None)
        self.blocks.forget(device_id)
        if device_id in self.known_devices:
            self.known_devices.remove(device_id)
            self._log(DeviceForgotten(name=device_id))

    def update_load(self, device_id: str, hot_usage: float) -> None:
        self.devices[device_id].hot_usage = hot_usage

    def sessions_on(self, device_id: str) -> list[SessionRecord]:
        return [r for r in self.sessions if r.device_id == device_id]

    # -- sessions ------------------------------------------------------------------

    def create(
        self,
        session_id: str,
        layout: KVLayout | dict[str, Any],
        namespace: str,
        priority: Priority | str,
        durable: bool = False,
        exact_only: bool = False,
        finite_only: bool = False,
    ) -> SessionRecord:
        """A new session (the id rule, layout and priority are checked here, once)."""
        layout, layout_dict = LAYOUTS.parse(layout)
        record = self.sessions.create(
            session_id,
            layout,
            namespace=namespace,
            priority=priority,
            durable=durable,
            exact_only=exact_only,
            finite_only=finite_only,
        )
        self.tenant_sessions[tenant_of(session_id)] += 1
        self._log(SessionCreated(
            id=session_id, ns=record.namespace, layout=layout_dict,
            prio=record.priority.value, durable=record.durable, exact_only=record.exact_only,
            finite_only=record.finite_only))
        return record

    def get(self, session_id: str) -> SessionRecord:
        return self.sessions.get(session_id)

    def place(self, session_id: str, chain_hint: Sequence[bytes] = ()) -> str:
        """The device of a session, choosing one on first use.

        Prefix affinity first (the device that holds the longest prefix of
        ``chain_hint``, as its block pool says (:attr:`blocks`): a prefix stored
        through any shard stays stored once), then the device with the fewest
        sessions and the emptiest hot tier.
        """
        record = self.get(session_id)
        if record.device_id is not None:
            if record.chain or self.is_live(record.device_id):
                return record.device_id
            # Placed on a device that is gone before its first block: nothing of it
            # lives there, so it is placed again (never wedged on a dead name).
            self._unplace(record)
        live = [d for d, load in self.devices.items() if load.live]
        if not live:
            raise MemkvError("no device is registered with the router")
        choice: str | None = None
        if self._prefix_affinity:
            best = 0
            for device_id in live:
                depth = self.blocks.depth(device_id, chain_hint)
                if depth > best:
                    best, choice = depth, device_id
        if choice is None:
            choice = min(
                live,
                key=lambda d: (self.devices[d].sessions, self.devices[d].hot_usage, d),
            )
        record.device_id = choice
        self.devices[choice].sessions += 1
        return choice

    def place_near(self, session_id: str, node: str) -> str | None:
        """Place a new session on the least loaded live device of Ray node ``node``
        (a prefix of its id will do); None, unplaced, when that node has none."""
        record = self.get(session_id)
        near = [d for d, load in self.devices.items() if load.live and self.node_of.get(d)
                and (self.node_of[d].startswith(node) or node.startswith(self.node_of[d]))]
        if record.device_id is not None or not near:
            return record.device_id
        choice = min(near, key=lambda d: (self.devices[d].sessions, self.devices[d].hot_usage, d))
        record.device_id = choice
        self.devices[choice].sessions += 1
        return choice

    def is_live(self, device_id: str) -> bool:
        """Whether placement may choose the device (registered, answering, not draining)."""
        load = self.devices.get(device_id)
        return load is not None and load.live

    def set_draining(self, device_id: str) -> None:
        """Placement skips the device from now on (its sessions are moving off it)."""
        self.devices[device_id].live = False

    def _unplace(self, record: SessionRecord) -> None:
        if record.device_id in self.devices:
            self.devices[record.device_id].sessions -= 1
        record.device_id = None

    def touch(self, session_id: str) -> None:
        """Count an access in the session's hotness (decayed access rate)."""
        record = self.get(session_id)
        now = self._clock()
        record.hotness = record.hotness * math.exp(-self._decay * (now - record.last_access)) + 1
        record.last_access = now

    def hotness(self, session_id: str) -> float:
        record = self.get(session_id)
        return record.hotness * math.exp(-self._decay * (self._clock() - record.last_access))

    def record_put(self, session_id: str, update: ChainUpdate) -> list[bytes]:
        """The session's device applied ``update``. Returns blocks no session holds any more."""
        record = self.get(session_id)
        for key in update.hold:
            self._ref(key)
            self._block_namespace.setdefault(bytes(key), record.namespace)
        garbage = [key for key in update.drop if self._unref(key)]
        before = chain_bytes(record)
        self.sessions.commit_append(session_id, update)
        self.tenant_bytes[tenant_of(session_id)] += chain_bytes(record) - before
        self._log(ChainPut(id=session_id, chain=[bytes(k) for k in record.chain],
                           tokens=record.tokens, turn=record.turn, tail=record.tail_rewrites,
                           device=record.device_id))
        self.touch(session_id)
        return garbage

    def record_state(self, session_id: str, state: SessionState) -> None:
        self.get(session_id).state = state
        self._log(StateChanged(id=session_id, state=state))

    def set_priority(self, session_id: str, priority: Priority | str) -> SessionRecord:
        record = self.get(session_id)
        record.priority = parse_priority(priority)
        self._log(PriorityChanged(id=session_id, prio=record.priority.value))
        return record

    def move(self, session_id: str, device_id: str) -> None:
        """Place a session's (archived) chain on another device (its own is gone)."""
        record = self.sessions.lookup(session_id)
        if record is None:
            return
        old = record.device_id
        if old in self.devices:
            self.devices[old].sessions -= 1
        record.device_id = device_id
        # (a replayed move may name a device this process has not met yet)
        self.devices.setdefault(device_id, DeviceLoad()).sessions += 1
        self._log(SessionMoved(id=session_id, device=device_id))

    def delete(self, session_id: str) -> list[bytes]:
        """Forget a session (lost ones too). Returns blocks no session holds any more."""
        record = self.sessions.pop(session_id)
        if record.device_id is not None and record.device_id in self.devices:
            self.devices[record.device_id].sessions -= 1
        tenant = tenant_of(session_id)
        self.tenant_sessions[tenant] -= 1
        self.tenant_bytes[tenant] -= chain_bytes(record)
        self._log(SessionDeleted(id=session_id))
        self.responses.drop(session_id)
        return [k for k in dict.fromkeys(record.chain) if self._unref(k)]

    def mark_lost(self, session_id: str, reason: str) -> None:
        self.sessions.mark_lost(session_id, reason)
        self._log(SessionLost(id=session_id, reason=reason))

    def truncate(self, session_id: str, keep_blocks: int, reason: str) -> list[bytes]:
        """Only the first ``keep_blocks`` of a session's blocks survive (the rest are lost).

        The session serves that prefix from now on; its next append sends the
        blocks after it again (they are hashed from the same tokens, so nothing
        is ever stored under tokens it was not computed from).

        Returns:
            Blocks no session holds any more.
        """
        record = self.get(session_id)
        if not 0 < keep_blocks <= len(record.chain):
            raise InvalidInputError(
                f"keep_blocks must be in [1, {len(record.chain)}], got {keep_blocks}"
            )
        counts = block_token_count(record.layout, record.tokens)
        kept = record.chain[:keep_blocks]
        still_held = set(kept)
        dropped = [k for k in dict.fromkeys(record.chain[keep_blocks:]) if k not in still_held]
        before = chain_bytes(record)
        surviving = sum(counts[:keep_blocks])
        record.lost_tokens += record.tokens - surviving
        record.partial_reason = reason
        record.chain = list(kept)
        record.tokens = surviving
        self.tenant_bytes[tenant_of(session_id)] += chain_bytes(record) - before
        self._log_truncation(record)
        return [k for k in dropped if self._unref(k)]

    def _log_truncation(self, record: SessionRecord) -> None:
        self._log(SessionTruncated(id=record.session_id, keep=len(record.chain),
                                   lost_tokens=record.lost_tokens,
                                   reason=record.partial_reason or ""))

    def tenant_usage(self, limit: int = STATS_TENANTS) -> dict[str, TenantUse]:
        """Sessions and KV bytes per tenant (``""``: unscoped ids), the ``limit`` largest
        by bytes by name and the rest summed under :data:`OTHER_TENANTS`."""
        tenants = sorted(
            (t for t, n in self.tenant_sessions.items() if n > 0),
            key=lambda t: (-self.tenant_bytes[t], t),
        )
        out = {t: TenantUse(sessions=self.tenant_sessions[t], bytes=self.tenant_bytes[t])
               for t in tenants[:limit]}
        rest = tenants[limit:]
        if rest:
            out[OTHER_TENANTS] = TenantUse(
                sessions=sum(self.tenant_sessions[t] for t in rest),
                bytes=sum(self.tenant_bytes[t] for t in rest),
            )
        return out

    def check_quota(
        self,
        session_id: str,
        *,
        max_sessions: int | None = None,
        max_bytes: int | None = None,
        new_session: bool = False,
        update: ChainUpdate | None = None,
        elsewhere: tuple[int, int] = (0, 0),
    ) -> None:
        """Refuse a create or an append that would take a tenant over its quota.

        Args:
            elsewhere: the sessions and bytes the tenant holds in other shards
                of the table (:mod:`memkv.protocol.shards`).

        Raises:
            CapacityError: naming the tenant's use and its quota (HTTP 507).
        """
        tenant = tenant_of(session_id)
        if new_session and max_sessions is not None:
            sessions = self.tenant_sessions[tenant] + elsewhere[0]
            if sessions >= max_sessions:
                raise CapacityError(
                    f"tenant {tenant!r} has {sessions} sessions, its quota "
                    f"is {max_sessions}: delete some first"
                )
        if update is not None and max_bytes is not None:
            record = self.get(session_id)
            after = sum(update.layout.block_nbytes(n) for n in update.tokens)
            total = self.tenant_bytes[tenant] + elsewhere[1] - chain_bytes(record) + after
            if total > max_bytes:
                raise CapacityError(
                    f"tenant {tenant!r} would hold {total} bytes of KV, its quota is "
                    f"{max_bytes}: nothing was stored"
                )

    def referenced(self, key: bytes) -> bool:
        """Whether some session holds block ``key`` (the archive keeps only those)."""
        return self._refcounts[bytes(key)] > 0

    # -- the journal ---------------------------------------------------------------------

    def _log(self, record: JournalRecord) -> None:
        if self.journal is not None and not self._replaying:
            self.journal.append(encode_record(record))

    log = _log  # (parts beside the table journal their own records: router/responses.py)

    def _snapshot(self) -> list[dict[str, Any]]:
        records = snapshot_records(self.known_devices, self.known_archives, self.sessions,
                                   self.responses.entries())
        return [encode_record(r) for r in records]

    def compact_journal(self, every: int = 0) -> None:
        """Rewrite the journal as a snapshot of the table once it holds ``every`` records
        (0: any) and, when ``every`` is given, at least as many as the table has sessions.

        Rewriting only once the journal is as long as the table keeps the rewrite's
        cost per appended record constant as the table grows (at a fixed interval, a
        table of 100,000 sessions rewrote ten records for each one appended), and
        replay at start-up within about twice the table.
        """
        if self._compaction_due(every):
            assert self.journal is not None
            self.journal.snapshot(self._snapshot())

    async def compact_journal_async(self, every: int = 0) -> None:
        """:meth:`compact_journal` from the router's event loop, which serves other calls
        while the snapshot is written (one at a time; a second caller skips it)."""
        if self._compacting or not self._compaction_due(every):
            return
        assert self.journal is not None
        self._compacting = True
        try:
            await self.journal.snapshot_async(self._snapshot)
        finally:
            self._compacting = False

    def _compaction_due(self, every: int) -> bool:
        threshold = max(every, len(self.sessions)) if every > 0 else 1
        return self.journal is not None and (self.journal.records_since_snapshot >= threshold
                                             or self.journal.wants_snapshot)

    def restore_chain(self, record: SessionRecord, chain: Sequence[bytes], tokens: int,
                      turn: int, tail_rewrites: int, device_id: str | None) -> None:
        """A journal's put record: the session's chain as it was (references moved)."""
        old = dict.fromkeys(record.chain)
        new = dict.fromkeys(BlockHash(bytes(k)) for k in chain)
        if record.device_id is None and device_id is not None:
            record.device_id = device_id
            self.devices.setdefault(device_id, DeviceLoad()).sessions += 1
        for key in new:
            if key not in old:
                self._ref(key)
                self._block_namespace.setdefault(bytes(key), record.namespace)
        for key in old:
            if key not in new:
                self._unref(key)
        before = chain_bytes(record)
        record.chain = list(new)
        record.tokens = tokens
        self.tenant_bytes[tenant_of(record.session_id)] += chain_bytes(record) - before
        record.turn = turn
        record.tail_rewrites = tail_rewrites
        record.state = SessionState.ACTIVE

    def background_candidates(self, device_id: str, limit: int) -> list[str]:
        """The hottest sessions of a device that are not active (worth prefetching)."""
        now = self._clock()
        candidates = [r for r in self.sessions_on(device_id) if not r.active and not r.lost]
        candidates.sort(
            key=lambda r: r.hotness * math.exp(-self._decay * (now - r.last_access)), reverse=True
        )
        return [r.session_id for r in candidates[:limit]]

    def refcount(self, key: bytes) -> int:
        return self._refcounts[key]

    def match_prefix(
        self, layout: KVLayout, namespace: str, token_ids: Sequence[int]
    ) -> tuple[int, list[bytes], bool]:
        """Leading tokens of ``token_ids`` whose blocks some session of ``namespace``
        holds and a live device stores (a tier holds them: a block whose device was
        lost is no match, whatever the sessions' tables still say).

        Returns:
            ``(tokens, keys, behind)``: ``behind`` when the match stopped at a block a
            session holds that the index places on no live device: the index may be
            behind the devices' logs (read them and ask again).
        """
        counts = block_token_count(layout, len(token_ids))
        live = [d for d, load in self.devices.items() if load.live]
        matched: list[bytes] = []
        tokens = 0
        for hashed, n in zip(chain_hashes(token_ids, layout, namespace), counts, strict=True):
            key = bytes(hashed)
            if self._refcounts[key] <= 0:
                return tokens, matched, False
            if not any(self.blocks.holds(d, key) for d in live):
                return tokens, matched, True
            matched.append(key)
            tokens += n
        return tokens, matched, False

    def locate(
        self, keys: Sequence[bytes], namespace: str | Sequence[str] | None = None
    ) -> tuple[dict[str, list[bytes]], list[bytes]]:
        """Group ``keys`` by a live device whose pool holds them (the block index).

        Args:
            namespace: only blocks hashed in this namespace (or these) are found
                (None: any).

        Returns:
            ``(by_device, unplaced)``: the keys grouped by device, and those a
            session holds that the index places on no live device yet (its
            reading of the devices' logs is behind: read them, then ask again).

        Raises:
            UnknownBlockError: a key no session holds (or one of another namespace:
                the same answer, so keys of other tenants cannot be probed).
        """
        by_device: dict[str, list[bytes]] = {}
        unplaced: list[bytes] = []
        wanted = {namespace} if isinstance(namespace, str) else (
            None if namespace is None else set(namespace)
        )
        live = sorted(d for d, load in self.devices.items() if load.live)
        for key in keys:
            key = bytes(key)
            if self._refcounts[key] <= 0 or (
                wanted is not None and self._block_namespace.get(key) not in wanted
            ):
                raise UnknownBlockError(f"no session holds block {key.hex()}")
            holder = next((d for d in live if self.blocks.holds(d, key)), None)
            if holder is None:
                unplaced.append(key)
            else:
                by_device.setdefault(holder, []).append(key)
        return by_device, unplaced

    # -- internals -----------------------------------------------------------------------

    def _ref(self, key: bytes) -> None:
        self._refcounts[bytes(key)] += 1

    def _unref(self, key: bytes) -> bool:
        """One session less holds ``key``; True when none does any more."""
        key = bytes(key)
        self._refcounts[key] -= 1
        if self._refcounts[key] <= 0:
            del self._refcounts[key]
            self._block_namespace.pop(key, None)
            return True
        return False


def tenant_of(session_id: str) -> str:
    """The tenant part of a router id (``""`` for unscoped ids)."""
    tenant, sep, _ = session_id.partition(TENANT_SEPARATOR)
    return tenant if sep else ""


def chain_bytes(record: SessionRecord) -> int:
    """Bytes of a session's chain in the model dtype."""
    if not record.tokens:
        return 0
    counts = block_token_count(record.layout, record.tokens)
    return sum(record.layout.block_nbytes(n) for n in counts)
