"""Which router shard owns a session: stable, spread, named."""

import zlib
from collections import Counter

import msgspec
import pytest

from memkv.actors.router_shards import (
    RouterShards,
    merge_created,
    merge_located,
    merge_prefix,
    merge_stats,
)
from memkv.protocol.enums import AckMode, Priority, SessionState
from memkv.protocol.layout import KVLayout
from memkv.protocol.messages import PrefixMatch
from memkv.protocol.services import LayoutSpec, SessionView, SessionViews
from memkv.protocol.shards import shard_name, shard_of, shard_owner
from memkv.protocol.stats import ClusterStats, DeviceStats, TenantUse

LAYOUT = KVLayout("shard-test", 2, 2, 8, block_tokens=4)


def test_the_owner_is_a_stable_hash_of_the_id():
    # CRC32 of the UTF-8 id: the same in every process and Python version.
    for sid in ("a", "tenant/x", "ümlaut-session"):
        assert shard_of(sid, 3) == zlib.crc32(sid.encode()) % 3
    assert shard_of("anything", 1) == 0
    # Pinned: a change of the hash would move every deployment's sessions.
    assert [shard_of(s, 4) for s in ("tenant/x", "agent-7/session-1", "agent-7/session-2")] \
        == [1, 1, 3]


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_ids_spread_evenly_over_the_shards(shards):
    counts = Counter(shard_of(f"fleet-{i:06d}", shards) for i in range(20_000))
    assert set(counts) == set(range(shards))
    expected = 20_000 / shards
    assert all(abs(n - expected) < 0.1 * expected for n in counts.values()), counts


def test_shard_zero_keeps_the_routers_name():
    assert shard_name("memkv-router", 0) == "memkv-router"
    assert shard_name("memkv-router", 3) == "memkv-router-3"
    assert shard_owner(0, 1) == "" and shard_owner(2, 4) == "shard-2"


def test_a_client_sends_each_session_to_its_owner():
    routers = RouterShards(["r0", "r1", "r2"])
    sids = [f"s{i}" for i in range(30)]
    groups = routers.split(sids)
    assert sorted(i for at in groups.values() for i in at) == list(range(30))
    for shard, at in groups.items():
        assert all(routers.of(sids[i]) == f"r{shard}" for i in at)
    with pytest.raises(ValueError):
        RouterShards([])


def test_answers_of_all_shards_merge_into_one():
    a, b, c = (SessionView(
        session_id=sid, namespace="n", layout=LayoutSpec.of(LAYOUT), priority=Priority.NORMAL,
        device_id=None, chain=(), tokens=0, turn=0, state=SessionState.ACTIVE,
        ack=AckMode.MEMORY, exact_only=False, finite_only=False, archived=False, hotness=0.0,
    ) for sid in "abc")
    assert merge_created([[0, 2], [1]], [SessionViews(sessions=(a, c)),
                                          SessionViews(sessions=(b,))]) == [a, b, c]
    assert merge_prefix([PrefixMatch(4, (b"x",)), PrefixMatch(8, (b"x", b"y"))]) \
        == PrefixMatch(8, (b"x", b"y"))
    located = merge_located([
        [("dev-0", "h0", [b"k1", b"k2"])],
        [("dev-0", "h0", [b"k2", b"k3"]), ("dev-1", "h1", [b"k1", b"k4"])],
    ])
    assert located == [("dev-0", "h0", [b"k1", b"k2", b"k3"]), ("dev-1", "h1", [b"k4"])]
    device = DeviceStats(tiers={}, blocks=1, unique_bytes=0, dedup_hits=0, dedup_bytes_saved=0,
                         misses=0, promotions=0, demotions=0, prefetched=0, prefetch_used=0,
                         precision_fallbacks=0)
    part = ClusterStats(sessions=2, logical_bytes=10, session_states={"active": 2},
                        session_priorities={"normal": 2}, background_prefetched=1,
                        tenants={"t": TenantUse(sessions=2, bytes=10)}, devices={"d": device},
                        shard=0, shards=2)
    other = msgspec.structs.replace(part, devices={}, sessions=3, shard=1)
    merged = merge_stats([part, other])
    assert merged.sessions == 5 and merged.shard_sessions == [2, 3] and merged.shard is None
    assert merged.session_states == {"active": 4}
    assert merged.tenants == {"t": TenantUse(sessions=4, bytes=20)}
    assert merged.devices == {"d": device} and merged.logical_bytes == 20
