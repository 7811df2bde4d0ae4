"""Tokens held per GiB of hot + warm memory, by warm-tier precision (part of the codecs suite).

A real :class:`~memkv.storage.block_pool.BlockPool` (its arenas, slabs and
buddy rounding) is filled with a trained model's KV blocks, one block per
session, the clock moved past the idle thresholds before each append so that
every block leaving the hot tier takes the warm precision under test; filling
stops once blocks start going cold. What the memory tiers then hold, in tokens,
is compared with what the same bytes hold as raw fp16. Run per warm precision
(fp16 as written, int8 after idle, Delta+RL frames after idle) and per
hot : warm split, so that the mix an operator configures can be read off.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from memkv.bench.single_block import OneBlockSessions
from memkv.protocol.enums import Tier
from memkv.protocol.hashing import BlockHash
from memkv.storage.block_pool import BlockPool
from memkv.storage.config import (
    MIB,
    AllocatorConfig,
    ArchiveConfig,
    PrecisionConfig,
    StoreConfig,
)
from memkv.storage.layout import KVLayout

__all__ = ["CapacityRow", "WARM_MODES", "measure_capacity"]

#: Warm precisions measured: name -> precision settings (idle times the fill passes).
WARM_MODES: dict[str, PrecisionConfig] = {
    "fp16 (no idle step)": PrecisionConfig(int8_idle_seconds=1e12),
    "int8 after idle": PrecisionConfig(int8_idle_seconds=60.0),
    "Delta+RL frames after idle": PrecisionConfig(compact_idle_seconds=60.0),
}
#: Hot : warm splits, as shares of the memory (memkv.yaml's default is 2 : 4 GiB).
SPLITS: tuple[tuple[int, int], ...] = ((1, 2), (1, 4), (0, 1))
IDLE_STEP_S = 3600.0


@dataclass(frozen=True, slots=True)
class CapacityRow:
    """One warm precision and split."""

    mode: str
    hot_bytes: int
    warm_bytes: int
    tokens_held: int
    warm_tokens: int
    vs_fp16: float  # tokens held / tokens the same bytes hold as raw fp16
    warm_vs_fp16: float  # the warm tier alone


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _fill(layout: KVLayout, blocks: Sequence[torch.Tensor], precision: PrecisionConfig,
          hot_bytes: int, warm_bytes: int, unit: int, directory: Path) -> tuple[int, int]:
    """(tokens in hot + warm, tokens in warm) once the pool starts demoting to cold."""
    clock = _Clock()
    config = StoreConfig(
        hot_capacity_bytes=max(unit, hot_bytes),
        warm_capacity_bytes=warm_bytes,
        allocator=AllocatorConfig(min_unit_bytes=unit),
        archive=ArchiveConfig(directory=directory, fsync="never"),
        precision=precision,
        prefault=False,
    )
    pool = BlockPool(config, clock=clock)
    sessions = OneBlockSessions(pool, layout, "c")  # distinct keys for the same bytes
    tokens = layout.block_tokens
    keys: list[bytes] = []
    try:
        for i in range(1_000_000):
            clock.t += IDLE_STEP_S
            keys.append(sessions.append(blocks[i % len(blocks)])[0])
            if pool.locate(BlockHash(keys[0])) is Tier.COLD:  # the oldest went cold: full
                break
        where = [pool.locate(BlockHash(k)) for k in keys]
        held = sum(1 for t in where if t in (Tier.HOT, Tier.WARM))
        warm = sum(1 for t in where if t is Tier.WARM)
    finally:
        pool.close()
    return held * tokens, warm * tokens


def measure_capacity(layout: KVLayout, blocks: Sequence[torch.Tensor], *,
                     memory_bytes: int = 96 * MIB, unit: int = 4 * MIB) -> list[CapacityRow]:
    """Every warm precision x hot : warm split over ``memory_bytes`` of hot + warm."""
    per_token = layout.block_nbytes() // layout.block_tokens  # raw fp16 bytes a token
    if layout.dtype != "float16":
        raise ValueError(f"capacity is measured on fp16 blocks, got {layout.dtype}")
    rows = []
    for hot_share, warm_share in SPLITS:
        total = hot_share + warm_share
        hot = max(unit, memory_bytes * hot_share // total // unit * unit) if hot_share else 0
        warm = (memory_bytes - hot) // unit * unit
        for mode, precision in WARM_MODES.items():
            with tempfile.TemporaryDirectory(prefix="memkv-capacity-") as tmp:
                # A pool needs some hot tier: the warm-only split keeps one unit there
                # and counts only the warm tier.
                held, warm_tokens = _fill(layout, blocks, precision, hot, warm, unit, Path(tmp))
            memory = (hot + warm) if hot else warm
            counted = held if hot else warm_tokens
            rows.append(CapacityRow(mode, hot, warm, counted, warm_tokens,
                                    counted * per_token / memory,
                                    warm_tokens * per_token / warm))
    return rows
