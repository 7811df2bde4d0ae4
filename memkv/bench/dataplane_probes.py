"""What the data-plane suite measures beside its rows: the checksum's and one Ray
hop's cost, CPU per put in each process, the devices' memory, and the rows and
note of the demotion runs (memkv.bench.dataplane)."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import numpy as np

from memkv.bench.clients import run_clients
from memkv.bench.context import BenchContext
from memkv.bench.demotion import TIER_BLOCKS, DemotionRun
from memkv.bench.levels import GB, MS, P50, LevelResult, from_latencies
from memkv.bench.peers import raw_socket_server
from memkv.bench.report import percentile
from memkv.bench.session_reads import NAMESPACE
from memkv.protocol.checksum import crc32
from memkv.protocol.layout import KVLayout

__all__ = ["crc_gb_s", "demotion_note", "demotion_rows", "drain_cold", "memory_bytes",
           "put_cpu", "ray_hop_ms"]


def crc_gb_s(nbytes: int) -> float:
    data = np.random.default_rng(2).integers(0, 255, nbytes, dtype=np.uint8)
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        crc32(data)
    return reps * nbytes / (time.perf_counter() - t0) / GB


def ray_hop_ms(ctx: BenchContext) -> float:
    """Round trip of a bare call to the device actor (the unit every Ray path pays)."""
    import ray

    cluster = ctx.get_cluster()
    device = next(iter(ray.get(cluster.router.devices.remote()).values()))
    ray.get(device.ping.remote())
    lat = []
    for _ in range(50):
        t0 = time.perf_counter()
        ray.get(device.ping.remote())
        lat.append(time.perf_counter() - t0)
    return percentile(lat, P50) * MS


def demotion_rows(runs: list[DemotionRun]) -> list[LevelResult]:
    rows = []
    for run in runs:
        rows.append(
            from_latencies(f"append demoting to cold ({run.mode})", "put", run.appends, run.nbytes)
        )
        # Throughput over the whole run, drain included: the median append alone
        # would hide work the writer still had to do.
        rows[-1] = replace(rows[-1], gb_s=run.gb_s)
        if run.probes:
            rows.append(
                from_latencies(f"pool reader meanwhile ({run.mode})", "lock wait", run.probes, 0)
            )
    return rows


def demotion_note(runs: list[DemotionRun]) -> str:
    calls = ", ".join(f"{r.mode} {r.cold_calls}" for r in runs)
    return (
        "appends demoting to cold (memkv.bench.demotion): a pool with full hot and warm tiers "
        f"of {TIER_BLOCKS} blocks takes one block per append, so each append demotes one block "
        "hot -> warm and one warm -> cold (zstd, the pool's own segment files, fsync off); GB/s "
        "counts the drain of the writer's queue; the runs go inline, write-behind, inline again "
        "(the repeat shows the machine's drift). 'pool reader meanwhile' is another thread's "
        "wait for the pool's lock (asking where a block is, once a millisecond): inline the "
        "cold write holds the lock. Cold-tier calls per run: "
        f"{calls} (a cluster's archive adds one Ray call to each)."
    )


def drain_cold(ctx: BenchContext, drains: list[float]) -> None:
    """Wait for the devices' cold writers (demotions of earlier rounds); adds the seconds.

    Demotions are written behind the appends that caused them: without this,
    one round's queued cold writes would run during the next measurement.
    """
    import ray

    start = time.perf_counter()
    devices = ctx.get_cluster().devices.values()
    ray.get([d.flush_cold.remote() for d in devices])
    drains.append(time.perf_counter() - start)


def put_cpu(ctx: BenchContext, layout: KVLayout, puts: int, session_blocks: int
            ) -> dict[str, float]:
    """CPU milliseconds per block-port PUT at 1 client, per process (all its threads, Ray's
    included), beside the raw socket client's: where a put's work is on this machine."""
    import ray

    cluster = ctx.get_cluster()
    members = {"router": list(cluster.routers),
               "device": list(ray.get(cluster.router.devices.remote()).values()),
               "archive": list(ray.get(cluster.router.archives.remote()).values())}

    def cpu() -> dict[str, float]:
        # process_time in each actor's process: every thread, Ray's own included.
        out = {"gateway": time.process_time()}  # the gateway runs in this process
        for role, handles in members.items():
            out[role] = sum(ray.get([h.__ray_call__.remote(lambda _self: time.process_time())
                                     for h in handles]))
        return out

    params = {"url": ctx.get_gateway_url(), "layout": layout.to_dict(), "ops": puts,
              "op": "put", "session_blocks": session_blocks, "namespace": NAMESPACE,
              "block_port": True, "run": f"cpu-{uuid.uuid4().hex[:8]}"}
    drain_cold(ctx, [])
    before = cpu()
    runs = run_clients("gateway", params, 1)
    after = cpu()
    out = {role: MS * (after[role] - before[role]) / puts for role in before}
    out["client"] = MS * runs[0].cpu_s / puts
    with raw_socket_server(layout.block_nbytes()) as raw_port:
        raw = run_clients("raw", {"nbytes": layout.block_nbytes(), "ops": puts, "op": "put",
                                  "port": raw_port}, 1)
    out["raw socket client"] = MS * raw[0].cpu_s / puts
    return out


def memory_bytes(ctx: BenchContext) -> int:
    """Bytes the devices' memory tiers hold (hot and warm), from their stats."""
    import ray

    from memkv.protocol.stats import DeviceStats

    stats: list[DeviceStats] = ray.get(
        [d.stats.remote() for d in ctx.get_cluster().devices.values()])
    return sum(t.capacity_bytes or 0 for s in stats for name, t in s.tiers.items()
               if name in ("hot", "warm"))
