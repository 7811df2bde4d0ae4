"""The block pool on its own, driven the way its owner drives it: durable puts and resync."""

import zlib

import pytest
import torch

from memkv.errors import InvalidInputError, UnknownBlockError
from memkv.protocol.enums import Priority, Tier
from memkv.protocol.hashing import BlockHash, chain_hashes
from memkv.protocol.members import Holder
from memkv.router.sessions import SessionTable
from memkv.storage import pool_refs
from memkv.storage.block_pool import BlockPool
from memkv.storage.config import AllocatorConfig, ArchiveConfig, EvictionConfig, StoreConfig
from memkv.storage.layout import KVLayout, block_token_count, split_kv
from memkv.storage.pool_core import COPY_CRC_CHUNK_BYTES, _copy_crc32

from .test_store import kv

LAYOUT = KVLayout("pool-model", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
UNIT = 4096


def make_pool(tmp_path, fsync="never"):
    cfg = StoreConfig(
        hot_capacity_bytes=8 * UNIT,
        warm_capacity_bytes=8 * UNIT,
        allocator=AllocatorConfig(min_unit_bytes=UNIT),
        archive=ArchiveConfig(directory=tmp_path / "cold", fsync=fsync),
        debug_refcounts=True,
    )
    return BlockPool(cfg)


def append(pool, owner, sid, tokens, seed=0, durable=False):
    keys, values = kv(tokens, LAYOUT, seed=seed)
    chain = [bytes(k) for k in chain_hashes(range(tokens), LAYOUT, owner.get(sid).namespace)]
    update = owner.plan_append(sid, tokens, chain)
    outcome = pool.put(update, split_kv(LAYOUT, keys, values), durable=durable)
    owner.commit_append(sid, update)
    return chain, outcome


def test_a_durable_put_returns_with_every_block_forced_to_the_cold_tier(tmp_path, monkeypatch):
    pool = make_pool(tmp_path, fsync="batch")
    owner = SessionTable()
    owner.create("fast", LAYOUT, namespace="a")
    owner.create("safe", LAYOUT, namespace="a", durable=True)
    synced = []
    disk = pool.cold.backend  # the segment files behind the cold writer
    real = disk.sync
    monkeypatch.setattr(disk, "sync", lambda: synced.append(1) or real())
    fast, _ = append(pool, owner, "fast", 8)
    assert pool.cold.missing(fast) == fast  # in memory only
    assert synced == []
    safe, outcome = append(pool, owner, "safe", 8, durable=True)
    assert safe == fast and outcome.deduplicated_blocks == 2  # shared, made durable anyway
    assert pool.cold.missing(safe) == [] and synced
    assert pool.locate(safe[0]) is Tier.HOT  # still served from memory
    pool.close()


def test_resync_sets_references_from_the_owners_table(tmp_path):
    pool = make_pool(tmp_path)
    owner = SessionTable()
    owner.create("a", LAYOUT, namespace="n")
    owner.create("b", LAYOUT, namespace="n")
    chain_a, _ = append(pool, owner, "a", 8)
    chain_b, _ = append(pool, owner, "b", 12)  # shares a's two blocks
    pool.deactivate(chain_b)  # b suspended: its blocks go cold
    # The owner restarted and forgot b's last append: it believes b holds a 1-block chain.
    counts = block_token_count(LAYOUT, 8)
    holders = [
        Holder(LAYOUT, chain_a, counts, True, Priority.NORMAL),
        Holder(LAYOUT, chain_b[:1], counts[:1], False, Priority.NORMAL),
        Holder(LAYOUT, [b"\x07" * 16], [4], True, Priority.NORMAL),  # in no tier
    ]
    assert pool.resync(holders) == [2]
    assert pool.refcounts()[chain_a[0]][0] == 2 and pool.refcounts()[chain_a[1]][0] == 1
    with pytest.raises(UnknownBlockError):
        pool.get(chain_b[2])  # b's third block: nobody holds it, freed
    pool.check_invariants({"a": chain_a, "b": chain_b[:1]})
    pool.close()


def test_resync_adopts_blocks_that_are_only_in_the_cold_tier(tmp_path):
    pool = make_pool(tmp_path)
    owner = SessionTable()
    owner.create("a", LAYOUT, namespace="n")
    chain, _ = append(pool, owner, "a", 8)
    pool.deactivate(chain)
    pool.close()
    fresh = make_pool(tmp_path)  # a new device process: memory empty, cold tier kept
    counts = block_token_count(LAYOUT, 8)
    assert fresh.resync([Holder(LAYOUT, chain, counts, False, Priority.HIGH)]) == []
    expected = split_kv(LAYOUT, *kv(8, LAYOUT))
    assert all(torch.equal(fresh.get(k), e) for k, e in zip(chain, expected, strict=True))
    fresh.close()


def test_put_refuses_what_does_not_fit_the_update(tmp_path):
    pool = make_pool(tmp_path)
    owner = SessionTable()
    owner.create("a", LAYOUT, namespace="n")
    chain = [bytes(k) for k in chain_hashes(range(8), LAYOUT, "n")]
    update = owner.plan_append("a", 8, chain, start_block=1)
    with pytest.raises(InvalidInputError, match="not sent and is not stored"):
        pool.put(update, split_kv(LAYOUT, *kv(8, LAYOUT))[1:])
    with pytest.raises(InvalidInputError, match="expected 1 blocks"):
        pool.put(update, split_kv(LAYOUT, *kv(8, LAYOUT)))
    assert pool.stats().blocks == 0
    pool.close()


def test_a_block_larger_than_a_tier_lives_one_tier_down(tmp_path):
    big = KVLayout("big-model", num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=32)
    pool = make_pool(tmp_path)  # hot and warm: 32 KiB each, 4 KiB units
    owner = SessionTable()
    owner.create("a", big, namespace="n")
    keys, values = kv(64, big)
    chain = [bytes(k) for k in chain_hashes(range(64), big, "n")]
    assert big.block_nbytes() > pool.stats().tiers[Tier.HOT].capacity_bytes
    pool.put(owner.plan_append("a", 64, chain), split_kv(big, keys, values))
    assert {pool.locate(k) for k in chain} == {Tier.COLD}
    expected = split_kv(big, keys, values)
    assert all(torch.equal(pool.get(k), e) for k, e in zip(chain, expected, strict=True))
    pool.close()


def test_each_owner_resyncs_only_its_own_references(tmp_path):
    # Two router shards' sessions share a prefix on one pool; the first shard
    # restarts and resyncs from its table: the second shard's holds stay.
    pool = make_pool(tmp_path)
    shard_0, shard_1 = SessionTable(), SessionTable()
    shard_0.create("a", LAYOUT, namespace="n")
    shard_1.create("b", LAYOUT, namespace="n")
    keys, values = kv(12, LAYOUT, seed=0)
    blocks = split_kv(LAYOUT, keys, values)
    chain = [bytes(k) for k in chain_hashes(range(12), LAYOUT, "n")]
    update_a = shard_0.plan_append("a", 8, chain[:2])
    pool.put(update_a, blocks[:2], owner="shard-0")
    shard_0.commit_append("a", update_a)
    update_b = shard_1.plan_append("b", 12, chain)
    pool.put(update_b, blocks, owner="shard-1")  # a's two blocks deduplicated
    shard_1.commit_append("b", update_b)
    # Shard 0 forgot its session (it died before recording it): its table is empty.
    assert pool.resync([], owner="shard-0") == []
    assert [pool.refcounts()[k][0] for k in chain] == [1, 1, 1]
    assert all(torch.equal(pool.get(k), b) for k, b in zip(chain, blocks, strict=True))
    pool.check_invariants({"b": chain})
    # Shard 1 resyncs with a shorter chain: only its third block goes.
    counts = block_token_count(LAYOUT, 8)
    assert pool.resync([Holder(LAYOUT, chain[:2], counts, True, Priority.NORMAL)],
                       owner="shard-1") == []
    with pytest.raises(UnknownBlockError):
        pool.get(chain[2])
    pool.release(chain[:2], active=True, owner="shard-1")
    assert pool.refcounts() == {}
    pool.close()


def test_a_miscounted_last_release_leaves_no_share_behind(tmp_path):
    # A suspend the pool applied but its owner never recorded (the cold write after
    # it failed): the owner then deletes the session as active. The block is freed
    # with its active count off by one; stored again, it must start from zero.
    pool = make_pool(tmp_path)
    owner = SessionTable()
    owner.create("a", LAYOUT, namespace="n")
    chain, _ = append(pool, owner, "a", 4)
    pool.deactivate(chain)
    pool.release(chain, active=True, owner="")  # the owner still had it active
    assert pool.refcounts() == {}
    owner.create("b", LAYOUT, namespace="n")  # the same tokens: the same block again
    again, _ = append(pool, owner, "b", 4)
    assert again == chain
    pool.check_invariants({"b": chain})
    pool.close()


def test_a_resync_that_fails_halfway_changes_nothing(tmp_path, monkeypatch):
    pool = make_pool(tmp_path)
    owner = SessionTable()
    owner.create("a", LAYOUT, namespace="n")
    owner.create("b", LAYOUT, namespace="n")
    chain_a, _ = append(pool, owner, "a", 8)
    chain_b, _ = append(pool, owner, "b", 12)
    before = pool.refcounts()
    holders = [
        Holder(LAYOUT, chain_a, block_token_count(LAYOUT, 8), True, Priority.NORMAL),
        Holder(LAYOUT, chain_b, block_token_count(LAYOUT, 12), True, Priority.NORMAL),
    ]
    real, calls = pool.references.hold_chain, []

    def fails_on_the_second(*args, **kwargs):
        if calls:
            raise RuntimeError("the second holder's blocks could not be held")
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pool.references, "hold_chain", fails_on_the_second)
    with pytest.raises(RuntimeError):
        pool.resync(holders)
    assert pool.refcounts() == before
    pool.check_invariants({"a": chain_a, "b": chain_b})
    monkeypatch.undo()
    assert pool.resync(holders) == []
    pool.check_invariants({"a": chain_a, "b": chain_b})
    pool.close()


def _crc_of(block: torch.Tensor) -> int:
    return zlib.crc32(block.contiguous().view(torch.uint8).numpy().tobytes()
                      if block.dtype is not torch.bfloat16
                      else block.view(torch.int16).numpy().tobytes())


# 16 KiB blocks: larger than a hot tier of one unit, so they are admitted to the warm one.
WIDE = KVLayout("wide-model", num_layers=4, num_kv_heads=2, head_dim=32, block_tokens=8,
                dtype="float32")


@pytest.mark.parametrize("hot_units, tier", [(16, Tier.HOT), (1, Tier.WARM)],
                         ids=["into hot", "past hot, into warm"])
def test_a_block_stored_without_a_checksum_gets_the_crc32_of_its_bytes_as_it_is_copied(
        tmp_path, monkeypatch, hot_units, tier):
    separate = []  # checksums made in a pass of their own, not with the copy
    monkeypatch.setattr(pool_refs, "_writer_crc32", lambda b: separate.append(b) or 0)
    pool = BlockPool(StoreConfig(
        hot_capacity_bytes=hot_units * UNIT, warm_capacity_bytes=8 * UNIT,
        allocator=AllocatorConfig(min_unit_bytes=UNIT),
        archive=ArchiveConfig(directory=tmp_path / "cold", fsync="never"),
        eviction=EvictionConfig(headroom_fraction=0.0),
        debug_refcounts=True,
    ))
    owner = SessionTable()
    owner.create("s", WIDE, namespace="n")
    keys, values = kv(16, WIDE, seed=11)
    chain = [bytes(k) for k in chain_hashes(range(16), WIDE, "n")]
    blocks = split_kv(WIDE, keys, values)
    assert WIDE.block_nbytes() == 4 * UNIT
    pool.put(owner.plan_append("s", 16, chain), blocks)
    for key, block in zip(chain, blocks, strict=True):
        assert pool.locate(key) is tier
        assert pool.table[BlockHash(key)].crc32 == _crc_of(block)
        assert torch.equal(pool.get(key), block)
    assert separate == []
    pool.close()


def test_the_checksummed_copy_matches_a_plain_checksum_at_any_length():
    for nbytes in (1, COPY_CRC_CHUNK_BYTES - 2, COPY_CRC_CHUNK_BYTES, 3 * COPY_CRC_CHUNK_BYTES + 6):
        src = torch.randint(-100, 100, (nbytes // 2 or 1,), dtype=torch.int16).to(torch.bfloat16)
        dst = torch.empty_like(src)
        assert _copy_crc32(dst, src) == _crc_of(src)
        assert torch.equal(dst.view(torch.int16), src.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_block_copied_into_gpu_memory_without_a_checksum_gets_the_crc32_of_its_bytes(
        tmp_path):
    pool = BlockPool(StoreConfig(
        device="cuda:0", hot_capacity_bytes=16 * UNIT, warm_capacity_bytes=8 * UNIT,
        allocator=AllocatorConfig(min_unit_bytes=UNIT),
        archive=ArchiveConfig(directory=tmp_path / "cold", fsync="never"),
        eviction=EvictionConfig(headroom_fraction=0.0),
    ))
    owner = SessionTable()
    owner.create("s", WIDE, namespace="n")
    keys, values = kv(16, WIDE, seed=12)
    chain = [bytes(k) for k in chain_hashes(range(16), WIDE, "n")]
    blocks = split_kv(WIDE, keys, values)
    pool.put(owner.plan_append("s", 16, chain), blocks)
    for key, block in zip(chain, blocks, strict=True):
        assert pool.locate(key) is Tier.HOT
        assert pool.table[BlockHash(key)].crc32 == _crc_of(block)
        assert torch.equal(pool.get(key).cpu(), block)
    pool.close()
