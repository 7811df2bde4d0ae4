import hashlib
import shutil

import msgpack
import pytest
import torch

from memkv.errors import (
    BlockLostError,
    CapacityError,
    ClosedError,
    CorruptDataError,
    InvalidInputError,
    LayoutMismatchError,
    UnknownBlockError,
    UnknownSessionError,
)
from memkv.protocol.enums import Priority, SessionState, Tier
from memkv.protocol.hashing import HASH_BYTES
from memkv.router.suspended import SuspendedSessions
from memkv.storage.config import (
    AllocatorConfig,
    ArchiveConfig,
    CodecConfig,
    EvictionConfig,
    PrecisionConfig,
    StoreConfig,
)
from memkv.storage.layout import KVLayout, join_blocks, split_kv
from memkv.storage.segments import SegmentStore
from memkv.store import TieredStore

from ..kvdata import random_kv

UNIT = 4096
LAYOUT = KVLayout("test-model", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
BLOCK_BYTES = LAYOUT.block_nbytes()  # 512 bytes: 8 blocks per 4 KiB unit


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def make_store(tmp_path, hot_blocks=16, warm_blocks=16, clock=None, **kw):
    cfg = dict(
        hot_capacity_bytes=hot_blocks * BLOCK_BYTES,
        warm_capacity_bytes=warm_blocks * BLOCK_BYTES,
        allocator=AllocatorConfig(min_unit_bytes=UNIT),
        archive=ArchiveConfig(directory=tmp_path / "cold", fsync="never"),
        debug_refcounts=True,
        # These tests place blocks tier by tier: no demoting ahead on a thread of its
        # own (tests/storage/test_headroom.py tests that).
        eviction=EvictionConfig(headroom_fraction=0.0),
    )
    cfg.update(kw)
    return TieredStore(StoreConfig(**cfg), clock=clock or FakeClock())


def kv(tokens, layout=LAYOUT, seed=0):
    return random_kv(layout, tokens, seed)


def read_all(store, sid):
    return [b for _, b in store.read_session(sid)]


def assert_same_kv(layout, blocks, keys, values):
    k2, v2 = join_blocks(layout, blocks)
    for a, b in zip(keys + values, k2 + v2, strict=True):
        assert torch.equal(a, b)


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path)
    yield s
    s.close()


def test_put_get_round_trip(store):
    store.create_session("s", LAYOUT, namespace="t")
    keys, values = kv(10)
    result = store.put_kv("s", list(range(10)), keys, values)
    assert result.new_blocks == 3 and result.deduplicated_blocks == 0
    info = store.session("s")
    assert info.tokens == 10 and info.turn == 1 and len(info.chain) == 3
    assert all(store.locate(k) is Tier.HOT for k in info.chain)
    blocks = [store.get(k) for k in info.chain]
    assert_same_kv(LAYOUT, blocks, keys, values)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_other_model_dtypes_round_trip_through_every_tier(tmp_path, dtype):
    layout = KVLayout("m", 2, 2, 8, dtype=dtype, block_tokens=4)
    # One unit per memory tier (4-8 blocks): most of the 40 blocks go to the cold tier.
    s = make_store(tmp_path, hot_capacity_bytes=UNIT, warm_capacity_bytes=UNIT)
    s.create_session("s", layout)
    keys, values = kv(160, layout)
    s.put_kv("s", list(range(160)), keys, values)
    tiers = {s.locate(k) for k in s.session("s").chain}
    assert Tier.COLD in tiers
    # First-round blocks keep the model dtype in every tier: lossless.
    assert_same_kv(layout, read_all(s, "s"), keys, values)
    s.close()


def test_shared_prefix_is_stored_once_and_refcounted(store):
    keys, values = kv(12)
    for sid in ("a", "b"):
        store.create_session(sid, LAYOUT, namespace="t")
    store.put_kv("a", list(range(12)), keys, values)
    # b shares the first 8 tokens (2 blocks), then diverges.
    k2, v2 = kv(12, seed=1)
    k2 = [torch.cat([k[:, :8], x[:, 8:]], dim=1) for k, x in zip(keys, k2, strict=True)]
    v2 = [torch.cat([v[:, :8], x[:, 8:]], dim=1) for v, x in zip(values, v2, strict=True)]
    tokens_b = list(range(8)) + [100, 101, 102, 103]
    r = store.put_kv("b", tokens_b, k2, v2)
    assert (r.new_blocks, r.deduplicated_blocks) == (1, 2)
    st = store.stats()
    assert st.blocks == 4
    assert st.dedup_bytes_saved == 2 * BLOCK_BYTES
    assert st.logical_bytes == 6 * BLOCK_BYTES and st.unique_bytes == 4 * BLOCK_BYTES
    m = store.match_prefix(LAYOUT, "t", tokens_b + [7])
    assert m.tokens == 12 and len(m.blocks) == 3
    assert store.match_prefix(LAYOUT, "other-tenant", tokens_b).tokens == 0
    store.delete_session("a")
    assert store.stats().blocks == 3
    assert_same_kv(LAYOUT, read_all(store, "b"), k2, v2)
    store.delete_session("b")
    assert store.stats().blocks == 0
    assert store.stats().tiers[Tier.HOT].used_bytes == 0


def test_turns_extend_the_chain_and_replace_the_partial_tail(store):
    store.create_session("s", LAYOUT)
    keys, values = kv(14)
    r1 = store.put_kv("s", list(range(6)), [k[:, :6] for k in keys], [v[:, :6] for v in values])
    tail = r1.chain[-1]
    # Turn 2 sends only the blocks from the old partial tail on.
    blocks = split_kv(LAYOUT, keys, values)
    r2 = store.put_blocks("s", list(range(14)), blocks[1:], start_block=1)
    assert r2.released_blocks == 1 and r2.new_blocks == 3
    assert not store.contains(tail)
    assert store.session("s").turn == 2
    assert_same_kv(LAYOUT, read_all(store, "s"), keys, values)
    # Retrying the same turn changes nothing but the turn counter.
    r3 = store.put_blocks("s", list(range(14)), blocks[1:], start_block=1)
    assert (r3.new_blocks, r3.released_blocks) == (0, 0)
    assert store.stats().blocks == 4


def test_pressure_cascades_hot_to_warm_to_cold_and_loses_nothing(tmp_path):
    s = make_store(tmp_path, hot_blocks=8, warm_blocks=8)
    all_kv = {}
    for i in range(4):
        sid = f"s{i}"
        s.create_session(sid, LAYOUT, namespace=sid)
        all_kv[sid] = kv(24, seed=i)  # 6 blocks each, 24 in all: 3x the memory tiers
        s.put_kv(sid, list(range(24)), *all_kv[sid])
    st = s.stats()
    assert st.tiers[Tier.HOT].blocks <= 8 and st.tiers[Tier.WARM].blocks <= 8
    assert st.tiers[Tier.HOT].evictions > 0 and st.tiers[Tier.WARM].evictions > 0
    assert st.tiers[Tier.COLD].blocks >= 8
    # A block that left memory has a cold copy.
    for sid in all_kv:
        for key in s.session(sid).chain:
            assert s.locate(key) is not None
    for sid, (keys, values) in all_kv.items():
        assert_same_kv(LAYOUT, read_all(s, sid), keys, values)
    assert s.stats().tiers[Tier.COLD].hits > 0
    s.check_invariants()
    s.close()


def test_high_priority_blocks_stay_hot_under_pressure(tmp_path):
    s = make_store(tmp_path, hot_blocks=8, warm_blocks=8)
    s.create_session("vip", LAYOUT, namespace="a", priority="high")
    s.create_session("bg", LAYOUT, namespace="b", priority="background")
    s.create_session("n", LAYOUT, namespace="c")
    s.put_kv("vip", list(range(16)), *kv(16, seed=1))
    for sid, seed in (("bg", 2), ("n", 3)):
        s.put_kv(sid, list(range(24)), *kv(24, seed=seed))
    assert all(s.locate(k) is Tier.HOT for k in s.session("vip").chain)
    bg_tiers = [s.locate(k) for k in s.session("bg").chain]
    assert Tier.HOT not in bg_tiers
    s.close()


def test_precision_policy_fp16_after_first_round_and_int8_when_idle(tmp_path):
    clock = FakeClock()
    layout = KVLayout("m32", 2, 2, 8, dtype="float32", block_tokens=4)
    nbytes = layout.block_nbytes()
    assert UNIT // nbytes == 4  # the hot tier holds 4 blocks
    s = make_store(
        tmp_path,
        clock=clock,
        hot_capacity_bytes=UNIT,
        warm_capacity_bytes=4 * UNIT,
        precision=PrecisionConfig(int8_idle_seconds=60),
    )
    s.create_session("s", layout)
    keys, values = kv(8, layout)
    s.put_kv("s", list(range(8)), keys, values)
    s.put_kv("s", list(range(8)), keys, values)  # second round of the same blocks
    clock.t += 3600  # long idle
    s.create_session("other", layout, namespace="o")
    s.put_kv("other", list(range(16)), *kv(16, layout, seed=5))  # pushes s's blocks to warm
    chain = s.session("s").chain
    assert all(s.locate(k) is Tier.WARM for k in chain)
    assert {s.pool.warm_tier.stored_dtype(k) for k in chain} == {torch.int8}
    got = torch.cat([s.get(k) for k in chain], dim=3)
    ref = torch.cat(split_kv(layout, keys, values), dim=3)
    assert got.dtype == torch.float32
    err = (got - ref).abs().max().item()
    assert 0 < err < 0.05 * ref.abs().max().item()
    s.close()


def test_suspend_archives_and_resume_is_lazy_and_byte_identical(tmp_path):
    s = make_store(tmp_path)
    s.create_session("s", LAYOUT, namespace="t")
    keys, values = kv(40)  # 10 blocks
    s.put_kv("s", list(range(40)), keys, values)
    info = s.suspend("s")
    assert info.state is SessionState.ARCHIVED
    assert s.stats().tiers[Tier.HOT].blocks == 0
    assert all(s.locate(k) is Tier.COLD for k in info.chain)
    handle = s.resume("s")
    assert handle.tokens == 40 and len(handle.blocks) == 10
    # The head of the chain was prefetched into free hot space; the rest waits.
    assert s.stats().prefetched >= 1
    it = s.read_session("s")
    first_key, first = next(it)
    assert first_key == info.chain[0]
    blocks = [first] + [b for _, b in it]
    assert_same_kv(LAYOUT, blocks, keys, values)
    assert s.stats().prefetch_used >= 1
    assert s.session("s").state is SessionState.ACTIVE
    s.close()


def test_suspend_keeps_blocks_an_active_session_shares(store):
    keys, values = kv(8)
    for sid in ("a", "b"):
        store.create_session(sid, LAYOUT)
        store.put_kv(sid, list(range(8)), keys, values)
    store.suspend("a")
    chain = store.session("a").chain
    assert all(store.locate(k) is Tier.HOT for k in chain)
    assert store.session("a").state is SessionState.SUSPENDED


def test_offline_suspend_uses_the_lossy_codec_for_unshared_blocks(tmp_path):
    s = make_store(tmp_path, codecs=CodecConfig(cold_lossy_codec="delta_rl"))
    s.create_session("s", LAYOUT)
    keys, values = kv(16)
    s.put_kv("s", list(range(16)), keys, values)
    s.suspend("s", offline=True)
    ref = torch.cat(split_kv(LAYOUT, keys, values), dim=3).float()
    got = torch.cat(read_all(s, "s"), dim=3).float()
    rel = ((got - ref).norm() / ref.norm()).item()
    # The default stepped codes: uniform steps of half an RMS leave an RMS error of
    # 0.5 / sqrt(12) = 14% of the spread on Gaussian data (perplexity: BENCHMARKS.md).
    assert 0 < rel < 0.16
    s.close()


def test_reopen_serves_each_session_as_far_as_the_cold_tier_holds_it(tmp_path):
    """A reopened store is a restarted device under the same session service: what
    reached the cold tier is served again (archived), the rest is lost, and says so."""
    s = make_store(tmp_path)
    keys, values = kv(12)
    s.create_session("kept", LAYOUT, namespace="t")
    s.put_kv("kept", list(range(12)), keys, values)
    s.suspend("kept")
    s.create_session("grown", LAYOUT, namespace="u")
    g_keys, g_values = kv(16, seed=9)
    s.put_kv("grown", list(range(12)), [k[:, :12] for k in g_keys], [v[:, :12] for v in g_values])
    s.suspend("grown")
    s.resume("grown")
    s.put_kv("grown", list(range(16)), g_keys, g_values)  # its 4th block only in memory
    s.create_session("fresh", LAYOUT, namespace="u")
    s.put_kv("fresh", list(range(100, 108)), *kv(8, seed=3))  # never left memory
    s.close()
    with pytest.raises(ClosedError):
        s.stats()

    s2 = make_store(tmp_path)
    assert s2.sessions() == ["kept", "grown"]
    assert s2.session("kept").state is SessionState.ARCHIVED
    assert_same_kv(LAYOUT, read_all(s2, "kept"), keys, values)
    grown = s2.service.state.get("grown")
    assert (grown.tokens, grown.lost_tokens) == (12, 4)  # the longest prefix that survived
    assert_same_kv(LAYOUT, read_all(s2, "grown"), [k[:, :12] for k in g_keys],
                   [v[:, :12] for v in g_values])
    with pytest.raises(BlockLostError, match="in no tier"):
        s2.session("fresh")
    # No cold block is left that no session holds (block_keys waits for the cold
    # writer's queued deletes; stats() does not, so it may still count them).
    held = {bytes(k) for sid in ("kept", "grown") for k in s2.session(sid).chain}
    assert set(s2.pool.cold.block_keys()) == held
    s2.close()


def test_the_session_journal_follows_writes_suspends_and_deletes_across_reopens(tmp_path):
    s = make_store(tmp_path)
    keys, values = kv(12)
    for sid in ("kept", "deleted"):
        s.create_session(sid, LAYOUT, namespace="t")
        s.put_kv(sid, list(range(12)), keys, values)
        s.suspend(sid)
    s.delete_session("deleted")
    s.close()
    assert (tmp_path / "cold" / "router" / "journal.log").exists()

    s2 = make_store(tmp_path)
    assert s2.sessions() == ["kept"]
    s2.set_priority("kept", "high")
    s2.close()
    s3 = make_store(tmp_path)  # a second reopen: the journal was not consumed by the first
    assert s3.sessions() == ["kept"]
    assert s3.session("kept").priority is Priority.HIGH
    assert_same_kv(LAYOUT, read_all(s3, "kept"), keys, values)
    s3.close()


def _suspended_then_journal_removed(tmp_path):
    """A suspended session's manifest and KV, its store closed and the service's
    journal removed (what an earlier version left on disk, but for its records)."""
    s = make_store(tmp_path)
    keys, values = kv(12)
    s.create_session("old", LAYOUT, namespace="t")
    s.put_kv("old", list(range(12)), keys, values)
    s.suspend("old")
    manifest = s.service.state.get("old").manifest()
    s.close()
    shutil.rmtree(tmp_path / "cold" / "router")
    return manifest, keys, values


def test_manifests_of_an_earlier_version_move_into_the_session_journal(tmp_path):
    # What an earlier version wrote: the manifest as a segment record, no journal.
    manifest, keys, values = _suspended_then_journal_removed(tmp_path)
    digest = hashlib.blake2b(b"old", digest_size=HASH_BYTES).digest()
    segments = SegmentStore(ArchiveConfig(directory=tmp_path / "cold", fsync="never"))
    segments.put(
        b"session-manifest" + digest,
        msgpack.packb(manifest, use_bin_type=True),
        fingerprint=bytes(HASH_BYTES),
        codec_id=0,
    )
    segments.close()

    s2 = make_store(tmp_path)
    assert s2.sessions() == ["old"]
    assert_same_kv(LAYOUT, read_all(s2, "old"), keys, values)
    assert s2.pool.cold.backend.legacy_manifests() == []  # moved, not copied
    s2.close()
    s3 = make_store(tmp_path)
    assert s3.sessions() == ["old"]
    s3.close()


def test_the_suspended_sessions_journal_of_the_last_version_moves_into_the_service(tmp_path):
    manifest, keys, values = _suspended_then_journal_removed(tmp_path)
    previous = SuspendedSessions(tmp_path / "cold" / "sessions", fsync=False)
    previous.suspended(manifest)
    previous.suspended({**manifest, "session_id": "ghost", "chain": [b"\x01" * 16],
                        "tokens": 4})
    previous.close()

    s2 = make_store(tmp_path)
    assert s2.sessions() == ["old"]
    assert_same_kv(LAYOUT, read_all(s2, "old"), keys, values)
    with pytest.raises(BlockLostError, match="in no tier"):
        s2.session("ghost")
    assert not (tmp_path / "cold" / "sessions").exists()  # moved, not copied
    s2.close()


def test_an_unreadable_session_journal_is_refused_not_ignored(tmp_path):
    s = make_store(tmp_path)
    s.create_session("s", LAYOUT)
    s.put_kv("s", list(range(8)), *kv(8))
    s.suspend("s")
    s.close()
    snapshot = tmp_path / "cold" / "router" / "snapshot.bin"
    snapshot.write_bytes(b"\x05\x00\x00\x00garbage!")
    with pytest.raises(CorruptDataError, match="snapshot"):
        make_store(tmp_path)


def test_corrupt_cold_block_is_never_served(tmp_path):
    s = make_store(tmp_path)
    s.create_session("s", LAYOUT)
    s.put_kv("s", list(range(8)), *kv(8))
    s.suspend("s")
    first, key = s.session("s").chain[:2]
    meta = s.pool.cold.backend.segments.meta(key)
    s.close()
    seg = sorted((tmp_path / "cold").glob("seg-*"))[meta.segment - 1 if meta.segment else 0]
    data = bytearray(seg.read_bytes())
    data[meta.offset + 40 + 100] ^= 0xFF  # inside that record
    seg.write_bytes(bytes(data))
    s2 = make_store(tmp_path)
    # The damaged record is dropped at reopen (the session keeps the prefix before
    # it, and says what it lost) or detected at read time; it is never returned.
    assert "s" in s2.sessions()
    record = s2.service.state.get("s")
    if key in record.chain:
        with pytest.raises(CorruptDataError):
            read_all(s2, "s")
    else:
        assert (record.tokens, record.lost_tokens) == (4, 4)
        assert [k for k, _ in s2.read_session("s")] == [first]
    s2.close()


def test_pinned_blocks_are_not_evicted_and_delete_waits_for_readers(tmp_path):
    s = make_store(tmp_path, hot_blocks=8, warm_blocks=8)
    s.create_session("s", LAYOUT, namespace="a")
    keys, values = kv(8)
    s.put_kv("s", list(range(8)), keys, values)
    chain = s.session("s").chain
    with s.pinned_reads(chain) as fetched:
        views = [f.block for f in fetched]
        assert {f.tier for f in fetched} == {Tier.HOT}
        before = [v.clone() for v in views]
        s.create_session("flood", LAYOUT, namespace="b")
        s.put_kv("flood", list(range(64)), *kv(64, seed=3))
        assert all(s.locate(k) is Tier.HOT for k in chain)
        s.delete_session("s")
        assert all(s.contains(k) for k in chain)  # still pinned by this reader
        for v, b in zip(views, before, strict=True):
            assert torch.equal(v, b)
    assert not any(s.contains(k) for k in chain)
    s.check_invariants()
    s.close()


def test_bad_input_is_refused_and_changes_nothing(store):
    store.create_session("s", LAYOUT)
    keys, values = kv(8)
    store.put_kv("s", list(range(8)), keys, values)
    before = store.stats()
    chain = store.session("s").chain
    with pytest.raises(LayoutMismatchError, match="dtype"):
        store.put_kv("s", list(range(8)), [k.float() for k in keys], values)
    with pytest.raises(LayoutMismatchError, match="one per layer"):
        store.put_kv("s", list(range(8)), keys[:1], values)
    blocks = split_kv(LAYOUT, *kv(12))
    with pytest.raises(InvalidInputError, match="expected 3 blocks"):
        store.put_blocks("s", list(range(12)), blocks[:2])
    with pytest.raises(LayoutMismatchError, match="must hold 4 tokens"):
        store.put_blocks("s", list(range(12)), [blocks[0], blocks[1], blocks[2][:, :, :, :2]])
    with pytest.raises(InvalidInputError, match="not sent and is not stored"):
        store.put_blocks("s", list(range(100, 112)), blocks[1:], start_block=1)
    with pytest.raises(InvalidInputError, match="non-negative"):
        store.put_blocks("s", [-1, 2, 3, 4], blocks[:1])
    with pytest.raises(UnknownSessionError):
        store.put_kv("nope", [1], *kv(1))
    with pytest.raises(UnknownBlockError):
        store.get(b"\x00" * 16)
    with pytest.raises(InvalidInputError, match="already exists"):
        store.create_session("s", LAYOUT)
    with pytest.raises(InvalidInputError, match="priority"):
        store.create_session("p", LAYOUT, priority="urgent")
    with pytest.raises(InvalidInputError, match="session id"):
        store.create_session("", LAYOUT)
    after = store.stats()
    assert store.session("s").chain == chain
    assert (after.blocks, after.logical_bytes, after.unique_bytes) == (
        before.blocks,
        before.logical_bytes,
        before.unique_bytes,
    )
    assert_same_kv(LAYOUT, read_all(store, "s"), keys, values)


def test_full_cold_tier_raises_capacity_error_and_keeps_what_was_stored(tmp_path):
    s = make_store(tmp_path, hot_blocks=8, warm_blocks=8, cold_capacity_bytes=4 * BLOCK_BYTES)
    s.create_session("s", LAYOUT)
    keys, values = kv(8)
    s.put_kv("s", list(range(8)), keys, values)
    s.create_session("big", LAYOUT, namespace="b")
    with pytest.raises(CapacityError, match="cold tier full"):
        s.put_kv("big", list(range(200)), *kv(200, seed=4))
    assert s.session("big").tokens == 0
    assert_same_kv(LAYOUT, read_all(s, "s"), keys, values)
    s.check_invariants()
    s.close()


def test_adopt_session_from_the_cold_tier(tmp_path):
    s = make_store(tmp_path)
    keys, values = kv(12)
    s.create_session("orig", LAYOUT, namespace="t")
    s.put_kv("orig", list(range(12)), keys, values)
    info = s.suspend("orig")
    adopted = s.adopt_session(
        "copy",
        LAYOUT,
        namespace="t",
        priority="high",
        tokens=12,
        turn=info.turn,
        chain=list(info.chain),
    )
    assert adopted.state is SessionState.ARCHIVED and adopted.chain == info.chain
    assert_same_kv(LAYOUT, read_all(s, "copy"), keys, values)
    s.delete_session("orig")
    assert_same_kv(LAYOUT, read_all(s, "copy"), keys, values)  # still referenced
    with pytest.raises(BlockLostError, match="in no tier"):
        s.adopt_session(
            "ghost",
            LAYOUT,
            namespace="t",
            priority="normal",
            tokens=4,
            turn=1,
            chain=[b"\x01" * 16],
        )
    assert "ghost" not in s.sessions()
    with pytest.raises(InvalidInputError, match="chain has 1"):
        s.adopt_session(
            "bad",
            LAYOUT,
            namespace="t",
            priority="normal",
            tokens=12,
            turn=1,
            chain=[info.chain[0]],
        )
    s.check_invariants()
    s.close()


def test_often_rewritten_partial_tail_is_archived_uncompressed(tmp_path):
    s = make_store(tmp_path, codecs=CodecConfig(hot_update_threshold=3))
    s.create_session("s", LAYOUT)
    keys, values = kv(40)
    for n in (5, 6, 7, 9, 10):  # every turn replaces the partial tail (blocks of 4 tokens)
        s.put_kv("s", list(range(n)), [k[:, :n] for k in keys], [v[:, :n] for v in values])
    chain = s.suspend("s").chain
    codecs = [s.pool.table[k].cold_codec for k in chain]
    assert codecs[:-1] == ["zstd", "zstd"] and codecs[-1] == "none"
    got = torch.cat(read_all(s, "s"), dim=3)
    assert torch.equal(
        got,
        torch.cat(split_kv(LAYOUT, [k[:, :10] for k in keys], [v[:, :10] for v in values]), dim=3),
    )
    s.close()
