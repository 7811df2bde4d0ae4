"""Data-plane suite: put/get of 4 MiB KV blocks through the gateway, Redis and memcpy.

At concurrency 1, 4, 16 and 64 (client threads, one HTTP connection each) the
gateway stores blocks as session turns (``append_turn`` of one block) and
serves them back (``read_blocks`` of one block); Redis on 127.0.0.1 — LMCache's
remote tier — SETs and GETs the same bytes with redis-py; single-core memcpy
of the same block is the physical ceiling. Throughput is bytes moved over the
wall time of the whole level; latencies are per operation.

Redis is not installed by this suite: it looks for ``redis-server`` on PATH,
starts it on a free loopback port without persistence and stops it after;
where there is none, the Redis column is skipped with a message.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import torch

from memkv.bench.context import BenchContext
from memkv.bench.report import PlotKind, PlotSpec, SuiteResult, percentile, track
from memkv.storage.layout import KVLayout

__all__ = ["LevelResult", "memcpy_level", "redis_server", "run"]

CONCURRENCY = (1, 4, 16, 64)
QUICK_CONCURRENCY = (1, 4)
#: 8 layers x 2 x 8 KV heads x 256 tokens x 64 dims x fp16 = 4 MiB per block.
BLOCK_LAYOUT = KVLayout("bench-dataplane", num_layers=8, num_kv_heads=8, head_dim=64)
#: A 4 KiB block for --quick (fits the test cluster's tiny tiers).
QUICK_LAYOUT = KVLayout("bench-dataplane-quick", num_layers=1, num_kv_heads=1, head_dim=16,
                        block_tokens=64)
#: Blocks moved per level: at least this many, and at least MIN_OPS_PER_CLIENT each.
OPS_PER_LEVEL = 128
QUICK_OPS_PER_LEVEL = 16
MIN_OPS_PER_CLIENT = 4
MEMCPY_REPS = 200
#: Bytes the memcpy ring spans (well past a last-level cache).
MEMCPY_RING_BYTES = 256 << 20
MEMCPY_RING_MAX_BUFFERS = 256
QUICK_MEMCPY_REPS = 50
NAMESPACE = "bench-dataplane"
REDIS_SKIP = "skipped: redis-server not found (apt-get install redis-server)"
_REDIS_START_TIMEOUT_S = 10.0
_REDIS_POLL_S = 0.05
_GB = 1e9
_MS = 1000.0
_P50, _P99 = 50, 99


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


def _level(target: str, op: str, concurrency: int, block_bytes: int,
           clients: list[Callable[[], list[float]]]) -> LevelResult:
    """Run one callable per client thread at once; each returns its per-op latencies."""
    barrier = threading.Barrier(len(clients) + 1)

    def go(fn: Callable[[], list[float]]) -> list[float]:
        barrier.wait()
        return fn()

    with ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(go, fn) for fn in clients]
        barrier.wait()
        start = time.perf_counter()
        latencies = [lat for f in futures for lat in f.result()]
        wall = time.perf_counter() - start
    return LevelResult(target, op, concurrency, len(latencies), block_bytes,
                       len(latencies) * block_bytes / wall / _GB,
                       percentile(latencies, _P50) * _MS, percentile(latencies, _P99) * _MS)


def _timed(fn: Callable[[int], object], n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def memcpy_level(block_bytes: int, reps: int) -> LevelResult:
    """Single-core copy of a block into another buffer, ``reps`` times.

    The copies walk a ring of buffers larger than any last-level cache, as the
    server's copies do: copying one cache-resident block over and over measured
    60 GB/s here, a cache figure, not the memory bandwidth a block move gets.
    """
    ring = max(2, min(-(-MEMCPY_RING_BYTES // block_bytes), MEMCPY_RING_MAX_BUFFERS))
    rng = np.random.default_rng(0)
    srcs = [rng.integers(0, 255, block_bytes, dtype=np.uint8) for _ in range(ring)]
    dsts = [np.empty_like(s) for s in srcs]
    for d, s in zip(dsts, srcs, strict=True):
        np.copyto(d, s)  # fault the pages in before timing
    lat = _timed(lambda i: np.copyto(dsts[i % ring], srcs[(i + 1) % ring]), reps)
    return LevelResult("memcpy (1 core)", "copy", 1, reps, block_bytes,
                       reps * block_bytes / sum(lat) / _GB,
                       percentile(lat, _P50) * _MS, percentile(lat, _P99) * _MS)


def _gateway_levels(url: str, layout: KVLayout, concurrency: int, ops: int) -> list[LevelResult]:
    from memkv.client import Client

    bt = layout.block_tokens
    block = torch.randn(layout.block_shape()).to(torch.float16)
    clients = [Client(url) for _ in range(concurrency)]
    sids = [f"dp-{concurrency}-{c}-{uuid.uuid4().hex[:8]}" for c in range(concurrency)]
    try:
        for client, sid in zip(clients, sids, strict=True):
            client.create_session(sid, layout, namespace=NAMESPACE)

        def putter(c: int) -> Callable[[], list[float]]:
            # Distinct tokens per client and block: every put stores a new block.
            base = c * ops * bt

            def put(i: int) -> None:
                tokens = list(range(base, base + (i + 1) * bt))
                clients[c].append_turn(sids[c], tokens, blocks=[block], start_block=i)

            return lambda: _timed(put, ops)

        def getter(c: int) -> Callable[[], list[float]]:
            def get(i: int) -> None:
                got = list(clients[c].read_blocks(sids[c], i, i + 1))
                if len(got) != 1:
                    raise RuntimeError(f"expected 1 block from the gateway, got {len(got)}")

            return lambda: _timed(get, ops)

        nbytes = layout.block_nbytes()
        put_r = _level("gateway (HTTP)", "put", concurrency, nbytes,
                       [putter(c) for c in range(concurrency)])
        get_r = _level("gateway (HTTP)", "get", concurrency, nbytes,
                       [getter(c) for c in range(concurrency)])
        return [put_r, get_r]
    finally:
        for client, sid in zip(clients, sids, strict=True):
            client.delete_session(sid)
            client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_server() -> Iterator[int | None]:
    """A throwaway redis-server on 127.0.0.1 (no persistence); yields its port, or None."""
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    import redis

    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + _REDIS_START_TIMEOUT_S
        while True:
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(_REDIS_POLL_S)
        yield port
    finally:
        proc.terminate()
        proc.wait()


def _redis_levels(port: int, block_bytes: int, concurrency: int, ops: int) -> list[LevelResult]:
    import redis

    payload = np.random.default_rng(1).integers(0, 255, block_bytes, dtype=np.uint8).tobytes()
    conns = [redis.Redis(port=port) for _ in range(concurrency)]
    run_id = uuid.uuid4().hex[:8]

    def putter(c: int) -> Callable[[], list[float]]:
        return lambda: _timed(lambda i: conns[c].set(f"{run_id}:{c}:{i}", payload), ops)

    def getter(c: int) -> Callable[[], list[float]]:
        def get(i: int) -> None:
            got = conns[c].get(f"{run_id}:{c}:{i}")
            if not isinstance(got, bytes) or len(got) != block_bytes:
                raise RuntimeError("redis returned another value than was stored")

        return lambda: _timed(get, ops)

    try:
        return [
            _level("redis (redis-py)", "put", concurrency, block_bytes,
                   [putter(c) for c in range(concurrency)]),
            _level("redis (redis-py)", "get", concurrency, block_bytes,
                   [getter(c) for c in range(concurrency)]),
        ]
    finally:
        conns[0].flushall()
        for conn in conns:
            conn.close()


def run(ctx: BenchContext) -> SuiteResult:
    """Every target at every concurrency; the table is GB/s and latency percentiles."""
    layout = QUICK_LAYOUT if ctx.quick else BLOCK_LAYOUT
    levels = QUICK_CONCURRENCY if ctx.quick else CONCURRENCY
    per_level = QUICK_OPS_PER_LEVEL if ctx.quick else OPS_PER_LEVEL
    nbytes = layout.block_nbytes()
    url = ctx.get_gateway_url()
    results: list[LevelResult] = [
        memcpy_level(nbytes, QUICK_MEMCPY_REPS if ctx.quick else MEMCPY_REPS)
    ]
    notes: list[str] = []
    with redis_server() as port:
        if port is None:
            notes.append(f"redis: {REDIS_SKIP}")
        for c in track(levels, "dataplane: concurrency levels"):
            ops = max(MIN_OPS_PER_CLIENT, per_level // c)
            results += _gateway_levels(url, layout, c, ops)
            if port is not None:
                results += _redis_levels(port, nbytes, c, ops)
    gw = {(r.op, r.concurrency): r for r in results if r.target.startswith("gateway")}
    rd = {(r.op, r.concurrency): r for r in results if r.target.startswith("redis")}
    rows = [[r.target, r.op, r.concurrency, r.ops, r.gb_s, r.p50_ms, r.p99_ms,
             (r.gb_s / rd[(r.op, r.concurrency)].gb_s) if r.target.startswith("gateway")
             and (r.op, r.concurrency) in rd else None]
            for r in results]
    memcpy = results[0]
    notes += [
        f"blocks of {nbytes / (1 << 20):.3g} MiB ({list(layout.block_shape())} fp16); clients are "
        "threads of this process (one connection each), so the client's own parsing shares "
        "the cores with the server.",
        f"memcpy ceiling {memcpy.gb_s:.2f} GB/s on one core; gateway put = append_turn (session "
        "lookup + one block), get = read_blocks of one block (streamed, checksummed).",
    ]
    series: dict[str, list[float | None]] = {}
    for target, table in (("gateway", gw), ("redis", rd)):
        for op in ("get", "put"):
            if table:
                series[f"{target} {op}"] = [
                    table[(op, c)].gb_s if (op, c) in table else None for c in levels]
    series["memcpy (1 core)"] = [memcpy.gb_s for _ in levels]
    return SuiteResult(
        suite="dataplane",
        title=f"put/get of {nbytes / (1 << 20):.3g} MiB blocks: GB/s and latency by concurrency",
        columns=["target", "op", "concurrency", "ops", "GB/s", "P50 ms", "P99 ms",
                 "gateway / redis"],
        rows=rows,
        figures={"block_bytes": nbytes, "redis": port is not None,
                 "results": [asdict(r) for r in results]},
        notes=notes,
        plot=PlotSpec(PlotKind.LINE, "concurrent clients", "GB/s", list(levels), series),
        quick=ctx.quick,
    )
