"""Appends that push blocks to the cold tier: inline writes against the cold writer.

Part of the dataplane suite. A block pool whose hot and warm tiers are full
takes one 4 MiB block per append, so every append demotes a block hot → warm
and another warm → cold. Measured side by side, in one process, on the same
blocks: the append's latency as its caller sees it, the throughput including
the final drain of the writer's queue, and how long a reader waits for the
pool's lock meanwhile (a probe thread asks where a block is, once a
millisecond). Inline, the cold write (zstd encode + segment append) runs under
the lock; behind, the append only copies the block into the writer's queue.

The cold tier here is the pool's own segment files (fsync off): a cluster's
archive actor adds one Ray call per batch (per block, inline) on top.
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from memkv.bench.single_block import OneBlockSessions
from memkv.protocol.layout import KVLayout
from memkv.storage.block_pool import BlockPool
from memkv.storage.config import AllocatorConfig, ArchiveConfig, ColdWriterConfig, StoreConfig

__all__ = ["DemotionRun", "measure_demotions"]

#: Blocks each memory tier holds: small, so that every timed append demotes.
TIER_BLOCKS = 8
PROBE_INTERVAL_S = 0.001
_GB = 1e9


@dataclass(frozen=True, slots=True)
class DemotionRun:
    """One mode's figures (latencies in seconds)."""

    mode: str
    appends: list[float]
    wall_s: float  # every append, then the drain of the writer's queue
    probes: list[float]  # a reader's wait for the pool's lock
    nbytes: int
    cold_calls: int

    @property
    def gb_s(self) -> float:
        return len(self.appends) * self.nbytes / self.wall_s / _GB


def _pool(directory: Path, layout: KVLayout, write_behind: bool) -> BlockPool:
    nbytes = layout.block_nbytes()
    unit = 1 << max(12, (nbytes - 1).bit_length())
    config = StoreConfig(
        hot_capacity_bytes=TIER_BLOCKS * unit,
        warm_capacity_bytes=TIER_BLOCKS * unit,
        allocator=AllocatorConfig(min_unit_bytes=unit),
        archive=ArchiveConfig(directory=directory, fsync="never"),
        cold_writer=ColdWriterConfig(write_behind=write_behind),
    )
    pool = BlockPool(config)
    pool.prefault_done.wait()  # first touch of the arenas out of the timing
    return pool


def _one(layout: KVLayout, blocks: list[torch.Tensor], write_behind: bool) -> DemotionRun:
    with tempfile.TemporaryDirectory(prefix="memkv-demotion-") as tmp:
        pool = _pool(Path(tmp), layout, write_behind)
        sessions = OneBlockSessions(pool, layout, "d")
        stop = threading.Event()
        probes: list[float] = []

        def probe(key: bytes) -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                pool.locate(key)  # type: ignore[arg-type]
                probes.append(time.perf_counter() - t0)
                time.sleep(PROBE_INTERVAL_S)

        warm_up = 2 * TIER_BLOCKS  # fill hot and warm: from here on each append demotes
        first, _ = sessions.append(blocks[0])
        for i in range(1, warm_up):
            sessions.append(blocks[i % len(blocks)])
        pool.flush_cold()
        thread = threading.Thread(target=probe, args=(first,))
        thread.start()
        t0 = time.perf_counter()
        appends = [sessions.append(blocks[i % len(blocks)])[1]
                   for i in range(warm_up, warm_up + len(blocks))]
        pool.flush_cold()
        wall = time.perf_counter() - t0
        stop.set()
        thread.join()
        writer = pool.cold_writer_stats()
        pool.close()
    return DemotionRun(
        "write-behind" if write_behind else "inline",
        appends,
        wall,
        probes,
        layout.block_nbytes(),
        writer.batches if writer else len(blocks),
    )


def measure_demotions(layout: KVLayout, appends: int, seed: int = 0) -> list[DemotionRun]:
    """Both modes on the same blocks: inline first, then write-behind, then inline again.

    The repeat brackets the write-behind run, so a drift of this shared
    machine shows as a difference between the two inline runs.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = layout.block_shape()
    blocks = [
        torch.randn(shape, generator=gen, dtype=torch.float32).to(layout.torch_dtype)
        for _ in range(min(appends, 16))
    ]
    # Distinct blocks per append (content-addressed: the same bytes would dedup).
    blocks = [blocks[i % len(blocks)] + i for i in range(appends)]
    return [_one(layout, blocks, mode) for mode in (False, True, False)]
