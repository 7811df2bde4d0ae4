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

The pool is layered, one idea per module: :mod:`memkv.storage.pool_core` (records
and shared state), :mod:`~memkv.storage.pool_ladder` (the tiers),
:mod:`~memkv.storage.pool_refs` (references), :mod:`~memkv.storage.pool_reads`
(reads and prefetch); this module puts them together.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memkv.errors import (
    ConfigError,
    InvalidInputError,
)
from memkv.protocol.enums import Tier
from memkv.protocol.hashing import BlockHash
from memkv.protocol.members import StoredBlocks
from memkv.storage.arena import Allocation
from memkv.storage.block_events import BlockEventLog
from memkv.storage.codecs import CodecPolicy
from memkv.storage.cold_writer import ColdWriter, WriterStats
from memkv.storage.config import StoreConfig
from memkv.storage.device_arena import DeviceArena
from memkv.storage.free_memory import RELEASE_MIN_BYTES, release_idle_extents
from memkv.storage.pool_core import (
    BlockLocation,
    FetchedBlock,
    PoolStats,
    TierStats,
    _Block,
    _whole_units,
    hot_segment_name,
)
from memkv.storage.pool_reads import Reads
from memkv.storage.precision import (
    PrecisionPolicy,
)
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

#: Puts whose size the headroom remembers (it keeps room for the largest of them).
RECENT_PUTS = 16


@dataclass(frozen=True, slots=True)
class ReservedSlots:
    """Slots :meth:`BlockPool.reserve_slots` set aside: where a writer maps them
    (``segment``, ``segment_bytes`` long) and each one's place in it."""

    tier: Tier
    segment: str
    segment_bytes: int
    slots: tuple[Allocation, ...]


class BlockPool(Reads):
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
        self._lock = threading.RLock()
        self._cold_read_ahead = {}
        self._recent_put_bytes = deque(maxlen=RECENT_PUTS)
        self._events = BlockEventLog(uuid.uuid4().hex)
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
        self._hot = MemoryTier(Tier.HOT, hot_arena, config.eviction)
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
            self._warm = MemoryTier(Tier.WARM, warm_arena, config.eviction)
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
            self._hot.close()
            with contextlib.suppress(NameError):
                warm_arena.close()
            raise
        self._precision: dict[str, PrecisionPolicy] = {}
        self._codec_policy = CodecPolicy(config.codecs)
        self._prefetcher: MarkovPrefetcher[BlockHash] = MarkovPrefetcher(config.prefetch)
        self._blocks: dict[BlockHash, _Block] = {}
        # Each owner's share of the references: owner -> block -> [refs, active refs].
        # One owner unless the session table is sharded (memkv.protocol.shards):
        # then every router shard holds its own sessions' references, and a
        # restarted shard resets only its own (:meth:`resync`).
        self._owner_refs: dict[str, dict[BlockHash, list[int]]] = {}
        self._hits: Counter[Tier] = Counter()
        self._counters: Counter[str] = Counter()
        self._closed = False
        self._check = config.debug_refcounts
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

    def close(self) -> None:
        """Flush the cold tier and release the arenas. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
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
        with self._lock:
            self.ensure_open()
            return release_idle_extents([self._hot.arena, self._warm.arena], min_bytes)

    def managed_hot_arena(self) -> Any:
        """The hot arena's managed allocation (unified memory), or None."""
        return getattr(self._hot.arena, "_managed", None)

    def stats(self) -> PoolStats:
        with self._lock:
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
            unique = sum(b.layout.block_nbytes(b.tokens) for b in self._blocks.values())
            c = self._counters
            return PoolStats(
                tiers=tiers,
                blocks=len(self._blocks),
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
        with self._lock:
            return not self._closed and any(self._headroom_short(t) for t in (self._hot,
                                                                              self._warm))

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
        with self._lock:
            self.ensure_open()
            now = self._clock()
            for tier in (self._hot, self._warm):
                while moved < max_blocks and self._headroom_short(tier):
                    if not self._evict_one(tier, now):
                        break  # all pinned (being read): the next call tries again
                    moved += 1
            self._counters["demotions_ahead"] += moved
            self._debug_check()
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
        with self._lock:
            self.ensure_open()
            tier = next(t for t in (self._hot, self._warm) if t.arena.owns(slot))
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
        with self._lock:
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
                elif not self._evict_one(tier, now):
                    for taken in slots:
                        tier.arena.free(taken)
                    return None
            return ReservedSlots(tier.tier, str(segment), tier.capacity_bytes, tuple(slots))

    def free_slots(self, slots: Sequence[Allocation]) -> None:
        """Give back reserved slots no put adopted (see :meth:`reserve_slots`)."""
        with self._lock:
            if self._closed:
                return  # the arenas went with the pool
            for slot in slots:
                tier = next(t for t in (self._hot, self._warm) if t.arena.owns(slot))
                tier.arena.free(slot)

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
        with self._lock:
            self.ensure_open()
            pending = [e for e in self._blocks.values() if e.refcount > 0 and not e.in_cold]
            batch = pending[:limit]
            if batch:
                self._ensure_cold_many(batch, offline=False, durable=True)
            return len(batch), len(pending) - len(batch)
