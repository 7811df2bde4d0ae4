"""BlockPool: one device's KV blocks across hot, warm and cold tiers.

The block store under every DeviceCacheActor, in the manner of vLLM's block
pool: it knows blocks, not sessions. Its owner (the router, in a cluster or
in a single-process :class:`~memkv.store.TieredStore`) tells it which
blocks are held and by how many sessions, which of those are active, and at
what priority; the pool keeps where each block lives, pins of blocks being
read, and the movement between tiers:

* :meth:`BlockPool.put` applies a :class:`~memkv.protocol.messages.ChainUpdate`:
  new blocks go to the hot tier, blocks already stored anywhere are
  deduplicated by their :data:`~memkv.protocol.hashing.BlockHash`, and the
  references the update takes and drops are counted.
* Under pressure the hot tier demotes its victim to the warm tier (converted by
  the precision policy: fp16, or int8 for long-idle unshared blocks), and the
  warm tier writes its victim to the cold tier before freeing it: a block
  leaves memory only once a copy is safe on disk.
* ``fetch`` promotes a block back to the hot tier (hot and warm hold exclusive
  copies; the cold copy, once written, stays until the block dies).
* :meth:`BlockPool.deactivate` writes blocks to the cold tier and frees the
  memory copies no active holder needs (a session suspended);
  :meth:`BlockPool.activate` counts them in use again.
* A block no holder references and no reader pins is freed from every tier.

All public methods are thread-safe (one re-entrant lock, :attr:`BlockPool.lock`,
which the owner may take around several calls).

The pool is composed, as vLLM's block pool composes its free queue and hash map,
one idea per part: the block table (:mod:`memkv.storage.block_table`: records,
references per owner, events), the tier ladder over a list of memory tiers and
the cold tier (:mod:`~memkv.storage.pool_ladder`), references
(:mod:`~memkv.storage.pool_refs`: appends, holders, invariants) and reads
(:mod:`~memkv.storage.pool_reads`: fetches, pins, plans, prefetch). Each part is
handed what it uses; none reaches into another's attributes. This module owns
them, the arenas and the figures, and answers for all of them.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memkv.errors import (
    ConfigError,
    InvalidInputError,
)
from memkv.protocol.enums import Tier
from memkv.protocol.members import StoredBlocks
from memkv.storage.arena import Allocation
from memkv.storage.block_table import BlockTable, PoolGuard
from memkv.storage.cold_writer import ColdWriter, WriterStats
from memkv.storage.config import StoreConfig
from memkv.storage.device_arena import DeviceArena
from memkv.storage.free_memory import RELEASE_MIN_BYTES, release_idle_extents
from memkv.storage.pool_core import (
    BlockLocation,
    FetchedBlock,
    PoolStats,
    TierStats,
    _whole_units,
    hot_segment_name,
)
from memkv.storage.pool_ladder import TierLadder
from memkv.storage.pool_reads import Reads
from memkv.storage.pool_refs import References
from memkv.storage.prefetch import MarkovPrefetcher
from memkv.storage.shm_arena import SharedHostArena
from memkv.storage.tiers import ColdBackend, ColdTier, MemoryTier

__all__ = [
    "BlockLocation",
    "BlockPool",
    "FetchedBlock",
    "PoolStats",
    "ReservedSlots",
    "StoredBlocks",
    "TierStats",
]

@dataclass(frozen=True, slots=True)
class ReservedSlots:
    """Slots :meth:`BlockPool.reserve_slots` set aside: where a writer maps them
    (``segment``, ``segment_bytes`` long) and each one's place in it."""

    tier: Tier
    segment: str
    segment_bytes: int
    slots: tuple[Allocation, ...]


class BlockPool:
    """Hot → warm → cold block store: dedup, pins, demotion; no sessions.

    Args:
        config: capacities and component settings.
        cold: the cold tier, when it is not the pool's own segment files
            (``config.archive``): a cluster's archive actor.
        warm_name: name of the warm pool's shared-memory segment (another
            process on the node maps it by that name); None picks a unique one.
        clock: seconds, monotonic (injectable for tests of idle-time policies).

    Example:
        >>> pool = BlockPool(config)                          # doctest: +SKIP
        >>> update = table.plan_append("s1", len(tokens), chain)
        >>> pool.put(update, blocks)
        >>> block = pool.get(chain[0])
    """

    def __init__(
        self,
        config: StoreConfig,
        *,
        cold: ColdBackend | None = None,
        warm_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cold is None:
            if config.archive is None:
                raise ConfigError("a BlockPool needs config.archive or a cold backend")
            archive = config.archive
        self.config = config
        self._clock = clock
        self._guard = PoolGuard()
        unit = config.allocator.min_unit_bytes
        hot_bytes = _whole_units(config.hot_capacity_bytes, unit, "hot")
        # A CPU "device" keeps its hot tier in shared memory too, so that a
        # reader on the node (the same-node path) can copy straight out of it.
        hot_arena: DeviceArena | SharedHostArena = (
            SharedHostArena(hot_bytes, unit, name=hot_segment_name(warm_name))
            if config.device == "cpu"
            else DeviceArena(
                hot_bytes, unit, device=config.device, unified_memory=config.unified_memory
            )
        )
        hot = MemoryTier(Tier.HOT, hot_arena, config.eviction)
        pin_warm = config.device.startswith("cuda")
        try:
            warm_arena = SharedHostArena(
                _whole_units(config.warm_capacity_bytes, unit, "warm"),
                unit,
                name=warm_name,
                pin=pin_warm,
                # Frames come in every length: a few slab classes per doubling
                # (at most 1/8 rounding) instead of one per 256 bytes.
                slab_classes_per_doubling=(
                    8 if config.precision.compact_idle_seconds is not None else None
                ),
            )
            warm = MemoryTier(Tier.WARM, warm_arena, config.eviction)
            backend: ColdBackend = (
                cold
                if cold is not None
                else ColdTier(archive, config.codecs, config.cold_capacity_bytes)
            )
            writer = config.cold_writer
            self._cold: ColdBackend = (
                ColdWriter(
                    backend,
                    config.codecs,
                    max_pending_bytes=writer.max_pending_bytes,
                    max_batch_blocks=writer.max_batch_blocks,
                )
                if writer.write_behind
                else backend
            )
        except BaseException:
            hot.close()
            with contextlib.suppress(NameError):
                warm_arena.close()
            raise
        self._hot, self._warm = hot, warm
        self._hits: Counter[Tier] = Counter()
        self._counters: Counter[str] = Counter()
        self.table = BlockTable(uuid.uuid4().hex)
        self.ladder = TierLadder(config, self.table, [hot, warm], self._cold, self._counters)
        self.references = References(self._guard, self.table, self.ladder, clock,
                                     self._counters, check=config.debug_refcounts)
        self.reads = Reads(config, self._guard, self.table, self.ladder, clock, self._counters,
                           self._hits, MarkovPrefetcher(config.prefetch))
        # What the pool answers, by the part that answers it.
        references, reads = self.references, self.reads
        self.put, self.adopt, self.resync = references.put, references.adopt, references.resync
        self.release, self.deactivate = references.release, references.deactivate
        self.activate, self.set_priority = references.activate, references.set_priority
        self.stored_prefix, self.tokens_of = references.stored_prefix, references.tokens_of
        self.cold_orphans, self.block_events = references.cold_orphans, references.block_events
        self.refcounts, self.check_invariants = references.refcounts, references.check_invariants
        self.contains, self.locate, self.held = reads.contains, reads.locate, reads.held
        self.get, self.fetch, self.fetch_many = reads.get, reads.fetch, reads.fetch_many
        self.pinned_reads, self.pin_blocks = reads.pinned_reads, reads.pin_blocks
        self.plan_reads, self.unpin_blocks = reads.plan_reads, reads.unpin_blocks
        self.prefetch, self.prefetch_predicted = reads.prefetch, reads.prefetch_predicted
        self.hot_locations = reads.hot_locations
        self.prefault_done = threading.Event()
        # Tiers memkv sized itself ('auto') stay lazy: committing a guess at start is
        # what made a default device actor hold 6 GB before its first block.
        prefaulted = [
            tier for name, tier in (("hot", self._hot), ("warm", self._warm))
            if config.prefault and name not in config.lazy_tiers
        ]
        if prefaulted:
            # Off the caller's path: a fresh page costs a fault on first write.
            threading.Thread(
                target=self._prefault, args=(prefaulted,), name="memkv-prefault", daemon=True
            ).start()
        else:
            self.prefault_done.set()

    def _prefault(self, tiers: list[MemoryTier]) -> None:
        try:
            for tier in tiers:
                tier.arena.prefault()
        finally:
            self.prefault_done.set()

    @property
    def closed(self) -> bool:
        return self._guard.closed

    @property
    def lock(self) -> threading.RLock:
        """The pool's lock: an owner takes it to make several calls one step."""
        return self._guard.lock

    @property
    def cold(self) -> ColdBackend:
        """The cold tier (a single-process owner keeps its manifests there)."""
        return self._cold

    def ensure_open(self) -> None:
        """Raise ClosedError once the pool is closed."""
        self._guard.ensure_open()

    def close(self) -> None:
        """Flush the cold tier and release the arenas. Idempotent."""
        with self.lock:
            if self._guard.closed:
                return
            self._guard.closed = True
            self._cold.close()
            self._warm.close()
            self._hot.close()

    def __enter__(self) -> BlockPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def release_free_memory(self, min_bytes: int = RELEASE_MIN_BYTES) -> int:
        """Give the kernel back the pages of the tiers' free extents of at least
        ``min_bytes`` (memkv.storage.free_memory); the bytes given back."""
        with self.lock:
            self.ensure_open()
            return release_idle_extents([self._hot.arena, self._warm.arena], min_bytes)

    def managed_hot_arena(self) -> Any:
        """The hot arena's managed allocation (unified memory), or None."""
        return getattr(self._hot.arena, "_managed", None)

    def stats(self) -> PoolStats:
        with self.lock:
            self.ensure_open()
            tiers: dict[Tier, TierStats] = {}
            for tier in (self._hot, self._warm):
                arena = tier.arena_stats()
                tiers[tier.tier] = TierStats(
                    tier.tier,
                    tier.capacity_bytes,
                    tier.used_bytes,
                    len(tier),
                    self._hits[tier.tier],
                    tier.evictions,
                    arena.external_fragmentation,
                )
            cold = self._cold.stats()
            writer = self.cold_writer_stats()
            tiers[Tier.COLD] = TierStats(
                Tier.COLD,
                self._cold.capacity_bytes,
                cold.live_bytes,
                cold.blocks,
                self._hits[Tier.COLD],
                0,
                cold.dead_bytes / max(1, cold.live_bytes + cold.dead_bytes),
            )
            unique = sum(b.layout.block_nbytes(b.tokens) for b in self.table.values())
            c = self._counters
            return PoolStats(
                tiers=tiers,
                blocks=len(self.table),
                unique_bytes=unique,
                dedup_hits=c["dedup_hits"],
                dedup_bytes_saved=c["dedup_bytes_saved"],
                misses=c["misses"],
                promotions=c["promotions"],
                demotions=c["demotions"],
                demotions_ahead=c["demotions_ahead"],
                prefetched=c["prefetched"],
                prefetch_used=c["prefetch_used"],
                precision_fallbacks=c["precision_fallbacks"],
                lossy_conversions=c["lossy_conversions"],
                cold_write_batches=writer.batches if writer else 0,
                cold_blocks_written=writer.blocks_written if writer else 0,
            )

    def cold_writer_stats(self) -> WriterStats | None:
        """The cold writer's figures; None when demotions write inline."""
        return self._cold.writer_stats() if isinstance(self._cold, ColdWriter) else None

    def short_of_headroom(self) -> bool:
        """Whether a memory tier has less free than its headroom (see :meth:`demote_ahead`)."""
        with self.lock:
            return not self._guard.closed and any(self.ladder.headroom_short(t)
                                                   for t in self.ladder.memory)

    def demote_ahead(self, max_blocks: int) -> int:
        """Demote up to ``max_blocks`` blocks so that each memory tier has its headroom
        (``eviction.headroom_fraction`` of it) free; returns how many moved.

        The device calls this off the request path, a few blocks per call so that
        puts and reads interleave: an append then lands in free space instead of
        evicting on its way in (copying victims down and handing them to the cold
        writer measured ~4x the append's own time once a device was full). Hot
        goes first: its victims fill the warm tier, whose own go to cold.

        Raises:
            ClosedError: the pool is closed.
            CapacityError: the cold tier is full (nothing was lost: the victim stays).
        """
        moved = 0
        with self.lock:
            self.ensure_open()
            now = self._clock()
            for tier in self.ladder.memory:
                while moved < max_blocks and self.ladder.headroom_short(tier):
                    if not self.ladder.evict_one(tier, now):
                        break  # all pinned (being read): the next call tries again
                    moved += 1
            self._counters["demotions_ahead"] += moved
            if self.config.debug_refcounts:
                self.check_invariants()
        return moved

    @property
    def hot_tier(self) -> MemoryTier:
        return self._hot

    @property
    def warm_tier(self) -> MemoryTier:
        return self._warm

    def shared_tier(self) -> tuple[MemoryTier, str] | None:
        """The tier write reservations are made in, and its segment's name: the hot
        tier where it is host memory (a CPU device), else the warm tier (a writer
        maps the segment; device memory it cannot)."""
        for tier in (self._hot, self._warm):
            name = getattr(tier.arena, "name", None)
            if name is not None:
                return tier, str(name)
        return None

    def shared_capacity_bytes(self) -> int | None:
        """Size of the tier :meth:`reserve_slots` reserves in (None: none can)."""
        shared = self.shared_tier()
        return None if shared is None else shared[0].capacity_bytes

    def slot_view(self, slot: Allocation, shape: tuple[int, ...], dtype: torch.dtype
                  ) -> torch.Tensor:
        """A reserved slot's first bytes as a tensor (what a writer put there)."""
        with self.lock:
            self.ensure_open()
            tier = self._owner_of(slot)
            return tier.arena.view(slot, shape, dtype, prefix=True)

    def reserve_slots(self, count: int, nbytes: int) -> ReservedSlots | None:
        """``count`` slots of ``nbytes`` in the shared-memory tier new blocks land in,
        for a writer on this host to fill and an append to name (:meth:`put`'s
        ``placed``): the append then stores no copy. All or none; None where no
        memory tier is shared memory, or there is no room even after evicting.

        The slots belong to no block until a put adopts them; the caller frees
        the rest with :meth:`free_slots`.
        """
        if count <= 0 or nbytes <= 0:
            raise InvalidInputError(f"reserve a positive count of positive sizes, got "
                                    f"{count} x {nbytes}")
        with self.lock:
            self.ensure_open()
            shared = self.shared_tier()
            if shared is None or nbytes > shared[0].arena.max_alloc_bytes:
                return None
            tier, segment = shared
            now = self._clock()
            slots: list[Allocation] = []
            while len(slots) < count:
                slot = tier.arena.allocate(nbytes)
                if slot is not None:
                    slots.append(slot)
                elif not self.ladder.evict_one(tier, now):
                    for taken in slots:
                        tier.arena.free(taken)
                    return None
            return ReservedSlots(tier.tier, str(segment), tier.capacity_bytes, tuple(slots))

    def free_slots(self, slots: Sequence[Allocation]) -> None:
        """Give back reserved slots no put adopted (see :meth:`reserve_slots`)."""
        with self.lock:
            if self._guard.closed:
                return  # the arenas went with the pool
            for slot in slots:
                tier = self._owner_of(slot)
                tier.arena.free(slot)

    def _owner_of(self, slot: Allocation) -> MemoryTier:
        tier = self.ladder.owner_of(slot)
        if tier is None:
            raise InvalidInputError("a slot of no memory tier of this pool")
        return tier

    def flush_cold(self) -> None:
        """Wait until every demotion queued so far has reached the cold tier."""
        if isinstance(self._cold, ColdWriter):
            self._cold.flush()

    def archive_held(self, limit: int = 64) -> tuple[int, int]:
        """Give up to ``limit`` held blocks that live only in memory a durable cold copy.

        A planned stop calls this until nothing is left, so that every session,
        ``memory`` mode included, is served again after the restart (from the
        cold tier). Blocks are copied as they are stored (no lossy codec: the
        session's exactness does not change because the process stopped); the
        memory copies stay, so reads go on meanwhile. Returns ``(written,
        left)``: blocks copied by this call and held blocks still without one.
        """
        self.flush_cold()  # demotions queued behind count as copied once they land
        with self.lock:
            self.ensure_open()
            pending = [e for e in self.table.values() if e.refcount > 0 and not e.in_cold]
            batch = pending[:limit]
            if batch:
                self.ladder.ensure_cold_many(batch, offline=False, durable=True)
            return len(batch), len(pending) - len(batch)
