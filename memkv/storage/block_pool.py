"""BlockPool: one device's KV blocks across hot, warm and cold tiers.

The block store under every DeviceCacheActor, in the manner of vLLM's block
pool: it knows blocks, not sessions. Its owner (the router, or a
single-process :class:`~memkv.storage.store.TieredStore`) tells it which
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
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch

from memkv.errors import (
    BlockLostError,
    CapacityError,
    ClosedError,
    ConfigError,
    InvalidInputError,
    LayoutMismatchError,
    PrecisionOverflowError,
    UnknownBlockError,
)
from memkv.protocol.checksum import crc32
from memkv.protocol.enums import PRIORITY_RANK, Priority, Tier
from memkv.protocol.exactness import worse
from memkv.protocol.hashing import BlockHash
from memkv.protocol.messages import ChainUpdate, PlanEntry
from memkv.storage.arena import DeviceArena, SharedHostArena
from memkv.storage.codecs import CODECS, CodecPolicy, decode_frame, encode_stored
from memkv.storage.cold_writer import ColdWriter, WriterStats
from memkv.storage.config import StoreConfig
from memkv.storage.diagnostics import AccessStats, check_refcounts
from memkv.storage.layout import KVLayout
from memkv.storage.precision import (
    EncodedBlock,
    PrecisionPolicy,
    QuantizedBlock,
    convert,
    quantize_int8,
)
from memkv.storage.prefetch import MarkovPrefetcher
from memkv.storage.tiers import ColdBackend, ColdTier, MemoryTier, StoredBlock, stored_data

__all__ = [
    "BlockLocation",
    "BlockPool",
    "Holder",
    "FetchedBlock",
    "PoolStats",
    "PutOutcome",
    "TierStats",
]


@dataclass(slots=True)
class _Block:
    """Per-block bookkeeping (one per distinct BlockHash)."""

    key: BlockHash
    parent: BlockHash | None
    layout: KVLayout
    tokens: int
    priority: Priority
    last_access: float
    refcount: int = 0  # sessions whose chain holds the block
    active_refs: int = 0  # of those, sessions that are active
    pins: int = 0  # readers holding a zero-copy view
    tier: Tier | None = None  # memory tier of the copy; None = cold only
    in_cold: bool = False
    cold_codec: str | None = None
    rounds: int = 0  # turns (puts) that included the block after the one that created it
    turn_created: int = 0  # the turn of its session that produced it (0 = first round)
    prefetched: bool = False  # brought to hot by prefetch and not read since
    # For a partial tail: how often its session's tail had been rewritten when
    # it was written (partial tails are replaced every turn; see _ensure_cold).
    rewrites: int = 0
    # CRC32 of the block's bytes in the model dtype: the writer's own checksum
    # while the block is exact; None until computed (or after a lossy step).
    crc32: int | None = None
    # The worst lossy step the only copies left went through ("" = exact bytes):
    # int8, fp16 of an fp32 block, a lossy cold codec. Reads say so.
    lossy: str = ""
    # Some holder forbids lossy steps: none is taken from then on.
    exact_only: bool = False

    @property
    def exact(self) -> bool:
        return not self.lossy


class Holder(NamedTuple):
    """One session's hold on a pool's blocks, as its owner records it (see ``resync``)."""

    layout: KVLayout
    chain: Sequence[bytes]
    tokens: Sequence[int]
    active: bool
    priority: Priority
    exact_only: bool = False


@dataclass(frozen=True, slots=True)
class PutOutcome:
    """What applying one :class:`~memkv.protocol.messages.ChainUpdate` did."""

    new_blocks: int
    deduplicated_blocks: int
    released_blocks: int  # references dropped (e.g. a replaced partial tail)


class FetchedBlock(NamedTuple):
    """A block read from the store, and where it was found."""

    key: BlockHash
    block: torch.Tensor
    tier: Tier
    exact: bool = True  # False: the copy read went through a lossy step
    lossy: str = ""  # which one (memkv.protocol.exactness)


@dataclass(frozen=True, slots=True)
class BlockLocation:
    key: BlockHash
    tier: Tier
    tokens: int


@dataclass(frozen=True, slots=True)
class TierStats:
    tier: Tier
    capacity_bytes: int | None
    used_bytes: int
    blocks: int
    hits: int
    evictions: int
    fragmentation: float


@dataclass(frozen=True, slots=True)
class PoolStats:
    tiers: dict[Tier, TierStats]
    blocks: int
    unique_bytes: int  # each distinct block once, in the model dtype
    dedup_hits: int
    dedup_bytes_saved: int
    misses: int  # gets of keys in no tier
    promotions: int
    demotions: int
    prefetched: int
    prefetch_used: int
    precision_fallbacks: int  # demotions that kept the model dtype (value out of fp16 range)
    lossy_conversions: int = 0  # demotions whose remaining copy went through a lossy step
    cold_write_batches: int = 0  # backend calls of the cold writer (write-behind)
    cold_blocks_written: int = 0  # blocks it wrote in them

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: getattr(self, k) for k in self.__dataclass_fields__ if k != "tiers"
        }
        out["tiers"] = {
            t.value: {k: getattr(s, k) for k in s.__dataclass_fields__ if k != "tier"}
            for t, s in self.tiers.items()
        }
        return out


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
        self._lock = threading.RLock()
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
        self.access_stats = AccessStats()
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

    # ------------------------------------------------------------------ lifecycle

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

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def lock(self) -> threading.RLock:
        """The pool's lock: an owner takes it to make several calls one step."""
        return self._lock

    @property
    def cold(self) -> ColdBackend:
        """The cold tier (a single-process owner keeps its manifests there)."""
        return self._cold

    # ------------------------------------------------------------------ ownership

    def put(
        self,
        update: ChainUpdate,
        blocks: Sequence[torch.Tensor],
        *,
        checksums: Sequence[int] | None = None,
        durable: bool = False,
        owner: str = "",
    ) -> PutOutcome:
        """Apply one append: store its new blocks and count the references it moves.

        Args:
            update: what the append changes (from the session's owner).
            blocks: KV of ``update.chain[update.start_block:]``; those already
                stored are deduplicated, not written again.
            checksums: the writer's CRC32 of each block's bytes (verified by the
                caller), kept and served with the block; computed on first read
                when absent.
            durable: return only once every block of the chain has a cold copy
                forced to disk (the ``archive`` acknowledgement mode), written
                with the lossless online codec.
            owner: whose references these are (a router shard; "" for one owner).

        Raises:
            LayoutMismatchError: a block's shape/dtype disagrees with the layout
                or with the token count of its position.
            InvalidInputError: a wrong number of blocks or checksums, or a block
                before ``start_block`` that is not stored. Nothing is changed.
            CapacityError: no tier can take a new block (nothing is changed).
        """
        with self._lock:
            self.ensure_open()
            layout, counts, start = update.layout, update.tokens, update.start_block
            if len(blocks) != len(counts) - start:
                raise InvalidInputError(
                    f"{sum(counts)} tokens make {len(counts)} blocks; from block {start} "
                    f"expected {len(counts) - start} blocks, got {len(blocks)}"
                )
            if checksums is not None and len(checksums) != len(blocks):
                raise InvalidInputError(
                    f"{len(blocks)} blocks came with {len(checksums)} checksums"
                )
            for i, block in enumerate(blocks, start=start):
                n = layout.check_block(block)
                if n != counts[i]:
                    raise LayoutMismatchError(f"block {i} must hold {counts[i]} tokens, got {n}")
            chain = [BlockHash(k) for k in update.chain]
            for i in range(start):
                if chain[i] not in self._blocks:
                    raise InvalidInputError(
                        f"block {i} was not sent and is not stored; send blocks from index {i}"
                    )
            # Validation is over: from here on the pool changes.
            now = self._clock()
            created = self._admit_new_blocks(update, chain, blocks, now, checksums)
            held = set(update.hold)
            dedup = 0
            for key in dict.fromkeys(chain[start:]):
                if key in held and key not in created:
                    dedup += 1
                    self._counters["dedup_bytes_saved"] += layout.block_nbytes(
                        self._blocks[key].tokens
                    )
            for held_key in update.hold:
                entry = self._blocks[BlockHash(held_key)]
                self._hold(entry, update.priority, update.was_active, now, update.exact_only,
                           owner)
            for kept_key in update.kept:
                self._blocks[BlockHash(kept_key)].rounds += 1
            for dropped_key in update.drop:
                self._release(BlockHash(dropped_key), active=update.was_active, owner=owner)
            if counts and counts[-1] < layout.block_tokens:
                tail = self._blocks[chain[-1]]
                tail.rewrites = max(tail.rewrites, update.tail_rewrites)
            if not update.was_active:
                self._activate(chain, owner)
            if durable:
                entries = [self._blocks[k] for k in dict.fromkeys(chain)]
                self._ensure_cold_many(entries, offline=False, durable=True)
            self._counters["dedup_hits"] += dedup
            self._debug_check()
            return PutOutcome(len(created), dedup, len(update.drop))

    def adopt(
        self,
        layout: KVLayout,
        chain: Sequence[bytes],
        tokens: Sequence[int],
        priority: Priority,
        exact_only: bool = False,
        owner: str = "",
        keep_prefix: bool = False,
    ) -> int:
        """Hold, for an inactive holder, a chain whose blocks are all in the cold tier.

        Used when an owner registers an archived session again: after a
        restart (from its manifest), or when the router moves a dead device's
        archived sessions to a live one.

        Args:
            keep_prefix: where some block is in no tier, hold the blocks before
                the first such one (a partial session beats a lost one: the
                engine recomputes the rest).

        Returns:
            How many leading blocks of the chain are held (all of them unless
            ``keep_prefix``).

        Raises:
            BlockLostError: some block is in no tier (without ``keep_prefix``),
                or the first one is (nothing is held).
        """
        with self._lock:
            self.ensure_open()
            keys = [BlockHash(bytes(k)) for k in chain]
            missing = set(self._cold.missing([k for k in keys if k not in self._blocks]))
            if missing:
                first = next(i for i, k in enumerate(keys) if k in missing)
                if not keep_prefix or first == 0:
                    raise BlockLostError(
                        f"{len(missing)} of {len(keys)} blocks are in no tier "
                        f"(first missing: block {first}, {bytes(keys[first]).hex()})"
                    )
                keys, tokens = keys[:first], list(tokens)[:first]
            self._hold_chain(
                layout, keys, tokens, priority, False, exact_only, self._clock(), owner
            )
            self._debug_check()
            return len(keys)

    def resync(self, holders: Sequence[Holder], owner: str = "") -> list[int]:
        """Set ``owner``'s references from its table, after the owner restarted.

        The owner may have died between this pool applying an append and the
        owner recording it; its table is the truth. Other owners' references
        (the other shards of a sharded table) stay as they are. Blocks no
        holder of any owner lists and no reader pins are freed; a holder's
        block that is only in the cold tier gets a cold-only entry (as
        :meth:`adopt` does).

        Args:
            holders: every session the owner places on this pool.
            owner: whose table it is ("" for one owner).

        Returns:
            Indices of holders with a block in no tier (those hold nothing).
        """
        with self._lock:
            self.ensure_open()
            wanted = [[BlockHash(bytes(k)) for k in h.chain] for h in holders]
            unknown = list(
                dict.fromkeys(k for chain in wanted for k in chain if k not in self._blocks)
            )
            missing = set(self._cold.missing(unknown)) if unknown else set()
            # The new references are taken before the old ones go, so a block
            # both hold is never freed in between.
            previous = self._owner_refs.pop(owner, {})
            now = self._clock()
            lost: list[int] = []
            try:
                for i, (chain, holder) in enumerate(zip(wanted, holders, strict=True)):
                    if any(k in missing for k in chain):
                        lost.append(i)
                        continue
                    self._hold_chain(
                        holder.layout,
                        chain,
                        holder.tokens,
                        holder.priority,
                        holder.active,
                        holder.exact_only,
                        now,
                        owner,
                    )
            except BaseException:
                self._undo_holds(owner, previous, created=unknown)
                raise
            for key, (refs, active) in previous.items():
                entry = self._blocks[key]
                entry.refcount -= refs
                entry.active_refs -= active
            for key in [k for k, e in self._blocks.items() if e.refcount == 0 and e.pins == 0]:
                self._free(self._blocks[key])
            self._debug_check()
            return lost

    def release(self, keys: Sequence[bytes], *, active: bool, owner: str = "") -> int:
        """Drop one reference to each key (a holder went); blocks left unheld are freed.

        Returns how many blocks were freed (unpinned ones at once, pinned ones
        when their last reader lets go).
        """
        with self._lock:
            self.ensure_open()
            before = len(self._blocks)
            for key in dict.fromkeys(BlockHash(bytes(k)) for k in keys):
                self._release(key, active=active, owner=owner)
            self._debug_check()
            return before - len(self._blocks)

    def deactivate(
        self,
        keys: Sequence[bytes],
        *,
        offline: bool = False,
        was_active: bool = True,
        owner: str = "",
    ) -> bool:
        """An active holder of ``keys`` went idle (a session suspended).

        Writes the blocks to the cold tier in one batch (one archive call, not
        one per block), then frees the memory copies no active holder needs.

        Args:
            offline: the user went away for long: unshared blocks may use the
                lossy cold codec (Delta+RL).
            was_active: False for a holder that was idle already (suspended
                again): no active reference is dropped, the memory copies
                brought back meanwhile (prefetch) go again.

        Returns:
            Whether some of the blocks are still in memory (held by an active
            holder, or pinned by a reader).
        """
        with self._lock:
            self.ensure_open()
            unique = list(dict.fromkeys(BlockHash(bytes(k)) for k in keys))
            if was_active:
                for key in unique:
                    self._blocks[key].active_refs -= 1
                    self._count(owner, key, 0, -1)
            self._ensure_cold_many(
                [self._blocks[k] for k in unique if not self._blocks[k].in_cold], offline=offline
            )
            for key in unique:
                entry = self._blocks[key]
                if entry.active_refs == 0 and entry.pins == 0 and entry.tier is not None:
                    self._tier(entry.tier).remove(key)
                    entry.tier = None
                    self._counters["demotions"] += 1
                    # The cold copy is the one left: a lossy codec makes reads inexact.
                    self._note_demoted(entry, lossy=_codec_step(entry.cold_codec))
            self._debug_check()
            return any(self._blocks[k].tier is not None for k in unique)

    def activate(self, keys: Sequence[bytes], owner: str = "") -> None:
        """An idle holder of ``keys`` is active again (a session resumed)."""
        with self._lock:
            self.ensure_open()
            self._activate([BlockHash(bytes(k)) for k in keys], owner)
            self._debug_check()

    def set_priority(self, keys: Sequence[bytes], priority: Priority) -> None:
        """Move blocks to ``priority``'s eviction queue (a session changed its class)."""
        with self._lock:
            now = self._clock()
            for key in dict.fromkeys(BlockHash(bytes(k)) for k in keys):
                self._raise_priority(self._blocks[key], priority, now, force=True)

    def hot_locations(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """``(byte offset, bytes)`` in the hot arena of each of ``keys`` held there raw
        (blocks elsewhere, or kept as int8, are left out): for attaching a session's
        blocks to its CUDA stream (memkv.gpu_kernels.unified)."""
        out: list[tuple[int, int]] = []
        with self._lock:
            for key in dict.fromkeys(BlockHash(bytes(k)) for k in keys):
                entry = self._blocks.get(key)
                if entry is None or entry.tier is not Tier.HOT:
                    continue
                where = self._hot.location(key)
                if where is not None:
                    out.append((where[0], entry.layout.block_nbytes(entry.tokens)))
        return out

    def managed_hot_arena(self) -> Any:
        """The hot arena's managed allocation (unified memory), or None."""
        return getattr(self._hot.arena, "_managed", None)

    def stored_prefix(self, keys: Sequence[BlockHash]) -> tuple[int, list[BlockHash]]:
        """Tokens and keys of the leading run of ``keys`` that is stored."""
        with self._lock:
            matched: list[BlockHash] = []
            tokens = 0
            for key in keys:
                entry = self._blocks.get(key)
                if entry is None:
                    break
                matched.append(key)
                tokens += entry.tokens
            return tokens, matched

    def tokens_of(self, key: BlockHash) -> int:
        """Tokens of a stored block.

        Raises:
            UnknownBlockError: not stored.
        """
        with self._lock:
            entry = self._blocks.get(key)
            if entry is None:
                raise UnknownBlockError(f"no block {key.hex()} in this store")
            return entry.tokens

    def cold_orphans(self) -> list[bytes]:
        """Keys in the cold tier that no block entry knows (left by a crash)."""
        with self._lock:
            return [k for k in self._cold.block_keys() if BlockHash(k) not in self._blocks]

    # ------------------------------------------------------------------ writes

    def _admit_new_blocks(
        self,
        update: ChainUpdate,
        chain: list[BlockHash],
        blocks: Sequence[torch.Tensor],
        now: float,
        checksums: Sequence[int] | None = None,
    ) -> set[BlockHash]:
        """Store the blocks of ``chain`` not stored yet; all or nothing."""
        created: list[BlockHash] = []
        start_block = update.start_block
        try:
            for i in range(start_block, len(chain)):
                key = chain[i]
                if key in self._blocks:
                    continue
                entry = _Block(
                    key=key,
                    parent=chain[i - 1] if i else None,
                    layout=update.layout,
                    tokens=update.tokens[i],
                    priority=update.priority,
                    last_access=now,
                    crc32=None if checksums is None else checksums[i - start_block],
                    turn_created=update.turn,
                )
                self._blocks[key] = entry
                created.append(key)
                self._admit(entry, blocks[i - start_block], now)
        except BaseException:
            # e.g. CapacityError from a full cold tier: undo this put's new blocks
            # so nothing half-stored stays behind (older blocks were not touched).
            for key in reversed(created):
                entry = self._blocks[key]
                if entry.tier is not None or entry.in_cold:
                    self._free(entry)
                else:
                    del self._blocks[key]
            raise
        return set(created)

    # ------------------------------------------------------------------ reads

    def contains(self, key: BlockHash) -> bool:
        with self._lock:
            return key in self._blocks

    def locate(self, key: BlockHash) -> Tier | None:
        """Fastest tier holding ``key``, or None when it is not stored."""
        with self._lock:
            entry = self._blocks.get(key)
            if entry is None:
                return None
            return entry.tier if entry.tier is not None else Tier.COLD

    def get(self, key: BlockHash, *, stream: str | None = None) -> torch.Tensor:
        """A copy of block ``key`` in its layout's dtype, promoted to the hot tier.

        Args:
            key: the block hash.
            stream: the reader (session id) for the prefetcher's transition model.

        Raises:
            UnknownBlockError: not stored.
            CorruptDataError: the only copy failed its checksum (never served).
        """
        return self.fetch(key, stream=stream).block

    def fetch(self, key: BlockHash, *, stream: str | None = None) -> FetchedBlock:
        """Like :meth:`get`, and also the tier the block was found in."""
        with self._lock:
            entry, found, now = self._count_read(key)
            block = self._materialize(entry)
            if found is Tier.HOT:
                self._hot.access(key, now)
            elif entry.pins == 0 and self._promote(entry, block, now):
                self._note_materialized(entry, block)
            self._prefetcher.observe(key, stream)
            return FetchedBlock(key, block, found, entry.exact, entry.lossy)

    @contextlib.contextmanager
    def pinned_reads(
        self, keys: Sequence[BlockHash], *, stream: str | None = None
    ) -> Iterator[list[FetchedBlock]]:
        """Blocks read as :meth:`fetch` reads them, pinned while the ``with`` block runs.

        Each block is a zero-copy view of its arena where it sits there raw in
        the model dtype (the usual case after promotion), else a decoded copy;
        the views must not be used after the block ends.
        """
        taken: list[_Block] = []
        out: list[FetchedBlock] = []
        try:
            with self._lock:
                for key in keys:
                    found = self._access(key, stream)
                    entry = self._blocks[key]
                    self._pin(entry)
                    taken.append(entry)
                    out.append(
                        FetchedBlock(key, self._view(entry), found, entry.exact, entry.lossy)
                    )
            yield out
        finally:
            with self._lock:
                for entry in taken:
                    self._unpin(entry)

    def pin_blocks(self, keys: Sequence[BlockHash]) -> list[BlockHash]:
        """Pin stored blocks where they are (a read that must be able to send them all).

        A pinned block outlives its holders: a session deleted meanwhile
        frees it (memory and cold copy) when the last pin goes.

        Returns:
            The keys pinned, once each (hand them back to :meth:`unpin_blocks`).

        Raises:
            UnknownBlockError: a key is not stored here (nothing is pinned).
        """
        with self._lock:
            self.ensure_open()
            unique = list(dict.fromkeys(BlockHash(bytes(k)) for k in keys))
            missing = [k for k in unique if k not in self._blocks]
            if missing:
                raise UnknownBlockError(
                    f"{len(missing)} of {len(unique)} blocks are not stored here "
                    f"(first {bytes(missing[0]).hex()})"
                )
            for key in unique:
                self._pin(self._blocks[key])
            return unique

    def held(self, keys: Sequence[bytes]) -> list[bytes]:
        """Those of ``keys`` this pool still keeps (held, or pinned by a reader)."""
        with self._lock:
            return [bytes(k) for k in keys if BlockHash(bytes(k)) in self._blocks]

    def plan_reads(
        self,
        keys: Sequence[BlockHash],
        *,
        stream: str | None = None,
        ahead: Sequence[BlockHash] = (),
    ) -> list[PlanEntry | None]:
        """Pin blocks where a reader can map them, and say where (the same-node path).

        Each block is promoted to the hot tier as :meth:`fetch` would; a block
        whose memory copy is raw in the model dtype in a shared-memory arena is
        pinned and planned. A block that is not (int8 in the warm tier with the
        hot tier full of pinned blocks, or a device arena on a GPU) answers None:
        the caller serves it another way. All or nothing on errors: nothing
        stays pinned when this raises.

        ``ahead`` are blocks a reader will probably want next (read-ahead):
        they are planned, after ``keys``, only where they sit in memory already,
        never promoted or counted as read, so read-ahead never makes a lazy
        resume eager. Their entries follow those of ``keys`` (None: not planned).

        Raises:
            UnknownBlockError: a key is not stored.
        """
        planned: list[PlanEntry | None] = []
        pinned: list[_Block] = []
        with self._lock:
            try:
                for key in keys:
                    found = self._access(key, stream)
                    entry = self._blocks[key]
                    plan = self._plan(entry, found)
                    if plan is not None:
                        self._pin(entry)
                        pinned.append(entry)
                    planned.append(plan)
                for key in ahead:
                    held = self._blocks.get(key)
                    plan = None
                    if held is not None and held.tier is not None:
                        plan = self._plan(held, held.tier)
                    if held is not None and plan is not None:
                        self._pin(held)
                        pinned.append(held)
                    planned.append(plan)
            except BaseException:
                for entry in pinned:
                    self._unpin(entry)
                raise
        return planned

    def unpin_blocks(self, keys: Sequence[BlockHash]) -> None:
        """Release the pins :meth:`plan_reads` took (once per planned key)."""
        with self._lock:
            for key in keys:
                entry = self._blocks.get(key)
                if entry is None or entry.pins == 0:
                    raise_invariant(f"unpin of block {key.hex()} that holds no pin")
                    return
                self._unpin(entry)

    def _access(self, key: BlockHash, stream: str | None) -> Tier:
        """Count a read of ``key`` and bring it to the hot tier where room can be made."""
        entry, found, now = self._count_read(key)
        if found is Tier.HOT:
            self._hot.access(key, now)
        elif entry.pins == 0:
            block = self._materialize(entry)
            if self._promote(entry, block, now):
                self._note_materialized(entry, block)
        self._prefetcher.observe(key, stream)
        return found

    def _count_read(self, key: BlockHash) -> tuple[_Block, Tier, float]:
        """Account a read of ``key`` (hits, access statistics, prefetch use).

        Raises:
            UnknownBlockError: not stored (counted as a miss).
        """
        self.ensure_open()
        entry = self._blocks.get(key)
        if entry is None:
            self._counters["misses"] += 1
            self.access_stats.record(key, None, self._clock())
            raise UnknownBlockError(f"no block {key.hex()} in this store")
        now = self._clock()
        found = entry.tier if entry.tier is not None else Tier.COLD
        self._hits[found] += 1
        self.access_stats.record(key, found.value, now)
        if entry.prefetched:
            entry.prefetched = False
            self._counters["prefetch_used"] += 1
        entry.last_access = now
        return entry, found, now

    def _note_demoted(self, entry: _Block, *, lossy: str | None) -> None:
        """The copy that remains went through ``lossy`` (a step's name; None: none):
        reads are no longer exact, and say which step."""
        if lossy:
            entry.lossy = worse(entry.lossy, lossy)
            entry.crc32 = None
            self._counters["lossy_conversions"] += 1

    def _note_materialized(self, entry: _Block, block: torch.Tensor) -> None:
        """The hot copy was rebuilt from a lossy copy: its checksum is of the new bytes."""
        if not entry.exact:
            entry.crc32 = None

    def _plan(self, entry: _Block, found: Tier) -> PlanEntry | None:
        if entry.tier is None:
            return None
        tier = self._tier(entry.tier)
        segment = getattr(tier.arena, "name", None)
        where = tier.location(entry.key)
        if segment is None or where is None:
            return None
        offset, shape, dtype = where
        if dtype != entry.layout.torch_dtype:
            return None
        nbytes = entry.layout.block_nbytes(entry.tokens)
        if entry.crc32 is None:
            stored = tier.load(entry.key)
            if not isinstance(stored, torch.Tensor):
                return None
            entry.crc32 = _crc32(stored)
        return PlanEntry(
            bytes(entry.key),
            found,  # a Tier, which is a str
            str(segment),
            tier.capacity_bytes,
            offset,
            nbytes,
            shape,
            entry.layout.dtype,
            entry.crc32,
            entry.exact,
            entry.lossy,
        )

    def prefetch(self, keys: Sequence[BlockHash]) -> int:
        """Bring blocks into free hot-tier space (never evicting for it). Returns how many."""
        moved = 0
        with self._lock:
            if self._closed:
                return 0
            now = self._clock()
            for key in keys:
                entry = self._blocks.get(key)
                if entry is None or entry.tier is Tier.HOT or entry.pins:
                    continue
                need = entry.layout.block_nbytes()
                if self._hot.capacity_bytes - self._hot.used_bytes < need:
                    break
                block = self._materialize(entry)
                if self._promote(entry, block, now, evict=False):
                    self._note_materialized(entry, block)
                    entry.prefetched = True
                    moved += 1
            self._counters["prefetched"] += moved
        return moved

    def prefetch_predicted(self, key: BlockHash) -> int:
        """Prefetch what the Markov model expects to follow ``key`` (when ``prefetch.markov``)."""
        if not self.config.prefetch.markov:
            return 0
        with self._lock:
            predicted = [k for k, _ in self._prefetcher.predict(key)]
        return self.prefetch(predicted)

    # ------------------------------------------------------------------ stats

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

    # ------------------------------------------------------------------ diagnostics hooks

    def refcounts(self) -> dict[BlockHash, tuple[int, int]]:
        """(refcount, pins) per block, for an owner's invariant and leak checks."""
        with self._lock:
            return {k: (b.refcount, b.pins) for k, b in self._blocks.items()}

    def check_invariants(self, chains: dict[str, list[BlockHash]] | None = None) -> None:
        """Raise :class:`~memkv.errors.InvariantViolationError` if the bookkeeping is broken.

        Args:
            chains: the owner's chain per session: refcounts must match them.
                Without them only what the pool knows alone is checked (tiers,
                pins, no unheld block left behind).
        """
        with self._lock:
            blocks = self.refcounts()
            if chains is not None:
                check_refcounts(blocks, chains)
            for key, (refcount, pins) in blocks.items():
                if pins < 0 or refcount < 0 or (refcount == 0 and pins == 0):
                    raise_invariant(f"block {key.hex()} has refcount {refcount} and {pins} pins")
            for key, entry in self._blocks.items():
                if entry.active_refs < 0 or entry.active_refs > entry.refcount:
                    raise_invariant(
                        f"block {key.hex()} has {entry.active_refs} active of "
                        f"{entry.refcount} references"
                    )
                present = entry.tier is not None and key in self._tier(entry.tier)
                if entry.tier is not None and not present:
                    raise_invariant(f"block {key.hex()} thinks it is {entry.tier} but is not")
                if entry.tier is None and not entry.in_cold:
                    raise_invariant(f"block {key.hex()} is in no tier")
            shared: dict[BlockHash, list[int]] = {}
            for shares in self._owner_refs.values():
                for key, (refs, active) in shares.items():
                    total = shared.setdefault(key, [0, 0])
                    total[0] += refs
                    total[1] += active
            for key, entry in self._blocks.items():
                if shared.pop(key, [0, 0]) != [entry.refcount, entry.active_refs]:
                    raise_invariant(
                        f"block {key.hex()}: the owners' shares do not add up to its "
                        f"{entry.refcount} references ({entry.active_refs} active)"
                    )
            if shared:
                raise_invariant(f"{len(shared)} freed blocks still have owners' references")

    # ------------------------------------------------------------------ internals

    def _debug_check(self) -> None:
        if self._check:
            self.check_invariants()

    def ensure_open(self) -> None:
        """Raise ClosedError once the pool is closed."""
        if self._closed:
            raise ClosedError("the block pool is closed")

    def _tier(self, tier: Tier) -> MemoryTier:
        return self._hot if tier is Tier.HOT else self._warm

    def _precision_for(self, layout: KVLayout) -> PrecisionPolicy:
        policy = self._precision.get(layout.dtype)
        if policy is None:
            policy = PrecisionPolicy(self.config.precision, layout.dtype)
            self._precision[layout.dtype] = policy
        return policy

    def _hold_chain(
        self,
        layout: KVLayout,
        chain: Sequence[BlockHash],
        tokens: Sequence[int],
        priority: Priority,
        active: bool,
        exact_only: bool,
        now: float,
        owner: str = "",
    ) -> None:
        """One holder's reference to each block of ``chain``; blocks not in memory get
        cold-only entries (the caller made sure the cold tier has them)."""
        seen: set[BlockHash] = set()
        for i, key in enumerate(chain):
            if key in seen:
                continue
            seen.add(key)
            entry = self._blocks.get(key)
            if entry is None:
                entry = _Block(
                    key,
                    chain[i - 1] if i else None,
                    layout,
                    tokens[i],
                    priority,
                    last_access=now,
                    in_cold=True,
                )
                self._blocks[key] = entry
            self._hold(entry, priority, active, now, exact_only, owner)

    def _hold(
        self,
        entry: _Block,
        priority: Priority,
        active: bool,
        now: float,
        exact_only: bool = False,
        owner: str = "",
    ) -> None:
        entry.refcount += 1
        entry.exact_only = entry.exact_only or exact_only
        if active:
            entry.active_refs += 1
        self._count(owner, entry.key, 1, int(active))
        self._raise_priority(entry, priority, now)

    def _activate(self, keys: Sequence[BlockHash], owner: str = "") -> None:
        for key in dict.fromkeys(keys):
            self._blocks[key].active_refs += 1
            self._count(owner, key, 0, 1)

    def _undo_holds(
        self, owner: str, previous: dict[BlockHash, list[int]], created: Sequence[BlockHash]
    ) -> None:
        """Take back the holds a failed :meth:`resync` made; ``owner``'s old ones stand."""
        for key, (refs, active) in self._owner_refs.pop(owner, {}).items():
            entry = self._blocks[key]
            entry.refcount -= refs
            entry.active_refs -= active
        self._owner_refs[owner] = previous
        for key in created:  # cold-only entries it made: the cold copy stays
            made = self._blocks.get(key)
            if made is not None and made.refcount == 0 and made.pins == 0:
                del self._blocks[key]

    def _count(self, owner: str, key: BlockHash, refs: int, active: int) -> None:
        """Move ``owner``'s share of ``key``'s references (kept beside the totals)."""
        shares = self._owner_refs.setdefault(owner, {})
        share = shares.setdefault(key, [0, 0])
        share[0] += refs
        share[1] += active
        if share == [0, 0]:
            del shares[key]

    def _raise_priority(
        self, entry: _Block, priority: Priority, now: float, force: bool = False
    ) -> None:
        # A shared block belongs to the highest class of the sessions holding it.
        if not force and PRIORITY_RANK[priority] <= PRIORITY_RANK[entry.priority]:
            return
        entry.priority = priority
        if entry.tier is not None and entry.pins == 0:
            self._tier(entry.tier).reclassify(entry.key, priority, now)

    def _release(self, key: BlockHash, *, active: bool, owner: str = "") -> None:
        entry = self._blocks[key]
        entry.refcount -= 1
        if active:
            entry.active_refs -= 1
        self._count(owner, key, -1, -int(active))
        if entry.refcount == 0 and entry.pins == 0:
            self._free(entry)

    def _free(self, entry: _Block) -> None:
        if entry.tier is not None:
            self._tier(entry.tier).remove(entry.key)
        if entry.in_cold:
            self._cold.remove(entry.key)
        del self._blocks[entry.key]
        # No references are left, but an owner's active count may be: a release
        # that said "active" for a holder the pool had as idle (its suspend failed
        # after the pool applied it). The entry took that miscount with it; its
        # shares go too, or a block stored again under the key would inherit it.
        for shares in self._owner_refs.values():
            shares.pop(entry.key, None)

    def _pin(self, entry: _Block) -> None:
        entry.pins += 1
        if entry.pins == 1 and entry.tier is not None:
            self._tier(entry.tier).pin(entry.key)

    def _unpin(self, entry: _Block) -> None:
        entry.pins -= 1
        if entry.pins == 0:
            if entry.tier is not None:
                self._tier(entry.tier).unpin(entry.key)
            if entry.refcount == 0:
                self._free(entry)

    def _view(self, entry: _Block) -> torch.Tensor:
        if entry.tier is None:
            # Not in memory (no room even after eviction): a decoded copy.
            return self._materialize(entry)
        stored = self._tier(entry.tier).load(entry.key)
        if not isinstance(stored, torch.Tensor) or stored.dtype != entry.layout.torch_dtype:
            return self._materialize(entry)
        return stored

    def _load_stored(self, entry: _Block) -> StoredBlock:
        if entry.tier is not None:
            return self._tier(entry.tier).load(entry.key)
        return self._cold.load(entry.key)

    def _materialize(self, entry: _Block) -> torch.Tensor:
        """An owned copy of the block in its layout's dtype, on the CPU."""
        stored = self._load_stored(entry)
        dtype = entry.layout.torch_dtype
        if isinstance(stored, EncodedBlock):
            decoded = decode_frame(stored.frame.numpy().data)
            return decoded if decoded.dtype == dtype else decoded.to(dtype)
        if isinstance(stored, QuantizedBlock):
            from memkv.storage.precision import dequantize_int8

            return dequantize_int8(stored, dtype).cpu()
        if stored.dtype == dtype:
            return stored.to("cpu", copy=True)
        return stored.to(device="cpu", dtype=dtype)

    def _admit(self, entry: _Block, block: torch.Tensor, now: float) -> None:
        """Place a new block: hot if room can be made, else warm, else cold."""
        if self._put_memory(self._hot, entry, block, now):
            entry.tier = Tier.HOT
            return
        warm = self._to_warm_precision(entry, block, now)
        if self._put_memory(self._warm, entry, warm, now):
            entry.tier = Tier.WARM
            self._note_demoted(entry, lossy=_precision_step(warm, block))
            return
        self._ensure_cold(entry, block)
        entry.tier = None
        self._note_demoted(entry, lossy=_codec_step(entry.cold_codec))

    def _put_memory(
        self, tier: MemoryTier, entry: _Block, block: StoredBlock, now: float, evict: bool = True
    ) -> bool:
        # A partial block reserves a full block's slot (see Arena.view); a frame
        # is as long as its codes came out.
        if isinstance(block, EncodedBlock):
            reserve = block.nbytes
        else:
            reserve = entry.layout.block_nbytes(itemsize=stored_data(block).element_size())
        if reserve > tier.arena.max_alloc_bytes:
            return False  # larger than any extent the tier has: it lives one tier down
        while True:
            if tier.put(
                entry.key,
                block,
                parent=entry.parent,
                priority=entry.priority,
                now=now,
                reserve_bytes=reserve,
            ):
                return True
            if not evict or not self._evict_one(tier, now):
                return False

    def _evict_one(self, tier: MemoryTier, now: float) -> bool:
        """Move the tier's victim one tier down. False when nothing can be evicted."""
        victim = tier.pop_victim(now)
        if victim is None:
            return False
        key = BlockHash(cast(bytes, victim))
        entry = self._blocks[key]
        stored = tier.load(key)
        try:
            if tier is self._hot:
                warm = self._to_warm_precision(entry, stored, now)
                if self._put_memory(self._warm, entry, warm, now):
                    entry.tier = Tier.WARM
                    self._note_demoted(entry, lossy=_precision_step(warm, stored))
                else:
                    self._ensure_cold(entry, stored)
                    entry.tier = None
            else:
                self._ensure_cold(entry, stored)
                entry.tier = None
            if entry.tier is None:
                self._note_demoted(entry, lossy=_codec_step(entry.cold_codec))
        except CapacityError:
            tier.restore(key, now)
            raise
        tier.discard(key)
        self._counters["demotions"] += 1
        return True

    def _to_warm_precision(self, entry: _Block, block: StoredBlock, now: float) -> StoredBlock:
        if not isinstance(block, torch.Tensor) or entry.exact_only:
            return block  # already int8 or a frame (nothing more to lose), or no lossy step
        choice = self._precision_for(entry.layout).choose(
            turn=entry.turn_created,
            refcount=entry.refcount,
            idle_seconds=max(0.0, now - entry.last_access),
        )
        try:
            if choice == "int8":
                return quantize_int8(block)
            if choice == "compact":
                codec = self.config.codecs.cold_lossy_codec
                frame = encode_stored(self.config.codecs, codec, block)
                return EncodedBlock(torch.frombuffer(bytearray(frame), dtype=torch.uint8),
                                    block.dtype, codec)
            if block.dtype == _TORCH_DTYPES[choice]:
                return block
            return convert(block, choice)
        except PrecisionOverflowError:
            # Values outside fp16's range: keep the model dtype rather than corrupt them.
            self._counters["precision_fallbacks"] += 1
            return block

    def _ensure_cold(self, entry: _Block, stored: StoredBlock, offline: bool = False) -> None:
        if entry.in_cold:
            return
        codec = self._cold_codec(entry, offline, stored)
        self._cold.put(entry.key, stored, fingerprint=entry.layout.fingerprint, codec=codec)
        self._mark_cold(entry, stored, codec)

    def _ensure_cold_many(
        self, entries: Sequence[_Block], *, offline: bool, durable: bool = False
    ) -> None:
        """Cold copies of ``entries`` in one batch of the cold backend.

        ``durable``: on disk (fsynced) before returning, those already there too.
        """
        items = []
        for entry in entries:
            if entry.in_cold:
                continue
            stored = self._load_stored(entry)
            items.append((entry, stored, self._cold_codec(entry, offline, stored)))
        if not items:
            if durable:
                self._cold.sync()  # earlier cold copies may not be forced to disk yet
            return
        self._cold.put_many(
            [(e.key, stored, e.layout.fingerprint, codec) for e, stored, codec in items],
            durable=durable,
        )
        for entry, stored, codec in items:
            self._mark_cold(entry, stored, codec)

    def _cold_codec(
        self, entry: _Block, offline: bool, stored: StoredBlock | None = None
    ) -> str:
        # Partial tails are rewritten every turn; the policy stores often
        # rewritten ones uncompressed (compression would be wasted on them).
        codec = self._codec_policy.choose(
            "cold",
            update_count=entry.rewrites,
            offline=offline and entry.refcount <= 1 and not entry.exact_only,
            turns_old=entry.rounds,
        )
        if (
            _codec_step(codec) is not None
            and isinstance(stored, torch.Tensor)
            and not bool(torch.isfinite(stored).all())
        ):
            # NaN or inf have no lossy code: such a block stays exact (stored as
            # sent; sessions that want them refused say so at create).
            self._counters["precision_fallbacks"] += 1
            return self._cold_codec(entry, offline=False)
        return codec

    @staticmethod
    def _mark_cold(entry: _Block, stored: StoredBlock, codec: str) -> None:
        entry.in_cold = True
        # An int8 block goes down as its codes and scales (the int8 codec), never
        # dequantised first: its cold frame is no larger than its warm copy.
        if isinstance(stored, QuantizedBlock):
            entry.cold_codec = "int8"
        elif isinstance(stored, EncodedBlock):
            entry.cold_codec = stored.codec  # its frame goes down as it is
        else:
            entry.cold_codec = codec

    def _promote(self, entry: _Block, block: torch.Tensor, now: float, evict: bool = True) -> bool:
        """Move a block to the hot tier (``block`` is its materialised copy)."""
        source = entry.tier
        if source is Tier.HOT:
            return True
        # Pin the source copy so the evictions we may trigger cannot pick it.
        if source is not None:
            self._tier(source).pin(entry.key)
        try:
            placed = self._put_memory(self._hot, entry, block, now, evict=evict)
        finally:
            if source is not None:
                self._tier(source).unpin(entry.key)
        if not placed:
            return False
        if source is not None:
            self._tier(source).remove(entry.key)
        entry.tier = Tier.HOT
        self._counters["promotions"] += 1
        return True


_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _crc32(block: torch.Tensor) -> int:
    """CRC32 of a contiguous CPU tensor's bytes (no copy)."""
    raw = block.view(torch.int16) if block.dtype is torch.bfloat16 else block
    return crc32(raw.numpy().data.cast("B"))


def _precision_step(converted: StoredBlock, original: StoredBlock) -> str | None:
    """The lossy step a warm-tier conversion took (None: the block was kept as it was)."""
    if converted is original:
        return None
    if isinstance(converted, QuantizedBlock):
        return "int8"
    if isinstance(converted, EncodedBlock):
        return "delta_rl"
    return "float16"


def _codec_step(codec: str | None) -> str | None:
    """The lossy step a cold codec is (None for a lossless one; int8 frames carry
    blocks that were int8 already)."""
    if codec is None or CODECS[codec].lossless or codec == "int8":
        return None
    return "delta_rl"


def hot_segment_name(warm_name: str | None) -> str | None:
    """The shared-memory name of a CPU hot arena beside the warm pool ``warm_name``."""
    return None if warm_name is None else f"{warm_name}-hot"


def raise_invariant(message: str) -> None:
    from memkv.errors import InvariantViolationError

    raise InvariantViolationError(message)


def _whole_units(capacity: int, unit: int, tier: str) -> int:
    # Round down: a tier never takes more memory than it was given.
    if capacity < unit:
        raise ConfigError(
            f"{tier}_capacity_bytes ({capacity}) must be at least one allocator unit ({unit})"
        )
    return capacity // unit * unit
