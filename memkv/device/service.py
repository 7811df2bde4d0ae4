"""One device's hot and warm tiers as a block store: :class:`DeviceService`.

It wraps a :class:`~memkv.storage.block_pool.BlockPool` and has no session
table: the router, the one owner of sessions, says which blocks an append
holds and drops (:class:`~memkv.protocol.messages.ChainUpdate`), which go idle
or active, and at what priority. It speaks in plain values and typed messages
because every call crosses a process boundary; what only a Ray process has
(the archive actor as its cold tier, the object store, the node's id) is
handed in by its actor shell, :class:`memkv.actors.device.DeviceCache`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from memkv.device.cuts import cut_block
from memkv.device.headroom import HeadroomKeeper
from memkv.device.leases import LeaseTable
from memkv.device.reservations import DEFAULT_RESERVATION_S, SlotReservations
from memkv.errors import CorruptDataError, InvalidInputError, WrongNodeError
from memkv.gpu_kernels import backend as kernel_backend
from memkv.gpu_kernels.unified import PriorityStreams
from memkv.protocol.dtypes import numpy_view_dtype, torch_dtype
from memkv.protocol.enums import Priority, Tier
from memkv.protocol.events import BlockEvents
from memkv.protocol.hashing import BlockHash
from memkv.protocol.layout import KVLayout
from memkv.protocol.members import DeviceInfo, Holder, SlotGrant, StoredBlocks
from memkv.protocol.messages import ChainUpdate, ReadPlan
from memkv.protocol.payload import BlockPayload, StagedBlock
from memkv.protocol.services import BlockCut
from memkv.protocol.stats import DeviceStats, LeaseStats, ReservationStats, TierStats
from memkv.shm.ownership import (
    SegmentOwnership,
    reclaim_orphans,
    warm_segment_name,
)
from memkv.shm.same_node import SegmentMaps
from memkv.shm.sweeper import OrphanSweeper
from memkv.storage.arena import Allocation
from memkv.storage.block_pool import BlockPool
from memkv.storage.config import CodecConfig, StoreConfig
from memkv.storage.payloads import from_payload, to_payload
from memkv.storage.sizing import TierSizes
from memkv.storage.tiers import ColdBackend

__all__ = [
    "DEFAULT_LEASE_S",
    "MAX_LEASE_S",
    "READ_HOLD_S",
    "DeviceService",
    "attach_priority_session",
]

#: How long a read plan's blocks stay pinned unless released earlier (seconds).
DEFAULT_LEASE_S = 30.0
MAX_LEASE_S = 600.0
#: How long a read's hold on its blocks lasts at most (a read takes far less;
#: a reader that vanished without releasing is let go of after this).
logger = logging.getLogger(__name__)

READ_HOLD_S = 120.0
#: How long without a put before the device gives free tier memory back (seconds).
IDLE_RELEASE_S = 60.0


def _as_is(blocks: object) -> object:
    return blocks


def attach_priority_session(
    streams: PriorityStreams | None,
    pool: BlockPool,
    session_id: str,
    keys: Sequence[bytes],
    priority: Priority,
) -> int:
    """A high-priority session's hot blocks onto its own stream; others lose theirs.

    Returns the blocks attached (0 without unified memory: ``streams`` is None).
    """
    if streams is None:
        return 0
    if priority is not Priority.HIGH:
        streams.release(session_id)
        return 0
    located = pool.hot_locations(keys)
    for offset, nbytes in located:
        streams.attach(session_id, offset, nbytes)
    return len(located)



class DeviceService:
    """The hot and warm tiers of one device, behind plain-value methods.

    Args:
        device_id: the cluster-wide name of this device.
        store_config: tier capacities and policies (``archive`` unused when
            ``cold_tier`` is given); a deployment's device settings are resolved
            into one by the actor (:mod:`memkv.actors.device`).
        cold_tier: makes the cold tier from the resolved codecs (the node's
            archive, in a cluster); None keeps a local one
            (``store_config.archive``), for single-process use.
        same_node_reads: serve read plans (shared-memory reads of this node).
        tier_sizes: how the tiers were sized (None: from ``store_config``).
        put_object: how :meth:`fetch_blocks` hands blocks over (the actor: ``ray.put``;
            as they are by default).
        node_id: the node this device runs on (readers compare it with theirs).
        segment_scope: the deployment the device belongs to (its Ray namespace): part
            of its shared-memory names, so two deployments on one node, whose
            devices have the same names, do not claim the same segments.
        archive_name: the archive actor that is this device's cold tier ("": a
            local one), what its pings tell the router.
        clock: seconds, monotonic (injectable for tests of idle-time policies).
    """

    def __init__(
        self,
        device_id: str,
        store_config: StoreConfig,
        cold_tier: Callable[[CodecConfig], ColdBackend] | None = None,
        *,
        same_node_reads: bool = True,
        tier_sizes: TierSizes | None = None,
        put_object: Callable[[list[BlockPayload]], object] = _as_is,
        node_id: str = "local",
        segment_scope: str = "",
        archive_name: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device_id = device_id
        self.archive_name = archive_name
        # How fetch_blocks hands its blocks over: into the node's object store
        # (a process without Ray, the gateway's fakes, passes an in-memory ref).
        self._put_object = put_object
        self.incarnation = uuid.uuid4().hex
        # Plain use (tests, one process) plans reads unless told otherwise; a
        # deployment says so in its device settings (off unless turned on).
        self.same_node_reads = same_node_reads
        self.tier_sizes = tier_sizes if tier_sizes is not None else store_config.tier_sizes()
        cold = cold_tier(store_config.codecs) if cold_tier is not None else None
        # A fixed segment name per device, so a restart after a crash (which
        # could not unlink it) reclaims the old warm pool instead of leaking it.
        self.warm_segment = warm_segment_name(
            f"{segment_scope}.{device_id}" if segment_scope else device_id)
        # Segments of devices that died without unlinking them (their lock is
        # free) hold populated memory: reclaim them, then take this one's name.
        reclaim_orphans()
        self._ownership = SegmentOwnership(self.warm_segment)
        try:
            self.pool = BlockPool(store_config, cold=cold, warm_name=self.warm_segment,
                                  clock=clock)
        except BaseException:
            self._ownership.release()
            raise
        self.leases = LeaseTable(lambda keys: self.pool.unpin_blocks([BlockHash(k) for k in keys]))
        self.reservations = SlotReservations(self.pool, clock=clock)
        # Room for the next put, made between requests (None: demote on demand only).
        self.headroom = (HeadroomKeeper(self.pool).start()
                         if store_config.eviction.headroom_fraction > 0 else None)
        # Segments of processes that died on this host (a killed engine's staging):
        # unlinked while the device runs, not only when the next memkv process starts;
        # and, after a while without puts, the pages of free extents given back.
        self._last_put = clock()
        self._clock = clock
        self.sweeper = OrphanSweeper(also=self._after_sweep).start()
        self.node_id = node_id
        self._staging_maps = SegmentMaps()  # gateways' staging segments (memkv.shm.staging)
        self._streams: PriorityStreams | None = None  # unified memory only

    def ping(self) -> DeviceInfo:
        """Who answers: the device id and this process's incarnation."""
        return DeviceInfo(self.device_id, self.incarnation, self.archive_name, self.node_id)

    def node(self) -> str:
        """The Ray node this device runs on."""
        return self.node_id

    def reserved(self) -> str:
        """What this device's tiers reserved and why, in words (``memkv up`` prints it)."""
        return self.tier_sizes.describe()

    def wait_prefaulted(self, timeout_s: float) -> bool:
        """Block until the arenas' pages are populated (benchmarks wait for it)."""
        return self.pool.prefault_done.wait(timeout_s)

    # -- blocks, as the router (the owner of sessions) directs -----------------

    def put(
        self,
        update: ChainUpdate,
        blocks: Sequence[BlockPayload | StagedBlock | torch.Tensor],
        checksums: Sequence[int] | None = None,
        durable: bool = False,
        owner: str = "",
        since: tuple[str, int] | None = None,
    ) -> StoredBlocks:
        """Apply one append: its new blocks (payloads, refs to them, or staged) and references.

        Staged blocks are copied out of the sender's segment before this returns,
        so the sender may reuse the space once it has the answer. Blocks in slots of
        a write reservation (:meth:`reserve_slots`) are adopted where they are;
        the reservations an append names end with it (slots it did not use go back).

        Args:
            update: what the append changes, from the router.
            checksums: the writer's CRC32 of each block, already verified by the
                caller (the gateway): kept and served with the block.
            durable: answer only once every block of the chain is fsynced in
                the archive (an ``archive``-mode session).
            owner: the router shard whose session this is (each shard's
                references are its own: see :meth:`resync`).
            since: the caller's cursor of this device's block changes: the answer
                carries the changes after it (this append's among them).
        """
        self.leases.sweep()
        self._last_put = self._clock()
        placed: dict[int, Allocation] = {}  # blocks a writer left in reserved slots
        reservations: set[str] = set()
        try:
            tensors = []
            for i, p in enumerate(blocks):
                if isinstance(p, StagedBlock) and p.reservation:
                    reservations.add(p.reservation)
                    placed[i] = self.reservations.take(p)
                    tensors.append(self.pool.slot_view(placed[i], p.shape,
                                                       torch_dtype(p.dtype)))
                elif isinstance(p, BlockCut):
                    tensors.append(cut_block(self.pool, p))
                else:
                    tensors.append(p if isinstance(p, torch.Tensor)  # a caller in this process
                                   else from_payload(self._unstage(p)
                                                     if isinstance(p, StagedBlock) else p))
            named = len(placed)
            stored = self.pool.put(update, tensors, checksums=checksums, durable=durable,
                                   owner=owner, placed=placed)
            self.reservations.note_adopted(named - len(placed))
        finally:
            if reservations:
                self.reservations.finish(reservations, placed.values())
        if self.headroom is not None:
            self.headroom.nudge()
        if since is None:
            return stored
        return replace(stored, events=self.block_events(since))

    def reserve_slots(self, count: int, slot_bytes: int,
                      ttl_s: float = DEFAULT_RESERVATION_S) -> SlotGrant | None:
        """A write reservation: ``count`` slots of ``slot_bytes`` in this device's shared
        memory for a writer on its node to fill and an append to name; the put then
        adopts the bytes instead of copying them (:mod:`memkv.device.reservations`).

        None where no tier is shared memory or there is no room for them.

        Raises:
            InvalidInputError: a count or size that is not positive, a bad ``ttl_s``.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0 \
                or isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) \
                or slot_bytes <= 0:
            raise InvalidInputError(
                f"reserve a positive int of slots of a positive int of bytes, got "
                f"{count!r} x {slot_bytes!r}")
        reservation = self.reservations.grant(count, slot_bytes, ttl_s)
        if reservation is None:
            return None
        reserved = reservation.reserved
        return SlotGrant(
            reservation_id=reservation.reservation_id, device_id=self.device_id,
            node_id=self.node_id, incarnation=self.incarnation, segment=reserved.segment,
            segment_bytes=reserved.segment_bytes, slot_bytes=slot_bytes,
            offsets=tuple(s.offset for s in reserved.slots), ttl_s=float(ttl_s))

    def shared_segments(self) -> tuple[str, list[tuple[str, int, bool]]]:
        """This process's incarnation and its tiers' shared-memory segments: ``(name,
        size, reservable)`` (``reservable``: where write reservations are made). A
        reader or writer on this node maps them once, at its start, rather than
        paying the page faults in its first request."""
        reservable = self.pool.shared_tier()
        out = []
        for tier in (self.pool.hot_tier, self.pool.warm_tier):
            name = getattr(tier.arena, "name", None)
            if name is not None:
                out.append((str(name), tier.capacity_bytes,
                            reservable is not None and reservable[1] == name))
        return self.incarnation, out

    def block_events(self, since: tuple[str, int] = ("", 0)) -> BlockEvents:
        """Blocks stored into and removed from this device's table after ``since``
        (``(epoch, position)``; another epoch or a position too far back: a snapshot)."""
        epoch, position = since
        return self.pool.block_events(position, epoch)

    def _unstage(self, staged: StagedBlock) -> BlockPayload:
        """A view of a staged block in its sender's segment (the pool copies it)."""
        if staged.node_id != self.node_id:
            raise WrongNodeError(
                f"block {staged.key.hex()} is staged on node {staged.node_id}, this device "
                f"runs on {self.node_id}: send it by value")
        segment = self._staging_maps.view(staged.segment, staged.segment_bytes,
                                          staged.incarnation)
        end = staged.offset + staged.nbytes
        if staged.offset < 0 or end > segment.size:
            raise CorruptDataError(
                f"staged block {staged.key.hex()}: bytes {staged.offset}+{staged.nbytes} lie "
                f"outside segment {staged.segment!r} of {segment.size} bytes")
        np_dtype = numpy_view_dtype(staged.dtype)
        data = segment[staged.offset : end].view(np_dtype).reshape(staged.shape)
        return BlockPayload(staged.key, staged.dtype, data)

    def adopt(
        self,
        layout: KVLayout,
        chain: Sequence[bytes],
        tokens: Sequence[int],
        priority: str,
        exact_only: bool = False,
        owner: str = "",
        keep_prefix: bool = False,
    ) -> int:
        """Hold an archived chain again (after this device restarted, or moved here).

        Returns the leading blocks held: all, or with ``keep_prefix`` those
        before the first block that is in no tier.

        Raises:
            BlockLostError: some block is in no tier, or (``keep_prefix``) the first.
        """
        return self.pool.adopt(
            layout, chain, tokens, Priority(priority), exact_only, owner, keep_prefix=keep_prefix
        )

    def resync(self, holders: Sequence[Holder], owner: str = "") -> list[int]:
        """Set ``owner``'s block references from its table (a restarted router shard).

        The references of other shards stay as they are.

        Returns:
            Indices of holders some of whose blocks are in no tier (lost).
        """
        return self.pool.resync(holders, owner)

    def release(self, keys: Sequence[bytes], active: bool, owner: str = "") -> int:
        """A holder of ``keys`` went (session deleted). Returns the blocks freed."""
        return self.pool.release(keys, active=active, owner=owner)

    def deactivate(
        self,
        keys: Sequence[bytes],
        offline: bool = False,
        was_active: bool = True,
        owner: str = "",
    ) -> bool:
        """A session suspended: its blocks go cold; True if some stay in memory."""
        return self.pool.deactivate(keys, offline=offline, was_active=was_active, owner=owner)

    def activate(self, keys: Sequence[bytes], owner: str = "") -> list[tuple[bytes, str, int]]:
        """A session resumed: its blocks count as in use. Answers ``(key, tier, tokens)``."""
        self.pool.activate(keys, owner)
        return self.tiers_of(keys)

    def tiers_of(self, keys: Sequence[bytes]) -> list[tuple[bytes, str, int]]:
        """``(key, tier, tokens)`` of stored blocks."""
        out = []
        for k in keys:
            key = BlockHash(bytes(k))
            tier = self.pool.locate(key) or Tier.COLD
            out.append((bytes(k), tier.value, self.pool.tokens_of(key)))
        return out

    def set_priority(
        self, keys: Sequence[bytes], priority: str, session_id: str | None = None
    ) -> None:
        """Move a session's blocks to ``priority``'s eviction queue; with unified memory,
        a high-priority session's hot blocks also get a CUDA stream of their own."""
        self.pool.set_priority(keys, Priority(priority))
        if session_id is not None:
            attach_priority_session(self._priority_streams(), self.pool, session_id, keys,
                                    Priority(priority))

    def _priority_streams(self) -> PriorityStreams | None:
        if self._streams is None:
            managed = self.pool.managed_hot_arena()
            if managed is not None:
                self._streams = PriorityStreams(managed)
        return self._streams

    def get_blocks(self, keys: Sequence[bytes], stream: str | None = None) -> list[BlockPayload]:
        """Blocks by key, each promoted to the hot tier (batched: one call, many blocks;
        the cold ones in one archive call)."""
        fetched = self.pool.fetch_many([BlockHash(bytes(k)) for k in keys], stream=stream)
        return [to_payload(bytes(f.key), f.block, f.tier.value, f.exact, f.lossy)
                for f in fetched]

    def fetch_blocks(self, keys: Sequence[bytes], stream: str | None = None) -> object:
        """Blocks by key as one object in the node's object store (the in-cluster path).

        The bytes are copied once, from the arena (pinned meanwhile) into the
        object store, where every reader on the node maps them without a copy
        (a read-only view). The caller gets the object's reference: one more
        local fetch, one copy less than returning the blocks by value, which
        would need an owned copy to serialise after the pins are gone.
        """
        hashes = [BlockHash(bytes(k)) for k in keys]
        with self.pool.pinned_reads(hashes, stream=stream) as fetched:
            return self._put_object(
                [to_payload(f.key, f.block, f.tier.value, f.exact, f.lossy) for f in fetched]
            )

    def read_plan(
        self,
        keys: Sequence[bytes],
        stream: str | None = None,
        ttl_s: float = DEFAULT_LEASE_S,
        ahead: Sequence[bytes] = (),
        owner: str | None = None,
    ) -> ReadPlan:
        """Pin blocks and say where a reader on this node copies them from (same-node path).

        The blocks stay pinned until :meth:`release_lease` or for ``ttl_s``
        seconds, whichever comes first. Entries that are None could not be
        planned (read them with :meth:`get_blocks`). ``ahead`` (read-ahead) are
        planned after ``keys`` only where they are in memory already. ``owner``:
        only a release naming it ends the lease early (a client's tenant).

        A deployment without ``same_node_reads`` answers a plan of no entries
        (``same_node`` False).

        Raises:
            UnknownBlockError: a key is not stored here (nothing stays pinned).
            InvalidInputError: ``ttl_s`` is not in (0, MAX_LEASE_S].
        """
        if (
            isinstance(ttl_s, bool)
            or not isinstance(ttl_s, int | float)
            or not (0 < ttl_s <= MAX_LEASE_S)
        ):
            raise InvalidInputError(f"ttl_s must be in (0, {MAX_LEASE_S}] seconds, got {ttl_s!r}")
        hashes = [BlockHash(bytes(k)) for k in keys]
        if not self.same_node_reads:
            # Off for this deployment: nothing is planned (readers go in-cluster).
            return ReadPlan(
                "",
                self.device_id,
                self.node_id,
                self.incarnation,
                0.0,
                tuple(None for _ in keys),
                same_node=False,
            )
        planned = self.pool.plan_reads(
            hashes, stream=stream, ahead=[BlockHash(bytes(k)) for k in ahead]
        )
        pinned = [p.key for p in planned if p is not None]
        lease = self.leases.grant(pinned, float(ttl_s), owner)
        return ReadPlan(
            lease_id=lease.lease_id,
            device_id=self.device_id,
            node_id=self.node_id,
            incarnation=self.incarnation,
            ttl_s=float(ttl_s),
            entries=tuple(planned),
            expires_at=lease.expires_at,
        )

    def hold_for_read(self, keys: Sequence[bytes], ttl_s: float = READ_HOLD_S) -> str:
        """Pin every block a read will send, before it sends the first (its answer's head).

        A session deleted or shortened while the read streams frees these
        blocks only once :meth:`release_lease` (or ``ttl_s``) lets go of them:
        a read that got its 200 sends every block it announced.

        Returns:
            The lease to release.

        Raises:
            UnknownBlockError: a block is not stored here (nothing is pinned).
        """
        if not 0 < ttl_s <= MAX_LEASE_S:
            raise InvalidInputError(f"ttl_s must be in (0, {MAX_LEASE_S}] seconds, got {ttl_s!r}")
        pinned = self.pool.pin_blocks([BlockHash(bytes(k)) for k in keys])
        return self.leases.grant(pinned, float(ttl_s)).lease_id

    def still_held(self, keys: Sequence[bytes]) -> list[bytes]:
        """Those of ``keys`` this device keeps (a reader's pin outlives a delete)."""
        return self.pool.held(keys)

    def release_lease(self, lease_id: str, owner: str | None = None) -> bool:
        """Unpin a plan's blocks. False if the lease had run out (discard what was copied),
        or is ``owner``'s to release and someone else asked."""
        return self.leases.release(lease_id, owner)

    # -- prefetch ----------------------------------------------------------------------

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Bring blocks into free hot-tier space (never evicting for it)."""
        return self.pool.prefetch([BlockHash(bytes(k)) for k in keys])

    def prefetch_predicted(self, key: bytes) -> int:
        """Prefetch what the Markov model expects after ``key``."""
        return self.pool.prefetch_predicted(BlockHash(bytes(key)))

    def flush_cold(self) -> None:
        """Wait until every demotion queued so far has reached the archive (benchmarks,
        drains)."""
        self.pool.flush_cold()

    def archive_held(self, limit: int = 64) -> tuple[int, int]:
        """A planned stop: durable archive copies of up to ``limit`` memory-only held
        blocks; ``(written, left)`` (see :meth:`BlockPool.archive_held`)."""
        return self.pool.archive_held(limit)

    # -- stats -------------------------------------------------------------------------

    def stats(self) -> DeviceStats:
        pool = self.pool.stats()
        hot = pool.tiers[Tier.HOT]
        return DeviceStats(
            tiers={
                t.value: TierStats(
                    capacity_bytes=s.capacity_bytes, used_bytes=s.used_bytes, blocks=s.blocks,
                    hits=s.hits, evictions=s.evictions, fragmentation=s.fragmentation,
                )
                for t, s in pool.tiers.items()
            },
            blocks=pool.blocks, unique_bytes=pool.unique_bytes, dedup_hits=pool.dedup_hits,
            dedup_bytes_saved=pool.dedup_bytes_saved, misses=pool.misses,
            promotions=pool.promotions, demotions=pool.demotions, prefetched=pool.prefetched,
            prefetch_used=pool.prefetch_used, precision_fallbacks=pool.precision_fallbacks,
            lossy_conversions=pool.lossy_conversions,
            cold_write_batches=pool.cold_write_batches,
            cold_blocks_written=pool.cold_blocks_written,
            demotions_ahead=pool.demotions_ahead,
            kernels=kernel_backend(),  # cuda, or cpu (the reference)
            leases=LeaseStats(active=len(self.leases), granted=self.leases.granted,
                              expired=self.leases.expired),
            reservations=ReservationStats(
                active=len(self.reservations), granted=self.reservations.granted,
                expired=self.reservations.expired,
                adopted_slots=self.reservations.adopted_slots),
            device_id=self.device_id,
            incarnation=self.incarnation,
            prefault_done=self.pool.prefault_done.is_set(),
            reserved=self.reserved(),
            hot_usage=hot.used_bytes / hot.capacity_bytes if hot.capacity_bytes else 0.0,
        )

    def locations(self, keys: Sequence[bytes]) -> list[str | None]:
        """The tier of each block on this device (None: not here)."""
        out: list[str | None] = []
        for k in keys:
            tier = self.pool.locate(BlockHash(bytes(k)))
            out.append(tier.value if tier is not None else None)
        return out

    def _after_sweep(self) -> None:
        # Staging segments whose writer went (unlinked by it or by a sweeper): a mapping
        # kept here would keep their pages (an engine's 1 GiB) alive for the device's life.
        self._staging_maps.prune_unlinked()
        self._release_idle_memory()

    def _release_idle_memory(self) -> int:
        """Free extents' pages back to the kernel, once no put came for IDLE_RELEASE_S."""
        if self._clock() - self._last_put < IDLE_RELEASE_S:
            return 0
        released = self.pool.release_free_memory()
        if released:
            logger.info("device %s gave back %d MiB of free tier memory", self.device_id,
                        released >> 20)
        return released

    def close(self) -> None:
        self.sweeper.close()
        if self.headroom is not None:
            self.headroom.close()
        self.reservations.close()
        self.pool.close()
        self._ownership.release()
