"""Typed, validated settings of the storage engine, one class per component.

Components take these (or plain arguments) explicitly; nothing mutates them
after validation (every model is frozen). ``configs/memkv.yaml`` documents the
same fields for deployments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from memkv.errors import ConfigError
from memkv.storage.sizing import SizedTier, TierSizes

__all__ = [
    "EngineSettings",
    "MIB",
    "UNIT_PROFILES",
    "AllocatorConfig",
    "ArchiveConfig",
    "CodecConfig",
    "ColdWriterConfig",
    "EvictionConfig",
    "PrecisionConfig",
    "PrefetchConfig",
    "StoreConfig",
    "validated",
]

MIB = 1 << 20

#: Buddy-allocator minimum units by hardware class (from the design article).
UNIT_PROFILES: dict[str, int] = {
    "default": 4 * MIB,  # A100-class
    "a100": 4 * MIB,
    "h100": 8 * MIB,  # H100/H200-class: larger HBM, larger transfers
    "edge": 1 * MIB,  # Jetson-class: small memories
}

# Smallest unit we accept: below a page, bookkeeping costs more than it saves.
_MIN_UNIT_FLOOR = 4096


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AllocatorConfig(_Frozen):
    """Buddy allocation of the hot and warm arenas."""

    min_unit_bytes: int = Field(
        default=UNIT_PROFILES["default"],
        description="Smallest buddy unit; a power of two. Blocks smaller than half a unit "
        "are packed into unit-sized slabs.",
    )

    @field_validator("min_unit_bytes")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v < _MIN_UNIT_FLOOR or v & (v - 1):
            raise ValueError(f"min_unit_bytes must be a power of two >= {_MIN_UNIT_FLOOR}, got {v}")
        return v


class EvictionConfig(_Frozen):
    """Which memory-tier block goes first under pressure."""

    policy: Literal["horizon", "lru_k", "lru"] = Field(
        default="horizon",
        description="Eviction policy: horizon (the least likely to be read within the cache's "
        "horizon, learned online; O(1)), lru_k (the design article's exact prefix-aware "
        "LRU-K; ~10x the cost) or lru.",
    )
    k: int = Field(default=3, ge=1, le=16, description="LRU-K: access times remembered per block.")
    prefix_aware: bool = Field(
        default=True,
        description="LRU-K: prefer leaves, a block whose descendants are cached goes last "
        "(horizon is always prefix-aware).",
    )
    recency_guard: bool = Field(
        default=True,
        description="LRU-K: evict a leaf idle for longer than an adaptive multiple of LRU's "
        "lifetime before consulting the score (keeps LRU-K from hoarding dead, once-frequent "
        "blocks).",
    )
    inherit: bool = Field(
        default=True,
        description="LRU-K: a block extending its parent's chain starts with the parent's "
        "history.",
    )
    headroom_fraction: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="Share of each memory tier a device keeps free by demoting ahead, on a "
        "thread of its own, so that an append lands in free space instead of evicting on "
        "its way in; 0: demote only when a block needs the room.",
    )


class PrefetchConfig(_Frozen):
    """The Markov-chain prefetcher."""

    markov: bool = Field(
        default=False,
        description="Prefetch what the Markov model predicts after a session's last block. "
        "Off by default: on the Mooncake conversation trace it finds nothing to prefetch at "
        "any setting tried (memkv bench prefetch); the session-head prefetch stays.",
    )
    lookahead_window: int = Field(default=5, ge=1, le=64, description="Steps ahead to predict.")
    prefetch_threshold: float = Field(
        default=0.6, gt=0, le=1, description="Minimum probability of use within the window."
    )
    max_prefetch_blocks: int = Field(default=8, ge=0, le=1024, description="Cap per prediction.")
    max_tracked_keys: int = Field(
        default=200_000, ge=1, description="States remembered; least recently seen forgotten."
    )
    max_successors: int = Field(
        default=16, ge=1, le=1024, description="Outgoing transitions kept per state."
    )
    hot_idle_fraction: float = Field(
        default=0.3, gt=0, le=1, description="Background prefetch only while hot use is below this."
    )


class PrecisionConfig(_Frozen):
    """Which dtype a block is kept in, by age and sharing."""

    later_dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        default="auto",
        description="Dtype of blocks after a session's first round; auto = float16, except "
        "that a bfloat16 model stays bfloat16 (its values may exceed fp16's range).",
    )
    int8_idle_seconds: float = Field(
        default=600.0, gt=0, description="Idle time after which a block may drop to int8."
    )
    int8_max_refcount: int = Field(
        default=1, ge=0, description="Only blocks with refcount <= this may drop to int8."
    )
    compact_idle_seconds: float | None = Field(
        default=None,
        gt=0,
        description="Idle time after which a block leaving the hot tier is kept in the warm "
        "tier as a Delta+RL frame (codecs.cold_lossy_codec: stepped codes, ~2.5 bits a value, "
        "decoded on read); same refcount rule as int8. None: never.",
    )


class CodecConfig(_Frozen):
    """Per-tier compression."""

    warm_codec: str = Field(default="none", description="Codec of the warm tier (lossless).")
    cold_codec: str = Field(default="zstd", description="Codec of recent history in the cold tier.")
    cold_lossy_codec: str = Field(
        default="delta_rl", description="Codec of long-idle sessions in the cold tier."
    )
    zstd_level: int = Field(default=3, ge=-7, le=22, description="Zstd level.")
    shuffle: bool = Field(default=True, description="Byte-shuffle before lz4/zstd.")
    delta_rl_bits: Literal[4, 8] = Field(
        default=8, description="Delta+RL quantisation bits (8 with delta_rl_step: stepped codes)."
    )
    delta_rl_group: int = Field(default=32, ge=8, le=4096, description="4-bit group size.")
    delta_rl_token_delta: bool = Field(
        default=False,
        description="Delta along the token axis before entropy coding (measured x1.01 on the "
        "ratio at half the decode speed, so off).",
    )
    delta_rl_run_length: bool = Field(
        default=True, description="Run-length stage (skips itself when it would not shrink)."
    )
    delta_rl_k_grouping: Literal["channel", "token"] = Field(
        default="channel", description="Quantisation groups of keys: per channel (KIVI) or token."
    )
    delta_rl_level: int | None = Field(
        default=1,
        ge=-7,
        le=22,
        description="Zstd level of Delta+RL's entropy stage (None = off). 1 measured 14% "
        "smaller than 3 on stepped codes: longer searches find 3-5 byte matches in quantised "
        "noise that cost more than the Huffman-coded literals they replace.",
    )
    delta_rl_step: float | None = Field(
        default=0.5,
        ge=0.01,
        le=8.0,
        description="Stepped int8 codes (needs delta_rl_bits 8): the step as a multiple of each "
        "key channel's / value token's RMS, entropy-coded by zstd; None = the fixed-width schemes. "
        "0.5: 6.4x smaller than fp16 at +0.2-0.35% perplexity on two trained models "
        "(`memkv bench codecs`; the 0.5% budget is reached near 0.65).",
    )
    cold_min_turns_old: int = Field(
        default=0,
        ge=0,
        description="Cold history younger than this many turns uses warm_codec (fast reads); "
        "older uses cold_codec.",
    )
    hot_update_threshold: int = Field(
        default=4, ge=1, description="Blocks rewritten this often are stored uncompressed."
    )

    @model_validator(mode="after")
    def _step_needs_int8_codes(self) -> CodecConfig:
        if self.delta_rl_step is not None and self.delta_rl_bits != 8:  # noqa: PLR2004
            raise ValueError(
                f"delta_rl_step makes int8 codes: expected delta_rl_bits 8 with it, got "
                f"{self.delta_rl_bits}")
        return self


class ColdWriterConfig(_Frozen):
    """Write-behind of demoted blocks to the cold tier (memkv.storage.cold_writer)."""

    write_behind: bool = Field(
        default=True,
        description="Demotions hand the block to one writer thread that encodes and writes "
        "in batches outside the pool's lock; false writes each block inline, under the lock.",
    )
    max_pending_bytes: int = Field(
        default=256 * MIB,
        ge=MIB,
        description="Copies of queued blocks held before a demotion waits for the writer.",
    )
    max_batch_blocks: int = Field(default=64, ge=1, description="Blocks per cold-tier call.")


class ArchiveConfig(_Frozen):
    """The cold tier's segment files."""

    directory: Path = Field(description="Directory of the segment files (created if missing).")
    segment_max_bytes: int = Field(
        default=256 * MIB, ge=4096, description="A segment is sealed when it reaches this size."
    )
    fsync: Literal["always", "batch", "never"] = Field(
        default="batch",
        description="always: fsync every record; batch: every fsync_batch records and on "
        "flush/close; never: leave it to the OS (tests, benchmarks).",
    )
    fsync_batch: int = Field(default=64, ge=1, description="Records per fsync in batch mode.")
    verify_on_open: bool = Field(
        default=False,
        description="Verify every payload checksum when opening (else sealed segments' "
        "payloads are verified on each read).",
    )
    compact_garbage_ratio: float = Field(
        default=0.5, gt=0, le=1, description="Compact a sealed segment once this share is dead."
    )


class EngineSettings(_Frozen):
    """The engine's policies: declared once, shared by a deployment's device
    settings (:class:`memkv.config.DeviceSettings`) and the store's own config."""

    allocator: AllocatorConfig = Field(
        default_factory=AllocatorConfig, description="Buddy allocator of both arenas."
    )
    eviction: EvictionConfig = Field(
        default_factory=EvictionConfig, description="Eviction policy of both memory tiers."
    )
    prefetch: PrefetchConfig = Field(
        default_factory=PrefetchConfig, description="Markov-chain prefetcher."
    )
    precision: PrecisionConfig = Field(
        default_factory=PrecisionConfig, description="Dtype of blocks by age and sharing."
    )
    codecs: CodecConfig = Field(default_factory=CodecConfig, description="Per-tier codecs.")
    cold_writer: ColdWriterConfig = Field(
        default_factory=ColdWriterConfig, description="Write-behind to the cold tier."
    )
    debug_refcounts: bool = Field(
        default=False, description="Check refcount invariants on every operation (slow)."
    )
    prefault: bool = Field(
        default=True,
        description="Populate the hot and warm arenas' pages in a background thread at "
        "start (their memory is committed then), so first writes pay no page faults "
        "(2 ms per fresh 4 MiB block here, 0.45 ms after).",
    )

    def engine_settings(self) -> dict[str, Any]:
        """The policy fields' values (to build another EngineSettings from these)."""
        return {name: getattr(self, name) for name in EngineSettings.model_fields}


class StoreConfig(EngineSettings):
    """The single-process tiered store: capacities, where it runs, and the engine's policies."""

    hot_capacity_bytes: int = Field(gt=0, description="Hot tier (device memory) bytes.")
    warm_capacity_bytes: int = Field(gt=0, description="Warm tier (host shared memory) bytes.")
    cold_capacity_bytes: int | None = Field(
        default=None, gt=0, description="Cold tier bytes on disk; None = limited by the disk."
    )
    lazy_tiers: frozenset[Literal["hot", "warm"]] = Field(
        default=frozenset(),
        description="Tiers never prefaulted whatever `prefault` says: those sized from "
        "free memory ('auto'), whose memory is committed only as blocks arrive.",
    )
    device: str = Field(default="cpu", description="Torch device of the hot arena: cpu or cuda:N.")
    unified_memory: bool = Field(
        default=False,
        description="A GPU hot arena from CUDA managed memory (memkv.gpu_kernels.unified).",
    )
    archive: ArchiveConfig | None = Field(
        default=None, description="Local cold tier; None when a cold backend is given instead."
    )

    def tier_sizes(self) -> TierSizes:
        """The capacities as :class:`~memkv.storage.sizing.TierSizes` (already sized)."""
        return TierSizes(
            SizedTier(self.hot_capacity_bytes, auto="hot" in self.lazy_tiers, basis="given"),
            SizedTier(self.warm_capacity_bytes, auto="warm" in self.lazy_tiers, basis="given"),
        )


_M = TypeVar("_M", bound=BaseModel)


def validated(model: type[_M], **values: object) -> _M:
    """Build a config model, turning pydantic's error into memkv's :class:`ConfigError`."""
    try:
        return model(**values)
    except ValidationError as e:
        raise ConfigError(f"invalid {model.__name__}: {e}") from e
