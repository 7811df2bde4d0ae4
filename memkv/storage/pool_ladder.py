"""The tier ladder: admitting a block to memory, demoting under pressure (hot to
warm through the precision policy, warm to cold through the codec policy, a block
leaving memory only once a copy is safe on disk), promoting it back."""

from __future__ import annotations

from collections.abc import Sequence
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
from memkv.storage.codecs import decode_frame, encode_stored
from memkv.storage.pool_core import (
    _TORCH_DTYPES,
    PoolCore,
    _Block,
    _codec_step,
    _copy_crc32,
    _crc32,
    _precision_step,
)
from memkv.storage.precision import (
    EncodedBlock,
    QuantizedBlock,
    convert,
    quantize_int8,
)
from memkv.storage.tiers import MemoryTier, StoredBlock, stored_data


class TierLadder(PoolCore):
    """Where a block's copies live, and how they move between the tiers."""

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

    def _adopt_placed(self, entry: _Block, block: torch.Tensor, slot: Allocation,
                      now: float) -> bool:
        """Make a reserved slot holding ``block``'s bytes its copy in that tier (the
        writer filled it: no copy); False when no memory tier owns the slot."""
        tier = next((t for t in (self._hot, self._warm) if t.arena.owns(slot)), None)
        if tier is None:
            return False
        # Checksummed where the writer left the bytes: the CRC every read checks.
        if entry.crc32 is None and _checksummable(entry, block):
            entry.crc32 = _crc32(block)
        tier.put(entry.key, block, parent=entry.parent, priority=entry.priority, now=now,
                 reserve_bytes=slot.nbytes, placed=slot)
        entry.tier = tier.tier
        return True

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
            if not evict or not self._evict_one(tier, now):
                return False

    def _headroom_bytes(self, tier: MemoryTier) -> int:
        """Free space ``tier`` keeps for arriving blocks: its share, or as much as the
        largest recent put (so that the next one lands without evicting), within half
        the tier."""
        share = self.config.eviction.headroom_fraction
        if share <= 0:
            return 0
        wanted = max(int(share * tier.capacity_bytes), max(self._recent_put_bytes, default=0))
        return min(wanted, tier.capacity_bytes // 2)

    def _headroom_short(self, tier: MemoryTier) -> bool:
        """Less of ``tier`` free than its headroom, and something there to demote."""
        return (len(tier) > 0
                and tier.capacity_bytes - tier.used_bytes < self._headroom_bytes(tier))

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

    def _load_stored(self, entry: _Block) -> StoredBlock:
        if entry.tier is not None:
            return self._tier(entry.tier).load(entry.key)
        block = self._cold_read_ahead.pop(entry.key, None)
        if block is None:
            block = self._cold.load(entry.key)
        if block.dtype == torch.float16 and entry.layout.torch_dtype != torch.float16:
            # An fp16 copy of a wider block (the warm tier's precision step): known
            # already unless the entry was made from the archive after a restart.
            entry.lossy = worse(entry.lossy, "float16")
            entry.crc32 = None
        return block

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

    def _note_demoted(self, entry: _Block, *, lossy: str | None) -> None:
        """The copy that remains went through ``lossy`` (a step's name; None: none):
        reads are no longer exact, and say which step."""
        if lossy:
            entry.lossy = worse(entry.lossy, lossy)
            entry.crc32 = None
            self._counters["lossy_conversions"] += 1


def _checksummable(entry: _Block, block: StoredBlock) -> bool:
    """Whether ``block`` holds ``entry``'s bytes as readers check them (in the layout's
    dtype, in this process's memory, in one piece), so its copy can make the CRC32."""
    return (isinstance(block, torch.Tensor) and block.device.type == "cpu"
            and block.is_contiguous() and block.dtype == entry.layout.torch_dtype)
