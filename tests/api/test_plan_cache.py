"""The gateway's held read plans: bounded in bytes, and never more than a share of a segment."""

from memkv.api.blocks import MAX_SEGMENT_SHARE, PlanCache
from memkv.protocol.messages import PlanEntry, ReadPlan

SEGMENT = 64 * 1024


def plan(lease, keys, *, nbytes=4096, segment="seg-hot", ttl=10.0):
    entries = tuple(
        PlanEntry(k, "hot", segment, SEGMENT, i * nbytes, nbytes, (1,), "float16", 0, True)
        for i, k in enumerate(keys)
    )
    return ReadPlan(lease, "dev", "node", "inc", ttl, entries)


def test_plans_over_a_segment_share_are_let_go_oldest_first():
    cache = PlanCache(ttl_s=10, margin_s=3, max_bytes=1 << 30)
    cap_blocks = int(SEGMENT * MAX_SEGMENT_SHARE) // 4096  # 4 of 16 blocks
    for i in range(cap_blocks):
        cache.hold(plan(f"l{i}", [bytes([i]) * 16]), None, {}, asked_at=1e12)
    assert cache.sweep() == []  # at the share: all kept
    cache.hold(plan("late", [b"\xff" * 16]), None, {}, asked_at=1e12)
    gone = cache.sweep()
    assert [g.plan.lease_id for g in gone] == ["l0"]  # the oldest goes, the newest stays
    assert cache.lookup("dev", b"\xff" * 16) is not None
    assert cache.lookup("dev", b"\x00" * 16) is None
    # Another segment has its own share.
    cache.hold(plan("warm", [b"\xee" * 16], segment="seg-warm"), None, {}, asked_at=1e12)
    assert cache.sweep() == []


def test_plans_are_let_go_when_their_use_time_is_over():
    cache = PlanCache(ttl_s=10, margin_s=3, max_bytes=1 << 30)
    cache.hold(plan("old", [b"\x01" * 16]), None, {}, asked_at=0.0)  # long ago
    assert [g.plan.lease_id for g in cache.sweep()] == ["old"]
    assert cache.held_bytes == 0
