"""The tier ladder: admitting a block to memory, demoting under pressure (down the
list of memory tiers, through the precision policy below the first, then to the cold
tier through the codec policy: a block leaves memory only once a copy is safe on
disk), promoting it back, and freeing a block's copies."""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from typing import cast

import torch

from memkv.errors import (
    CapacityError,
    PrecisionOverflowError,
)
from memkv.protocol.enums import Tier
from memkv.protocol.exactness import worse
from memkv.protocol.hashing import BlockHash
from memkv.storage.arena import Allocation
from memkv.storage.block_table import BlockTable
from memkv.storage.codecs import CodecPolicy, decode_frame, encode_stored
from memkv.storage.config import StoreConfig
from memkv.storage.layout import KVLayout
from memkv.storage.pool_core import (
    _TORCH_DTYPES,
    _Block,
    _codec_step,
    _copy_crc32,
    _crc32,
    _precision_step,
)
from memkv.storage.precision import (
    EncodedBlock,
    PrecisionPolicy,
    QuantizedBlock,
    convert,
    quantize_int8,
)
from memkv.storage.tier_events import TierEventLog
from memkv.storage.tiers import ColdBackend, MemoryTier, StoredBlock, stored_data

__all__ = ["RECENT_PUTS", "TierLadder"]

#: Puts whose size the headroom remembers (it keeps room for the largest of them).
RECENT_PUTS = 16


class TierLadder:
    """Where a block's copies live, and how they move between the tiers.

    Args:
        config: the pool's settings (eviction headroom, precision, codecs).
        table: the block table (a victim's record is found there; a freed block
            leaves it).
        memory: the memory tiers, fastest first (hot, then warm); new blocks land in
            the first, a victim moves to the next one down, the last one's to cold.
        cold: the cold tier.
        counters: the pool's event counters (demotions, promotions, ...).
    """

    def __init__(self, config: StoreConfig, table: BlockTable, memory: Sequence[MemoryTier],
                 cold: ColdBackend, counters: Counter[str]) -> None:
        if not memory:
            raise ValueError("a tier ladder needs at least one memory tier")
        self.config = config
        self.table = table
        self.memory = tuple(memory)
        self.cold = cold
        self.counters = counters
        self._by_tier: dict[Tier, MemoryTier] = {t.tier: t for t in self.memory}
        self._precision: dict[str, PrecisionPolicy] = {}
        self._codec_policy = CodecPolicy(config.codecs)
        # Bytes of the latest puts' new blocks: the headroom is at least the largest.
        self._recent_put_bytes: deque[int] = deque(maxlen=RECENT_PUTS)
        # Cold copies read ahead of taking the lock, for the reads now holding it.
        self._cold_read_ahead: dict[BlockHash, torch.Tensor] = {}
        # Where each copy's tier changes go (a KV-events publisher; None: nowhere).
        self.tier_events: TierEventLog | None = None

    @property
    def top(self) -> MemoryTier:
        """The fastest memory tier: where blocks are admitted and promoted to."""
        return self.memory[0]

    def tier(self, tier: Tier) -> MemoryTier:
        return self._by_tier[tier]

    def note_put(self, nbytes: int) -> None:
        """A put stored ``nbytes`` of new blocks (the headroom keeps room for the largest)."""
        self._recent_put_bytes.append(nbytes)

    @contextlib.contextmanager
    def reading_ahead(self, blocks: dict[BlockHash, torch.Tensor]) -> Iterator[None]:
        """Serve these cold copies (read ahead of the lock) instead of reading them again,
        while the ``with`` block runs (under the pool's lock)."""
        outer, self._cold_read_ahead = self._cold_read_ahead, blocks
        try:
            yield
        finally:
            self._cold_read_ahead = outer

    def admit(self, entry: _Block, block: torch.Tensor, now: float) -> None:
        """Place a new block: in the first memory tier room can be made in (below the
        first, through the precision policy), else in the cold tier."""
        below: StoredBlock | None = None
        for depth, tier in enumerate(self.memory):
            stored: StoredBlock = block
            if depth:
                below = self._below_top(entry, block, now) if below is None else below
                stored = below
            if self.put_memory(tier, entry, stored, now):
                self.set_tier(entry, tier.tier)
                if depth:
                    self.note_demoted(entry, lossy=_precision_step(stored, block))
                return
        self.ensure_cold(entry, block)
        self.set_tier(entry, None)
        self.note_demoted(entry, lossy=_codec_step(entry.cold_codec))

    def adopt_placed(self, entry: _Block, block: torch.Tensor, slot: Allocation,
                      now: float) -> bool:
        """Make a reserved slot holding ``block``'s bytes its copy in that tier (the
        writer filled it: no copy); False when no memory tier owns the slot."""
        tier = self.owner_of(slot)
        if tier is None:
            return False
        # Checksummed where the writer left the bytes: the CRC every read checks.
        if entry.crc32 is None and _checksummable(entry, block):
            entry.crc32 = _crc32(block)
        tier.put(entry.key, block, parent=entry.parent, priority=entry.priority, now=now,
                 reserve_bytes=slot.nbytes, placed=slot)
        self.set_tier(entry, tier.tier)
        return True

    def put_memory(
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
        write = None
        if entry.crc32 is None and _checksummable(entry, block):
            # A block stored without its writer's checksum gets it as it is copied in.
            def write(dst: torch.Tensor, src: torch.Tensor) -> None:
                if dst.device.type == "cpu":
                    entry.crc32 = _copy_crc32(dst, src)
                else:  # into GPU memory: checksummed where the bytes are, then copied
                    entry.crc32 = _crc32(src)
                    dst.copy_(src)

        while True:
            if tier.put(
                entry.key,
                block,
                parent=entry.parent,
                priority=entry.priority,
                now=now,
                reserve_bytes=reserve,
                write=write,
            ):
                return True
            if not evict or not self.evict_one(tier, now):
                return False

    def headroom_bytes(self, tier: MemoryTier) -> int:
        """Free space ``tier`` keeps for arriving blocks: its share, or as much as the
        largest recent put (so that the next one lands without evicting), within half
        the tier."""
        share = self.config.eviction.headroom_fraction
        if share <= 0:
            return 0
        wanted = max(int(share * tier.capacity_bytes), max(self._recent_put_bytes, default=0))
        return min(wanted, tier.capacity_bytes // 2)

    def headroom_short(self, tier: MemoryTier) -> bool:
        """Less of ``tier`` free than its headroom, and something there to demote."""
        return (len(tier) > 0
                and tier.capacity_bytes - tier.used_bytes < self.headroom_bytes(tier))

    def evict_one(self, tier: MemoryTier, now: float) -> bool:
        """Move the tier's victim one tier down. False when nothing can be evicted."""
        victim = tier.pop_victim(now)
        if victim is None:
            return False
        key = BlockHash(cast(bytes, victim))
        entry = self.table[key]
        stored = tier.load(key)
        depth = self.memory.index(tier)
        try:
            lower = self.memory[depth + 1] if depth + 1 < len(self.memory) else None
            # The first step down goes through the precision policy; further ones
            # move the copy as it is.
            moved = self._below_top(entry, stored, now) if depth == 0 else stored
            if lower is not None and self.put_memory(lower, entry, moved, now):
                self.set_tier(entry, lower.tier)
                self.note_demoted(entry, lossy=_precision_step(moved, stored))
            else:
                self.ensure_cold(entry, stored)
                self.set_tier(entry, None)
                self.note_demoted(entry, lossy=_codec_step(entry.cold_codec))
        except CapacityError:
            tier.restore(key, now)
            raise
        tier.discard(key)
        self.counters["demotions"] += 1
        return True

    def owner_of(self, slot: Allocation) -> MemoryTier | None:
        """The memory tier whose arena ``slot`` is in."""
        return next((t for t in self.memory if t.arena.owns(slot)), None)

    def _precision_for(self, layout: KVLayout) -> PrecisionPolicy:
        policy = self._precision.get(layout.dtype)
        if policy is None:
            policy = PrecisionPolicy(self.config.precision, layout.dtype)
            self._precision[layout.dtype] = policy
        return policy

    def _below_top(self, entry: _Block, block: StoredBlock, now: float) -> StoredBlock:
        """``block`` as the tiers below the first keep it (the precision policy's choice)."""
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
            self.counters["precision_fallbacks"] += 1
            return block

    def ensure_cold(self, entry: _Block, stored: StoredBlock, offline: bool = False) -> None:
        if entry.in_cold:
            return
        codec = self._cold_codec(entry, offline, stored)
        self.cold.put(entry.key, stored, fingerprint=entry.layout.fingerprint, codec=codec)
        self._mark_cold(entry, stored, codec)
        self._note(True, entry, Tier.COLD)

    def ensure_cold_many(
        self, entries: Sequence[_Block], *, offline: bool, durable: bool = False
    ) -> None:
        """Cold copies of ``entries`` in one batch of the cold backend.

        ``durable``: on disk (fsynced) before returning, those already there too.
        """
        items = []
        for entry in entries:
            if entry.in_cold:
                continue
            stored = self.load_stored(entry)
            items.append((entry, stored, self._cold_codec(entry, offline, stored)))
        if not items:
            if durable:
                self.cold.sync()  # earlier cold copies may not be forced to disk yet
            return
        self.cold.put_many(
            [(e.key, stored, e.layout.fingerprint, codec) for e, stored, codec in items],
            durable=durable,
        )
        for entry, stored, codec in items:
            self._mark_cold(entry, stored, codec)
            self._note(True, entry, Tier.COLD)

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
            self.counters["precision_fallbacks"] += 1
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

    def promote(self, entry: _Block, block: torch.Tensor, now: float, evict: bool = True) -> bool:
        """Move a block to the hot tier (``block`` is its materialised copy)."""
        source = entry.tier
        if source is self.top.tier:
            return True
        # Pin the source copy so the evictions we may trigger cannot pick it.
        if source is not None:
            self.tier(source).pin(entry.key)
        try:
            placed = self.put_memory(self.top, entry, block, now, evict=evict)
        finally:
            if source is not None:
                self.tier(source).unpin(entry.key)
        if not placed:
            return False
        if source is not None:
            self.tier(source).remove(entry.key)
        self.set_tier(entry, self.top.tier)
        self.counters["promotions"] += 1
        return True

    def load_stored(self, entry: _Block) -> StoredBlock:
        if entry.tier is not None:
            return self.tier(entry.tier).load(entry.key)
        block = self._cold_read_ahead.pop(entry.key, None)
        if block is None:
            block = self.cold.load(entry.key)
        if block.dtype == torch.float16 and entry.layout.torch_dtype != torch.float16:
            # An fp16 copy of a wider block (the warm tier's precision step): known
            # already unless the entry was made from the archive after a restart.
            entry.lossy = worse(entry.lossy, "float16")
            entry.crc32 = None
        return block

    def materialize(self, entry: _Block) -> torch.Tensor:
        """An owned copy of the block in its layout's dtype, on the CPU."""
        stored = self.load_stored(entry)
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

    def free(self, entry: _Block) -> None:
        """Drop every copy of a block no holder references and no reader pins, and its
        record."""
        if entry.tier is not None:
            self.tier(entry.tier).remove(entry.key)
            self._note(False, entry, entry.tier)
        if entry.in_cold:
            self.cold.remove(entry.key)
            self._note(False, entry, Tier.COLD)
        self.table.drop(entry.key)

    def set_tier(self, entry: _Block, tier: Tier | None) -> None:
        """``entry``'s memory copy is on ``tier`` now (None: none; the cold copy, if
        any, is separate): the change is noted for the tier events."""
        old, entry.tier = entry.tier, tier
        if old is not tier:
            if old is not None:
                self._note(False, entry, old)
            if tier is not None:
                self._note(True, entry, tier)

    def note_cold(self, entry: _Block) -> None:
        """A record made for a block the cold tier already holds (a restart's)."""
        self._note(True, entry, Tier.COLD)

    def _note(self, stored: bool, entry: _Block, tier: Tier) -> None:
        if self.tier_events is None:
            return
        if stored:
            self.tier_events.stored(entry.key, entry.parent, tier, entry.layout.block_tokens)
        else:
            self.tier_events.removed(entry.key, tier)

    def note_demoted(self, entry: _Block, *, lossy: str | None) -> None:
        """The copy that remains went through ``lossy`` (a step's name; None: none):
        reads are no longer exact, and say which step."""
        if lossy:
            entry.lossy = worse(entry.lossy, lossy)
            entry.crc32 = None
            self.counters["lossy_conversions"] += 1


def _checksummable(entry: _Block, block: StoredBlock) -> bool:
    """Whether ``block`` holds ``entry``'s bytes as readers check them (in the layout's
    dtype, in this process's memory, in one piece), so its copy can make the CRC32."""
    return (isinstance(block, torch.Tensor) and block.device.type == "cpu"
            and block.is_contiguous() and block.dtype == entry.layout.torch_dtype)
