"""The block pool's parts on their own: the tier ladder over the list of memory tiers
it is given, the block table's owner shares."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from memkv.errors import InvariantViolationError
from memkv.protocol.enums import Priority, Tier
from memkv.protocol.hashing import BlockHash
from memkv.storage.block_table import BlockTable
from memkv.storage.config import AllocatorConfig, ArchiveConfig, StoreConfig
from memkv.storage.layout import KVLayout
from memkv.storage.pool_core import _Block, raise_invariant
from memkv.storage.pool_ladder import TierLadder
from memkv.storage.shm_arena import SharedHostArena
from memkv.storage.tiers import ColdTier, MemoryTier

LAYOUT = KVLayout("ladder-model", num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=4,
                  dtype="float32")
UNIT = 4096


def _entry(i: int) -> _Block:
    return _Block(BlockHash(bytes([i]) * 16), None, LAYOUT, 4, Priority.NORMAL, last_access=0.0)


def _block(i: int) -> torch.Tensor:
    return torch.full(LAYOUT.block_shape(), float(i))


def test_a_ladder_of_one_memory_tier_demotes_straight_to_cold(tmp_path):
    config = StoreConfig(hot_capacity_bytes=2 * UNIT, warm_capacity_bytes=2 * UNIT,
                         allocator=AllocatorConfig(min_unit_bytes=UNIT),
                         archive=ArchiveConfig(directory=tmp_path / "cold", fsync="never"))
    hot = MemoryTier(Tier.HOT, SharedHostArena(4 * UNIT, UNIT), config.eviction)  # 2 blocks
    cold = ColdTier(config.archive, config.codecs, None)
    table, counters = BlockTable("epoch"), Counter[str]()
    ladder = TierLadder(config, table, [hot], cold, counters)
    try:
        entries = [_entry(i) for i in range(3)]
        for i, entry in enumerate(entries):
            table.add(entry)
            ladder.admit(entry, _block(i), now=float(i))
        # Two fit; the third pushed the oldest down to the tier after the last memory one.
        assert [e.tier for e in entries] == [None, Tier.HOT, Tier.HOT]
        assert entries[0].in_cold and counters["demotions"] == 1
        assert torch.equal(ladder.materialize(entries[0]), _block(0))
        assert ladder.promote(entries[0], _block(0), now=3.0)  # back to the top, another down
        assert entries[0].tier is Tier.HOT and sum(e.tier is None for e in entries) == 1
        ladder.free(entries[1])
        assert entries[1].key not in table and entries[1].key not in hot
    finally:
        hot.close()
        cold.close()


def test_the_tables_owner_shares_must_add_up():
    table = BlockTable("epoch")
    entry = _entry(1)
    table.add(entry)
    table.hold(entry, active=True, exact_only=False, owner="shard-0")
    table.check_shares(raise_invariant)
    entry.refcount += 1  # a reference no owner counted
    with pytest.raises(InvariantViolationError, match="do not add up"):
        table.check_shares(raise_invariant)
    table.drop(entry.key)  # its shares go with it
    table.check_shares(raise_invariant)
    assert list(table.events_since(0, "epoch").removed) == [entry.key]
