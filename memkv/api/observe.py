"""The engine's own figures as Prometheus metrics, next to the gateway's.

``/metrics`` answers with two parts: what this gateway counted itself (requests,
latency per route, errors by type, payload bytes) and a snapshot of the whole
cluster (tiers, hits and misses, evictions, demotions, prefetch, dedup, lossy
conversions, leases, sessions, tenants, archives), made from the router's
``stats()`` — the same document ``/v1/stats`` serves. The snapshot is cached for
:data:`SNAPSHOT_TTL_S`, so scrapes from several Prometheus replicas (and the
status page's polling) cost the devices one stats call per interval.

Label sets are bounded: devices, tiers, archives and routes are fixed by the
deployment; tenants are the largest :data:`~memkv.router.state.STATS_TENANTS`
with the rest summed as ``(other)``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from memkv.protocol.stats import (
    ArchiveStats,
    ClusterStats,
    DeviceStats,
    RepairStats,
    TenantUse,
)

__all__ = ["SNAPSHOT_TTL_S", "StatsSnapshot", "engine_metrics"]

#: How long one stats snapshot serves scrapes and the status page.
SNAPSHOT_TTL_S = 2.0

_TIER_GAUGES = {
    "capacity_bytes": "Capacity of the tier, bytes (cold: the archive's budget, if any).",
    "used_bytes": "Bytes held in the tier.",
    "blocks": "Blocks held in the tier.",
    "fragmentation": "External fragmentation of the tier's arena (cold: dead/all bytes).",
}
_TIER_COUNTERS = {
    "hits": "Block reads served from the tier.",
    "evictions": "Blocks evicted (demoted) from the tier under pressure.",
}
_DEVICE_COUNTERS = {
    "misses": ("block_misses", "Block reads of keys in no tier."),
    "promotions": ("promotions", "Blocks copied up a tier for a read or a prefetch."),
    "demotions": ("demotions", "Blocks moved down a tier."),
    "demotions_ahead": (
        "demotions_ahead", "Of the demotions, those made ahead of puts (the tiers' headroom)."
    ),
    "prefetched": ("prefetch_issued", "Blocks promoted ahead of a read (prefetch)."),
    "prefetch_used": ("prefetch_used", "Prefetched blocks that were then read."),
    "dedup_hits": ("dedup_hits", "Blocks not stored again (another session holds them)."),
    "dedup_bytes_saved": ("dedup_bytes_saved", "Bytes not stored again, in the model dtype."),
    "lossy_conversions": ("lossy_conversions", "Demotions whose remaining copy is lossy."),
    "precision_fallbacks": (
        "precision_fallbacks", "Demotions that kept the model dtype (values out of range)."
    ),
    "cold_write_batches": ("cold_write_batches", "Cold-tier calls of the cold writer."),
    "cold_blocks_written": (
        "cold_blocks_written", "Blocks the cold writer wrote behind their demotions."
    ),
}


class StatsSnapshot:
    """The router's stats, fetched at most once per ``ttl_s`` (concurrent callers share it)."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[ClusterStats]],
        *,
        ttl_s: float = SNAPSHOT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._ttl_s = ttl_s
        self._clock = clock
        self._value: ClusterStats | None = None
        self._at = 0.0
        self._lock = asyncio.Lock()

    async def get(self) -> ClusterStats:
        async with self._lock:
            if self._value is None or self._clock() - self._at >= self._ttl_s:
                self._value = await self._fetch()
                self._at = self._clock()
            return self._value


class _Snapshot:
    """A prometheus_client collector over one stats document."""

    def __init__(self, stats: ClusterStats, *, tenants: bool = False) -> None:
        self._stats = stats
        self._with_tenants = tenants

    def collect(self) -> Iterator[Metric]:
        st = self._stats
        sessions = GaugeMetricFamily("memkv_sessions", "Sessions by state.", labels=["state"])
        for state, n in sorted(st.session_states.items()):
            sessions.add_metric([state], n)
        yield sessions
        priorities = GaugeMetricFamily(
            "memkv_sessions_by_priority", "Sessions by priority.", labels=["priority"]
        )
        for priority, n in sorted(st.session_priorities.items()):
            priorities.add_metric([priority], n)
        yield priorities
        yield GaugeMetricFamily(
            "memkv_logical_bytes", "KV bytes of every session's chain (shared blocks counted "
            "per session), model dtype.", value=st.logical_bytes
        )
        yield CounterMetricFamily(
            "memkv_background_prefetched", "Blocks the router's background prefetch promoted.",
            value=st.background_prefetched,
        )
        if st.repair is not None:
            yield from self._repair(st.repair)
        if self._with_tenants:
            yield from self._tenants(st.tenants)
        yield from self._devices(st.devices)
        yield from self._archives(st.archives)

    @staticmethod
    def _repair(r: RepairStats) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "memkv_cold_under_replicated_blocks",
            "Cold blocks on fewer live archives than archive.replicas, after the last repair.",
            value=r.under_replicated,
        )
        yield CounterMetricFamily(
            "memkv_cold_repaired_blocks", "Cold block copies made by replica repair.",
            value=r.repaired_blocks,
        )
        yield CounterMetricFamily(
            "memkv_cold_repaired_bytes", "Bytes copied by replica repair.",
            value=r.repaired_bytes,
        )
        yield GaugeMetricFamily(
            "memkv_archives_lost", "Archives whose node is gone.", value=len(r.lost_archives)
        )

    @staticmethod
    def _tenants(tenants: dict[str, TenantUse]) -> Iterator[Metric]:
        sessions = GaugeMetricFamily(
            "memkv_tenant_sessions", "Sessions per tenant (largest tenants; the rest as "
            "'(other)').", labels=["tenant"]
        )
        held = GaugeMetricFamily(
            "memkv_tenant_bytes", "KV bytes per tenant, model dtype.", labels=["tenant"]
        )
        for tenant, use in sorted(tenants.items()):
            name = tenant or "(unscoped)"
            sessions.add_metric([name], use.sessions)
            held.add_metric([name], use.bytes)
        yield sessions
        yield held

    @staticmethod
    def _devices(devices: dict[str, DeviceStats]) -> Iterator[Metric]:
        gauges = {
            k: GaugeMetricFamily(f"memkv_tier_{k}", doc, labels=["device", "tier"])
            for k, doc in _TIER_GAUGES.items()
        }
        counters = {
            k: CounterMetricFamily(f"memkv_tier_{k}", doc, labels=["device", "tier"])
            for k, doc in _TIER_COUNTERS.items()
        }
        per_device = {
            key: CounterMetricFamily(f"memkv_{name}", doc, labels=["device"])
            for key, (name, doc) in _DEVICE_COUNTERS.items()
        }
        accuracy = GaugeMetricFamily(
            "memkv_prefetch_accuracy", "Prefetched blocks read / prefetched blocks.",
            labels=["device"],
        )
        unique = GaugeMetricFamily(
            "memkv_unique_bytes", "Distinct blocks held, model dtype.", labels=["device"]
        )
        leases = GaugeMetricFamily(
            "memkv_leases_active", "Read plans pinning blocks now.", labels=["device"]
        )
        granted = CounterMetricFamily(
            "memkv_leases_granted", "Read plans granted (same-node reads).", labels=["device"]
        )
        expired = CounterMetricFamily(
            "memkv_leases_expired", "Read plans that ran out before release.", labels=["device"]
        )
        reservations = GaugeMetricFamily(
            "memkv_reservations_active", "Write reservations waiting for their append.",
            labels=["device"],
        )
        reserved = {
            "granted": CounterMetricFamily(
                "memkv_reservations_granted", "Write reservations granted (same-host saves).",
                labels=["device"]),
            "expired": CounterMetricFamily(
                "memkv_reservations_expired", "Write reservations that ran out unused.",
                labels=["device"]),
            "adopted_slots": CounterMetricFamily(
                "memkv_reserved_slots_adopted", "Reserved slots stored as blocks where the "
                "writer filled them (no copy).", labels=["device"]),
        }
        kernels = GaugeMetricFamily(
            "memkv_kernels_backend", "Where the device's conversion and copy kernels run "
            "(cuda, or cpu: the reference).", labels=["device", "backend"],
        )
        for device, st in sorted(devices.items()):
            kernels.add_metric([device, st.kernels], 1)
            for tier, t in sorted(st.tiers.items()):
                for k, gauge in gauges.items():
                    value = getattr(t, k)
                    if value is not None:
                        gauge.add_metric([device, tier], value)
                for k, counter in counters.items():
                    counter.add_metric([device, tier], getattr(t, k))
            for key, counter in per_device.items():
                counter.add_metric([device], getattr(st, key))
            if st.prefetch_accuracy is not None:
                accuracy.add_metric([device], st.prefetch_accuracy)
            unique.add_metric([device], st.unique_bytes)
            leases.add_metric([device], st.leases.active)
            granted.add_metric([device], st.leases.granted)
            expired.add_metric([device], st.leases.expired)
            reservations.add_metric([device], st.reservations.active)
            for key, family in reserved.items():
                family.add_metric([device], getattr(st.reservations, key))
        yield from gauges.values()
        yield from counters.values()
        yield from per_device.values()
        yield from (accuracy, unique, leases, granted, expired, reservations, kernels)
        yield from reserved.values()

    @staticmethod
    def _archives(archives: dict[str, ArchiveStats]) -> Iterator[Metric]:
        docs = {
            "blocks": "Blocks in the archive (cold tier).",
            "live_bytes": "Bytes of live records on disk.",
            "dead_bytes": "Bytes of dead records awaiting compaction.",
            "bytes_on_disk": "Bytes of the archive's segment files.",
            "corrupt_records": "Records that failed their checksum (never served).",
            "refused_writes": "Writes refused for want of room (disk full or "
            "archive.capacity_bytes reached; the copy went to another archive).",
            # Disk pressure: alert on room_bytes, not on the disk's own free space
            # (a budget can run out first).
            "room_bytes": "Bytes the archive can still take: the smaller of its disk's "
            "free bytes and what is left of archive.capacity_bytes.",
            "disk_free_bytes": "Free bytes of the disk the archive writes to.",
            "capacity_bytes": "archive.capacity_bytes (absent: limited by the disk).",
        }
        families = {
            k: GaugeMetricFamily(f"memkv_archive_{k}", doc, labels=["archive"])
            for k, doc in docs.items()
        }
        for archive, st in sorted(archives.items()):
            for k, family in families.items():
                value = getattr(st, k)
                if value is not None:  # unknown, or no budget: no sample
                    family.add_metric([archive], value)
        yield from families.values()


def engine_metrics(stats: ClusterStats, *, tenants: bool = False) -> bytes:
    """The Prometheus text of the cluster's figures; ``tenants``: with the
    per-tenant series (for a caller allowed to see every tenant's use)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats, tenants=tenants))
    return bytes(generate_latest(registry))
