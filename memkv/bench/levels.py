"""One measured row of the data-plane suites: :class:`LevelResult`, from client runs,
from a list of latencies, or from the single-core memcpy ceiling."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from memkv.bench.clients import ClientRun
from memkv.bench.report import percentile

__all__ = ["LevelResult", "from_latencies", "from_runs", "from_window", "memcpy_level"]

#: The memcpy ceiling copies through a ring of buffers this large (past any LLC).
MEMCPY_RING_BYTES = 256 << 20
MEMCPY_RING_MAX_BUFFERS = 256
GB = 1e9
MS = 1000.0
P50, P99 = 50, 99


@dataclass(frozen=True, slots=True)
class LevelResult:
    """One target, operation and concurrency."""

    target: str
    op: str
    concurrency: int
    ops: int
    block_bytes: int
    gb_s: float
    p50_ms: float
    p99_ms: float


def from_runs(target: str, op: str, rounds: list[list[ClientRun]], nbytes: int) -> LevelResult:
    """GB/s = clients x block bytes / median latency, over every round's operations.

    The median, not bytes over wall time: this 2-core machine, shared by the
    servers, the clients and Ray, stalls now and then, and one 40-100 ms stall
    in a round of 1.5 ms operations would decide a wall-time figure (the raw
    socket's own P99 was 42 ms here). For closed-loop clients c / median
    latency is the throughput of a stall-free round.
    """
    latencies = [lat for runs in rounds for r in runs for lat in r.latencies]
    return _at_median(target, op, len(rounds[0]), latencies, nbytes)


def from_window(target: str, op: str, rounds: list[list[ClientRun]], nbytes: int,
                window: int) -> LevelResult:
    """One connection with ``window`` requests in flight: window x block bytes / median
    latency (as ``window`` closed-loop clients; the concurrency column says ``window``)."""
    latencies = [lat for runs in rounds for r in runs for lat in r.latencies]
    return _at_median(target, op, window, latencies, nbytes)


def from_latencies(target: str, op: str, latencies: list[float], nbytes: int) -> LevelResult:
    """A sequential single-client figure: bytes over the median operation."""
    return _at_median(target, op, 1, latencies, nbytes)


def _at_median(target: str, op: str, clients: int, latencies: list[float],
               nbytes: int) -> LevelResult:
    p50 = percentile(latencies, P50)
    return LevelResult(target, op, clients, len(latencies), nbytes,
                       clients * nbytes / p50 / GB, p50 * MS, percentile(latencies, P99) * MS)


def memcpy_level(block_bytes: int, reps: int, blocks: int = 1) -> LevelResult:
    """Single-core copy of ``blocks`` blocks into other buffers, ``reps`` times.

    The copies walk a ring of buffers larger than any last-level cache, as a
    server's copies do: one cache-resident block copied over and over measured
    60 GB/s here, a cache figure, not the memory bandwidth a block move gets.
    """
    total = block_bytes * blocks
    ring = max(2, min(-(-MEMCPY_RING_BYTES // total), MEMCPY_RING_MAX_BUFFERS))
    rng = np.random.default_rng(0)
    srcs = [rng.integers(0, 255, total, dtype=np.uint8) for _ in range(ring)]
    dsts = [np.empty_like(s) for s in srcs]
    for d, s in zip(dsts, srcs, strict=True):
        np.copyto(d, s)  # fault the pages in before timing
    lat = []
    for i in range(reps):
        t0 = time.perf_counter()
        np.copyto(dsts[i % ring], srcs[(i + 1) % ring])
        lat.append(time.perf_counter() - t0)
    label = "memcpy (1 core)" if blocks == 1 else f"memcpy (1 core, {blocks} blocks)"
    return LevelResult(
        label,
        "copy",
        1,
        reps,
        total,
        reps * total / sum(lat) / GB,
        percentile(lat, P50) * MS,
        percentile(lat, P99) * MS,
    )
