"""Demoting ahead: each memory tier keeps room free so that puts land without evicting."""

import pytest
import torch

from memkv.device.headroom import HeadroomKeeper
from memkv.protocol.enums import Tier
from memkv.protocol.hashing import chain_hashes
from memkv.router.sessions import SessionTable
from memkv.storage.block_pool import BlockPool
from memkv.storage.config import AllocatorConfig, ArchiveConfig, EvictionConfig, StoreConfig
from memkv.storage.layout import KVLayout, split_kv

from .test_store import kv

# One block = 4 KiB = one unit: the tiers' bytes count blocks exactly.
LAYOUT = KVLayout("headroom-model", num_layers=4, num_kv_heads=2, head_dim=16, block_tokens=8)
UNIT = 4096
TIER_BLOCKS = 16


def make_pool(tmp_path, headroom: float) -> BlockPool:
    assert LAYOUT.block_nbytes() == UNIT
    return BlockPool(StoreConfig(
        hot_capacity_bytes=TIER_BLOCKS * UNIT,
        warm_capacity_bytes=TIER_BLOCKS * UNIT,
        allocator=AllocatorConfig(min_unit_bytes=UNIT),
        archive=ArchiveConfig(directory=tmp_path / "cold", fsync="never"),
        eviction=EvictionConfig(headroom_fraction=headroom),
        debug_refcounts=True,
    ))


def put_session(pool, owner, sid, blocks, seed):
    """A session of ``blocks`` full blocks of its own tokens; its chain and KV."""
    tokens = blocks * LAYOUT.block_tokens
    owner.create(sid, LAYOUT, namespace="n")
    keys, values = kv(tokens, LAYOUT, seed=seed)
    chain = [bytes(k) for k in chain_hashes(range(seed * 10_000, seed * 10_000 + tokens),
                                            LAYOUT, "n")]
    update = owner.plan_append(sid, tokens, chain)
    expected = split_kv(LAYOUT, keys, values)
    pool.put(update, expected)
    owner.commit_append(sid, update)
    return chain, expected


def free_blocks(pool, tier):
    s = pool.stats().tiers[tier]
    return (s.capacity_bytes - s.used_bytes) // UNIT


def fill(pool, sessions, blocks_each):
    owner = SessionTable()
    return [put_session(pool, owner, f"s{i}", blocks_each, seed=i + 1) for i in range(sessions)]


def test_demoting_ahead_makes_the_headroom_and_every_block_reads_back_exactly(tmp_path):
    pool = make_pool(tmp_path, headroom=0.25)  # 4 of 16 blocks
    stored = fill(pool, sessions=8, blocks_each=2)  # hot full, nothing demoted yet
    assert free_blocks(pool, Tier.HOT) == 0 and pool.stats().demotions == 0
    assert pool.short_of_headroom()
    moved = 0
    while step := pool.demote_ahead(max_blocks=1):  # one block per pass, as asked
        assert step == 1
        moved += step
    assert moved == 4 and free_blocks(pool, Tier.HOT) == 4
    assert not pool.short_of_headroom()
    stats = pool.stats()
    assert stats.demotions_ahead == stats.demotions == 4
    assert stats.tiers[Tier.WARM].blocks == 4
    for chain, expected in stored:
        assert all(torch.equal(pool.get(k), e) for k, e in zip(chain, expected, strict=True))
    pool.close()


def test_a_put_into_the_headroom_evicts_nothing_on_its_way_in(tmp_path):
    pool = make_pool(tmp_path, headroom=0.25)
    owner = SessionTable()
    for i in range(8):
        put_session(pool, owner, f"s{i}", 2, seed=i + 1)
    while pool.demote_ahead(max_blocks=4):
        pass
    before = pool.stats().demotions
    put_session(pool, owner, "next", 2, seed=99)
    assert pool.stats().demotions == before  # landed in the room made ahead
    pool.close()


def test_the_headroom_is_the_largest_recent_put_within_half_the_tier(tmp_path):
    pool = make_pool(tmp_path, headroom=0.1)  # 1.6 blocks of share
    owner = SessionTable()
    for i, blocks in enumerate((5, 6, 5)):  # hot full
        put_session(pool, owner, f"s{i}", blocks, seed=i + 1)
    while pool.demote_ahead(max_blocks=4):
        pass
    assert free_blocks(pool, Tier.HOT) == 6  # room for the largest recent put...
    pool.close()

    pool = make_pool(tmp_path / "b", headroom=0.1)
    owner = SessionTable()
    put_session(pool, owner, "whole", 16, seed=3)
    while pool.demote_ahead(max_blocks=4):
        pass
    assert free_blocks(pool, Tier.HOT) == TIER_BLOCKS // 2  # ...but never more than half
    pool.close()


def test_no_headroom_demotes_only_on_demand(tmp_path):
    pool = make_pool(tmp_path, headroom=0.0)
    fill(pool, sessions=8, blocks_each=2)
    assert not pool.short_of_headroom() and pool.demote_ahead(max_blocks=8) == 0
    assert free_blocks(pool, Tier.HOT) == 0
    pool.close()


def test_blocks_being_read_are_not_demoted_ahead(tmp_path):
    pool = make_pool(tmp_path, headroom=0.25)
    stored = fill(pool, sessions=8, blocks_each=2)
    every = [k for chain, _ in stored for k in chain]
    pool.pin_blocks(every)  # a same-node reader holds them all
    assert pool.demote_ahead(max_blocks=4) == 0
    assert {pool.locate(k) for k in every} == {Tier.HOT}
    pool.unpin_blocks(every)
    assert pool.demote_ahead(max_blocks=4) == 4
    pool.close()


def test_the_keeper_makes_room_on_its_own_thread_after_a_nudge(tmp_path):
    pool = make_pool(tmp_path, headroom=0.25)
    keeper = HeadroomKeeper(pool, pass_blocks=1).start()
    try:
        stored = fill(pool, sessions=8, blocks_each=2)
        keeper.nudge()
        assert keeper.settled.wait(timeout=30)
        assert free_blocks(pool, Tier.HOT) == 4 and pool.stats().demotions_ahead == 4
        chain, expected = stored[0]
        assert all(torch.equal(pool.get(k), e) for k, e in zip(chain, expected, strict=True))
    finally:
        keeper.close()
        pool.close()


def test_the_keeper_stops_when_the_pool_closes_under_it(tmp_path):
    pool = make_pool(tmp_path, headroom=0.25)
    keeper = HeadroomKeeper(pool).start()
    pool.close()
    keeper.nudge()  # its next pass finds the pool closed and ends
    keeper._thread.join(timeout=30)
    assert not keeper._thread.is_alive()
    keeper.close()


@pytest.mark.parametrize("headroom", [-0.1, 1.0])
def test_a_headroom_outside_zero_to_one_is_refused(headroom):
    with pytest.raises(ValueError, match="headroom_fraction"):
        EvictionConfig(headroom_fraction=headroom)


def test_a_device_makes_the_room_after_the_put_that_took_it(tmp_path):
    """A device keeps its headroom by itself: no call but the puts."""
    from .test_store import LAYOUT as STORE_LAYOUT
    from .test_store import make_store

    store = make_store(tmp_path, hot_blocks=8, eviction=EvictionConfig(headroom_fraction=0.25))
    try:
        keeper = store.device.headroom
        assert keeper is not None
        for i in range(2):  # 2 sessions of 4 blocks: the hot tier full
            store.create_session(f"s{i}", STORE_LAYOUT, namespace=f"n{i}")
            store.put_kv(f"s{i}", list(range(16)), *kv(16, STORE_LAYOUT, seed=i))
        assert keeper.settled.wait(timeout=30)
        hot = store.device.pool.stats().tiers[Tier.HOT]
        assert hot.capacity_bytes - hot.used_bytes >= hot.capacity_bytes // 4
        assert store.device.stats().demotions_ahead >= 1
        for i in range(2):
            assert len(list(store.iter_session(f"s{i}"))) == 4  # every block still there
    finally:
        store.close()
