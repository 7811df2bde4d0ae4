"""Reads: a block's bytes (promoted back to the hot tier), pins of blocks being read
in place, read plans for readers on the node, and prefetch."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch

from memkv.errors import MemkvError, UnknownBlockError
from memkv.protocol.enums import Tier
from memkv.protocol.hashing import BlockHash
from memkv.protocol.messages import PlanEntry
from memkv.storage.block_table import BlockTable, PoolGuard
from memkv.storage.config import StoreConfig
from memkv.storage.pool_core import FetchedBlock, _Block, _crc32, raise_invariant
from memkv.storage.pool_ladder import TierLadder
from memkv.storage.prefetch import MarkovPrefetcher


class Reads:
    """Reading blocks, pinned or promoted, and prefetching them.

    Args:
        config: the pool's settings (whether the Markov prefetcher predicts).
        guard: the pool's lock and open state.
        table: the block table blocks are looked up in.
        ladder: the tiers blocks are read from and promoted through.
        clock: seconds, monotonic.
        counters: the pool's event counters (misses, prefetches).
        hits: reads by the tier they found their block in.
        prefetcher: the Markov model of which block follows which.
    """

    def __init__(self, config: StoreConfig, guard: PoolGuard, table: BlockTable,
                 ladder: TierLadder, clock: Callable[[], float], counters: Counter[str],
                 hits: Counter[Tier], prefetcher: MarkovPrefetcher[BlockHash]) -> None:
        self.config = config
        self.guard = guard
        self.table = table
        self.ladder = ladder
        self.clock = clock
        self.counters = counters
        self.hits = hits
        self.prefetcher = prefetcher

    def contains(self, key: BlockHash) -> bool:
        with self.guard.lock:
            return key in self.table

    def locate(self, key: BlockHash) -> Tier | None:
        """Fastest tier holding ``key``, or None when it is not stored."""
        with self.guard.lock:
            entry = self.table.get(key)
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
        return self.fetch_many([key], stream=stream)[0]

    def fetch_many(self, keys: Sequence[BlockHash], *, stream: str | None = None
                   ) -> list[FetchedBlock]:
        """:meth:`fetch` of each key; the cold ones read in one call, off the lock."""
        with self._reading_cold(keys):
            return [self._fetch_one(key, stream) for key in keys]

    @contextlib.contextmanager
    def _reading_cold(self, keys: Sequence[BlockHash]) -> Iterator[None]:
        """Hold the pool's lock with the cold copies of ``keys`` read ahead.

        Blocks whose only copy is cold are read from the cold tier in one call
        (one archive round trip for a batch, not one per block) and decoded
        before the lock is taken, so appends and other readers go on meanwhile.
        A block is content-addressed, so its bytes cannot change in between; one
        that went meanwhile (deleted, or promoted by another reader) is simply
        not used, and one the batch could not read is read under the lock as before.
        """
        with self.guard.lock:
            cold = [k for k in dict.fromkeys(keys)
                    if (e := self.table.get(k)) is not None and e.tier is None]
        ahead: dict[BlockHash, torch.Tensor] = {}
        if cold:
            try:
                ahead = dict(zip(cold, self.ladder.cold.load_many(cold), strict=True))
            except MemkvError:  # read them one by one under the lock: that one raises
                ahead = {}
        with self.guard.lock, self.ladder.reading_ahead(ahead):
            yield

    def _fetch_one(self, key: BlockHash, stream: str | None) -> FetchedBlock:
        entry, found, now = self._count_read(key)
        block = self.ladder.materialize(entry)
        if found is self.ladder.top.tier:
            self.ladder.top.access(key, now)
        elif entry.pins == 0 and self.ladder.promote(entry, block, now):
            self._note_materialized(entry, block)
        self.prefetcher.observe(key, stream)
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
            with self._reading_cold(keys):
                for key in keys:
                    found = self._access(key, stream)
                    entry = self.table[key]
                    self._pin(entry)
                    taken.append(entry)
                    out.append(
                        FetchedBlock(key, self._view(entry), found, entry.exact, entry.lossy)
                    )
            yield out
        finally:
            with self.guard.lock:
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
        with self.guard.lock:
            self.guard.ensure_open()
            unique = list(dict.fromkeys(BlockHash(bytes(k)) for k in keys))
            missing = [k for k in unique if k not in self.table]
            if missing:
                raise UnknownBlockError(
                    f"{len(missing)} of {len(unique)} blocks are not stored here "
                    f"(first {bytes(missing[0]).hex()})"
                )
            for key in unique:
                self._pin(self.table[key])
            return unique

    def held(self, keys: Sequence[bytes]) -> list[bytes]:
        """Those of ``keys`` this pool still keeps (held, or pinned by a reader)."""
        with self.guard.lock:
            return [bytes(k) for k in keys if BlockHash(bytes(k)) in self.table]

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
        with self._reading_cold(keys):
            try:
                for key in keys:
                    found = self._access(key, stream)
                    entry = self.table[key]
                    plan = self._plan(entry, found)
                    if plan is not None:
                        self._pin(entry)
                        pinned.append(entry)
                    planned.append(plan)
                for key in ahead:
                    held = self.table.get(key)
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
        with self.guard.lock:
            for key in keys:
                entry = self.table.get(key)
                if entry is None or entry.pins == 0:
                    raise_invariant(f"unpin of block {key.hex()} that holds no pin")
                    return
                self._unpin(entry)

    def _access(self, key: BlockHash, stream: str | None) -> Tier:
        """Count a read of ``key`` and bring it to the hot tier where room can be made."""
        entry, found, now = self._count_read(key)
        if found is self.ladder.top.tier:
            self.ladder.top.access(key, now)
        elif entry.pins == 0:
            block = self.ladder.materialize(entry)
            if self.ladder.promote(entry, block, now):
                self._note_materialized(entry, block)
        self.prefetcher.observe(key, stream)
        return found

    def _count_read(self, key: BlockHash) -> tuple[_Block, Tier, float]:
        """Account a read of ``key`` (hits, access statistics, prefetch use).

        Raises:
            UnknownBlockError: not stored (counted as a miss).
        """
        self.guard.ensure_open()
        entry = self.table.get(key)
        if entry is None:
            self.counters["misses"] += 1
            raise UnknownBlockError(f"no block {key.hex()} in this store")
        now = self.clock()
        found = entry.tier if entry.tier is not None else Tier.COLD
        self.hits[found] += 1
        if entry.prefetched:
            entry.prefetched = False
            self.counters["prefetch_used"] += 1
        entry.last_access = now
        return entry, found, now

    def _plan(self, entry: _Block, found: Tier) -> PlanEntry | None:
        if entry.tier is None:
            return None
        tier = self.ladder.tier(entry.tier)
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
        with self.guard.lock:
            if self.guard.closed:
                return 0
            now = self.clock()
            headroom = self.ladder.headroom_bytes(self.ladder.top)
            for key in keys:
                entry = self.table.get(key)
                if entry is None or entry.tier is self.ladder.top.tier or entry.pins:
                    continue
                # Not into the headroom kept for puts: the headroom keeper would only
                # demote something else to make it again.
                need = entry.layout.block_nbytes() + headroom
                if self.ladder.top.capacity_bytes - self.ladder.top.used_bytes < need:
                    break
                block = self.ladder.materialize(entry)
                if self.ladder.promote(entry, block, now, evict=False):
                    self._note_materialized(entry, block)
                    entry.prefetched = True
                    moved += 1
            self.counters["prefetched"] += moved
        return moved

    def prefetch_predicted(self, key: BlockHash) -> int:
        """Prefetch what the Markov model expects to follow ``key`` (when ``prefetch.markov``)."""
        if not self.config.prefetch.markov:
            return 0
        with self.guard.lock:
            predicted = [k for k, _ in self.prefetcher.predict(key)]
        return self.prefetch(predicted)

    def _pin(self, entry: _Block) -> None:
        entry.pins += 1
        if entry.pins == 1 and entry.tier is not None:
            self.ladder.tier(entry.tier).pin(entry.key)

    def _unpin(self, entry: _Block) -> None:
        entry.pins -= 1
        if entry.pins == 0:
            if entry.tier is not None:
                self.ladder.tier(entry.tier).unpin(entry.key)
            if entry.refcount == 0:
                self.ladder.free(entry)

    def _view(self, entry: _Block) -> torch.Tensor:
        if entry.tier is None:
            # Not in memory (no room even after eviction): a decoded copy.
            return self.ladder.materialize(entry)
        stored = self.ladder.tier(entry.tier).load(entry.key)
        if not isinstance(stored, torch.Tensor) or stored.dtype != entry.layout.torch_dtype:
            return self.ladder.materialize(entry)
        return stored

    def hot_locations(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """``(byte offset, bytes)`` in the hot arena of each of ``keys`` held there raw
        (blocks elsewhere, or kept as int8, are left out): for attaching a session's
        blocks to its CUDA stream (memkv.gpu_kernels.unified)."""
        out: list[tuple[int, int]] = []
        with self.guard.lock:
            for key in dict.fromkeys(BlockHash(bytes(k)) for k in keys):
                entry = self.table.get(key)
                if entry is None or entry.tier is not self.ladder.top.tier:
                    continue
                where = self.ladder.top.location(key)
                if where is not None:
                    out.append((where[0], entry.layout.block_nbytes(entry.tokens)))
        return out

    def _note_materialized(self, entry: _Block, block: torch.Tensor) -> None:
        """The hot copy was rebuilt from a lossy copy: its checksum is of the new bytes."""
        if not entry.exact:
            entry.crc32 = None
