"""Engine metrics: the router's stats as Prometheus families, bounded labels, one fetch per TTL."""

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from memkv.api.observe import StatsSnapshot, engine_metrics
from memkv.protocol.stats import TenantUse, cluster_stats
from memkv.router.state import OTHER_TENANTS, STATS_TENANTS, RouterState

STATS = {
    "sessions": 3,
    "logical_bytes": 4096,
    "session_states": {"active": 2, "suspended": 1},
    "session_priorities": {"high": 1, "normal": 2},
    "tenants": {"acme": {"sessions": 2, "bytes": 3000}, "": {"sessions": 1, "bytes": 1096}},
    "background_prefetched": 5,
    "devices": {
        "dev-0": {
            "tiers": {
                "hot": {"capacity_bytes": 100, "used_bytes": 40, "blocks": 4, "hits": 10,
                        "evictions": 2, "fragmentation": 0.0},
                "warm": {"capacity_bytes": 200, "used_bytes": 20, "blocks": 2, "hits": 3,
                         "evictions": 1, "fragmentation": 0.1},
                "cold": {"capacity_bytes": None, "used_bytes": 80, "blocks": 8, "hits": 1,
                         "evictions": 0, "fragmentation": 0.5},
            },
            "misses": 4, "promotions": 6, "demotions": 3, "prefetched": 8, "prefetch_used": 6,
            "dedup_hits": 7, "dedup_bytes_saved": 700, "lossy_conversions": 2,
            "precision_fallbacks": 1, "unique_bytes": 140, "blocks": 14,
            "cold_write_batches": 2, "cold_blocks_written": 5,
            "leases": {"active": 1, "granted": 9, "expired": 0},
            "reservations": {"active": 0, "granted": 3, "expired": 1, "adopted_slots": 40},
            "kernels": "cpu",
        }
    },
    "archives": {"arc-0": {"blocks": 8, "live_bytes": 80, "dead_bytes": 40,
                           "bytes_on_disk": 130, "corrupt_records": 0},
                 # Disk pressure: a budget of 1000 with 130 used, 5000 free on the disk.
                 "arc-1": {"blocks": 1, "live_bytes": 10, "dead_bytes": 0,
                           "bytes_on_disk": 130, "capacity_bytes": 1000,
                           "disk_free_bytes": 5000, "refused_writes": 3}},
}


def samples(text):
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_engine_figures_become_metrics():
    got = samples(engine_metrics(cluster_stats(STATS), tenants=True))
    assert got[("memkv_sessions", (("state", "active"),))] == 2
    assert got[("memkv_sessions_by_priority", (("priority", "high"),))] == 1
    assert got[("memkv_tier_used_bytes", (("device", "dev-0"), ("tier", "hot")))] == 40
    assert got[("memkv_tier_hits_total", (("device", "dev-0"), ("tier", "cold")))] == 1
    assert got[("memkv_tier_evictions_total", (("device", "dev-0"), ("tier", "hot")))] == 2
    # No capacity for the cold tier: no sample rather than a made-up one.
    assert ("memkv_tier_capacity_bytes", (("device", "dev-0"), ("tier", "cold"))) not in got
    device = (("device", "dev-0"),)
    assert got[("memkv_block_misses_total", device)] == 4
    assert got[("memkv_prefetch_issued_total", device)] == 8
    assert got[("memkv_prefetch_accuracy", device)] == 0.75
    assert got[("memkv_dedup_bytes_saved_total", device)] == 700
    assert got[("memkv_lossy_conversions_total", device)] == 2
    assert got[("memkv_cold_blocks_written_total", device)] == 5
    assert got[("memkv_leases_granted_total", device)] == 9
    assert got[("memkv_reservations_expired_total", device)] == 1
    assert got[("memkv_reserved_slots_adopted_total", device)] == 40
    assert got[("memkv_kernels_backend", (("backend", "cpu"), ("device", "dev-0")))] == 1
    assert got[("memkv_tenant_bytes", (("tenant", "acme"),))] == 3000
    assert got[("memkv_tenant_sessions", (("tenant", "(unscoped)"),))] == 1
    assert got[("memkv_archive_dead_bytes", (("archive", "arc-0"),))] == 40
    # Room is the smaller of the disk's and the budget's; unknown room has no sample.
    assert got[("memkv_archive_room_bytes", (("archive", "arc-1"),))] == 870
    assert got[("memkv_archive_refused_writes", (("archive", "arc-1"),))] == 3
    assert ("memkv_archive_room_bytes", (("archive", "arc-0"),)) not in got
    assert got[("memkv_background_prefetched_total", ())] == 5
    # Without leave to see tenants (the open endpoint): no series names one.
    open_endpoint = samples(engine_metrics(cluster_stats(STATS)))
    assert not any(name.startswith("memkv_tenant") for name, _ in open_endpoint)


def test_a_figure_renamed_at_its_source_fails_loudly_instead_of_reading_zero():
    import copy

    import pytest

    from memkv.errors import InvalidInputError

    renamed = copy.deepcopy(STATS)
    renamed["devices"]["dev-0"]["block_misses"] = renamed["devices"]["dev-0"].pop("misses")
    with pytest.raises(InvalidInputError, match="missing required field `misses`"):
        engine_metrics(cluster_stats(renamed))


def test_tenant_labels_are_bounded():
    state = RouterState()
    for i in range(STATS_TENANTS + 5):
        state.tenant_sessions[f"t{i:02d}"] = 1
        state.tenant_bytes[f"t{i:02d}"] = 1000 - i
    usage = state.tenant_usage()
    assert len(usage) == STATS_TENANTS + 1
    assert usage[OTHER_TENANTS] == TenantUse(sessions=5, bytes=sum(1000 - i for i in range(20, 25)))
    assert "t00" in usage and "t24" not in usage


def test_a_snapshot_is_fetched_once_per_ttl():
    now = [0.0]
    calls = []

    async def fetch():
        calls.append(now[0])
        await asyncio.sleep(0)
        return {"n": len(calls)}

    snap = StatsSnapshot(fetch, ttl_s=2.0, clock=lambda: now[0])

    async def scenario():
        first = await asyncio.gather(*(snap.get() for _ in range(5)))  # concurrent scrapes
        now[0] = 1.0
        same = await snap.get()
        now[0] = 2.5
        fresh = await snap.get()
        return first, same, fresh

    first, same, fresh = asyncio.run(scenario())
    assert [f["n"] for f in first] == [1] * 5 and same["n"] == 1 and fresh["n"] == 2
    assert calls == [0.0, 2.5]
