"""The block pool's records (one per block), its figures, and the small helpers its
parts share: the block table (:mod:`memkv.storage.block_table`), the tier ladder
(:mod:`memkv.storage.pool_ladder`), references (:mod:`memkv.storage.pool_refs`) and
reads (:mod:`memkv.storage.pool_reads`), which :class:`~memkv.storage.block_pool.BlockPool`
composes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from memkv.errors import (
    ConfigError,
)
from memkv.protocol.checksum import crc32
from memkv.protocol.enums import Priority, Tier
from memkv.protocol.hashing import BlockHash
from memkv.storage.codecs import CODECS
from memkv.storage.layout import KVLayout
from memkv.storage.precision import (
    EncodedBlock,
    QuantizedBlock,
)
from memkv.storage.tiers import StoredBlock


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
    demotions_ahead: int = 0  # of the demotions, those made off the request path (headroom)


_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _crc32(block: torch.Tensor) -> int:
    """CRC32 of a contiguous CPU tensor's bytes (no copy)."""
    return crc32(_bytes_of(block))


#: Bytes copied per step of :func:`_copy_crc32`: the CRC reads them while they are in
#: the core's cache (1 MiB measured fastest of 64 KiB / 256 KiB / 1 MiB here).
COPY_CRC_CHUNK_BYTES = 1 << 20


def _copy_crc32(dst: torch.Tensor, src: torch.Tensor) -> int:
    """Copy ``src`` into ``dst`` (contiguous CPU tensors of one dtype and size) and return
    the CRC32 of the bytes: a step at a time, each checksummed from the cache it was
    just written through, instead of a checksum pass over memory and a copy pass
    (512 MiB on one core here: 73-77 ms against 91-94 ms)."""
    out, into = _bytes_of(src), _bytes_of(dst)
    value = 0
    for start in range(0, len(out), COPY_CRC_CHUNK_BYTES):
        end = min(start + COPY_CRC_CHUNK_BYTES, len(out))
        into[start:end] = out[start:end]
        value = crc32(into[start:end], value)
    return value


def _bytes_of(block: torch.Tensor) -> memoryview:
    raw = block.view(torch.int16) if block.dtype is torch.bfloat16 else block
    return raw.numpy().data.cast("B")


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
