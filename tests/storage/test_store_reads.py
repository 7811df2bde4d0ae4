"""The store's read plans (same-node path), checksums, exactness and int8 cold frames."""

import zlib

import pytest
import torch

from memkv.errors import InvariantViolationError, UnknownBlockError
from memkv.protocol.enums import Tier
from memkv.shm.same_node import SegmentMaps
from memkv.storage.codecs import peek_header
from memkv.storage.config import PrecisionConfig
from memkv.storage.layout import KVLayout, split_kv
from memkv.storage.precision import dequantize_int8

from .test_store import UNIT, FakeClock, kv, make_store

LAYOUT = KVLayout("plan-model", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)


def _bytes_of(t: torch.Tensor) -> bytes:
    raw = t.view(torch.int16) if t.dtype is torch.bfloat16 else t
    return raw.contiguous().numpy().tobytes()


def test_plan_points_at_the_blocks_bytes_in_shared_memory(tmp_path):
    s = make_store(tmp_path)
    s.create_session("s", LAYOUT)
    keys, values = kv(10, LAYOUT)
    s.put_kv("s", list(range(10)), keys, values)
    chain = list(s.session("s").chain)
    plans = s.plan_reads(chain)
    blocks = split_kv(LAYOUT, keys, values)
    maps = SegmentMaps()  # what a reader on the node maps the segments with
    try:
        for plan, block in zip(plans, blocks, strict=True):
            assert plan is not None and plan.found is Tier.HOT and plan.exact
            buf = maps.view(plan.segment, plan.segment_bytes, "store")
            got = bytes(buf[plan.offset : plan.offset + plan.nbytes])
            assert got == _bytes_of(block)
            assert zlib.crc32(got) == plan.crc32
            assert plan.shape == tuple(block.shape) and plan.dtype == LAYOUT.dtype
    finally:
        maps.close()
    s.unpin_blocks(chain)
    s.close()


def test_planned_blocks_stay_pinned_until_released(tmp_path):
    # A hot tier of 8 blocks: a planned session must not be evicted by later puts.
    s = make_store(tmp_path, hot_capacity_bytes=UNIT, warm_capacity_bytes=UNIT)
    s.create_session("a", LAYOUT)
    s.put_kv("a", list(range(8)), *kv(8, LAYOUT))
    chain = list(s.session("a").chain)
    s.plan_reads(chain)
    s.create_session("b", LAYOUT, namespace="other")
    s.put_kv("b", list(range(40)), *kv(40, LAYOUT, seed=3))
    assert all(s.locate(k) is Tier.HOT for k in chain)
    s.unpin_blocks(chain)
    s.put_kv("b", list(range(80)), *kv(80, LAYOUT, seed=4))
    assert not all(s.locate(k) is Tier.HOT for k in chain)
    with pytest.raises(InvariantViolationError):
        s.unpin_blocks(chain[:1])  # released already
    s.close()


def test_plan_of_a_missing_block_pins_nothing(tmp_path):
    s = make_store(tmp_path)
    s.create_session("s", LAYOUT)
    s.put_kv("s", list(range(4)), *kv(4, LAYOUT))
    key = s.session("s").chain[0]
    with pytest.raises(UnknownBlockError):
        s.plan_reads([key, b"\x01" * 16])
    with pytest.raises(InvariantViolationError):
        s.unpin_blocks([key])
    s.close()


def test_writer_checksums_are_served_and_cold_reads_are_planned_after_promotion(tmp_path):
    s = make_store(tmp_path)
    s.create_session("s", LAYOUT)
    keys, values = kv(8, LAYOUT)
    blocks = split_kv(LAYOUT, keys, values)
    crcs = [zlib.crc32(_bytes_of(b)) for b in blocks]
    s.put_blocks("s", list(range(8)), blocks, checksums=crcs)
    s.suspend("s")  # lossless cold codec by default
    chain = list(s.session("s").chain)
    assert all(s.locate(k) is Tier.COLD for k in chain)
    plans = s.plan_reads(chain)
    assert [p.found for p in plans] == [Tier.COLD, Tier.COLD]
    assert [p.crc32 for p in plans] == crcs and all(p.exact for p in plans)
    s.unpin_blocks(chain)
    s.close()


def _idle_int8_store(tmp_path, clock):
    layout = KVLayout("m32", 2, 2, 8, dtype="float32", block_tokens=4)
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
    s.put_kv("s", list(range(8)), keys, values)
    clock.t += 3600
    s.create_session("other", layout, namespace="o")
    s.put_kv("other", list(range(16)), *kv(16, layout, seed=5))
    return s, layout


def test_lossy_blocks_are_reported_inexact_with_a_checksum_of_what_is_served(tmp_path):
    s, layout = _idle_int8_store(tmp_path, FakeClock())
    chain = list(s.session("s").chain)
    assert {s.pool.warm_tier.stored_dtype(k) for k in chain} == {torch.int8}
    plans = s.plan_reads(chain)
    for plan in plans:
        assert plan is not None and plan.found is Tier.WARM and not plan.exact
        assert plan.lossy == "int8"
        block = s.pool.hot_tier.load(plan.key)
        assert plan.crc32 == zlib.crc32(_bytes_of(block))
    s.unpin_blocks(chain)
    s.close()


def test_int8_warm_block_goes_cold_as_int8(tmp_path):
    s, layout = _idle_int8_store(tmp_path, FakeClock())
    chain = list(s.session("s").chain)
    warm = {k: s.pool.warm_tier.load(k).nbytes for k in chain}
    expected = [dequantize_int8(s.pool.warm_tier.load(k), torch.float32) for k in chain]
    s.suspend("s")
    for key in chain:
        frame = s.pool.cold.backend.segments.get(key)
        header = peek_header(frame)
        assert header.codec == "int8"
        # No larger than the warm copy (codes + scales) plus the frame header.
        assert len(frame) <= warm[key] + header.header_len
    # And it reads back as the same dequantised values as before.
    got = [s.get(k) for k in chain]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    s.close()


def test_offline_suspend_with_a_lossy_codec_reads_back_as_inexact(tmp_path):
    from memkv.storage.config import CodecConfig

    s = make_store(tmp_path, codecs=CodecConfig(cold_lossy_codec="delta_rl"))
    s.create_session("s", LAYOUT)
    s.put_kv("s", list(range(8)), *kv(8, LAYOUT))
    chain = list(s.session("s").chain)
    s.suspend("s", offline=True)
    assert all(s.locate(k) is Tier.COLD for k in chain)
    plans = s.plan_reads(chain)
    assert plans and not any(p.exact for p in plans if p is not None)
    s.unpin_blocks([p.key for p in plans if p is not None])
    assert not s.fetch(chain[0]).exact
    s.close()


def test_suspend_writes_the_session_cold_in_one_batch(tmp_path):
    s = make_store(tmp_path)
    calls = []
    real = s.pool.cold.put_many
    s.pool.cold.put_many = lambda items, **kw: calls.append(len(items)) or real(items, **kw)
    s.create_session("s", LAYOUT)
    s.put_kv("s", list(range(16)), *kv(16, LAYOUT))
    s.suspend("s")
    assert calls == [4]
    s.close()


def test_an_exact_only_session_never_takes_a_lossy_step(tmp_path):
    clock = FakeClock()
    layout = KVLayout(
        "exact-model", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype="float32"
    )
    s = make_store(
        tmp_path,
        clock=clock,
        hot_capacity_bytes=UNIT,
        warm_capacity_bytes=4 * UNIT,
        precision=PrecisionConfig(int8_idle_seconds=60),
    )
    for sid, exact_only in (("lossy", False), ("exact", True)):
        s.create_session(sid, layout, namespace=sid, exact_only=exact_only)
        keys, values = kv(8, layout, seed=len(sid))
        s.put_kv(sid, list(range(8)), keys, values)
        s.put_kv(sid, list(range(8)), keys, values)  # a later round: fp16 allowed
    clock.t += 3600  # long idle: int8 allowed
    s.create_session("push", layout, namespace="o")
    s.put_kv("push", list(range(16)), *kv(16, layout, seed=5))  # both go warm
    lossy, exact = list(s.session("lossy").chain), list(s.session("exact").chain)
    assert {s.pool.warm_tier.stored_dtype(k) for k in lossy} == {torch.int8}
    assert {s.pool.warm_tier.stored_dtype(k) for k in exact} == {torch.float32}
    s.suspend("exact", offline=True)  # offline would pick the lossy cold codec
    expected = split_kv(layout, *kv(8, layout, seed=len("exact")))
    for fetched, block in zip(s.iter_session("exact"), expected, strict=True):
        assert fetched.exact and torch.equal(fetched.block, block)
    s.close()


def test_first_round_blocks_keep_the_model_dtype_when_demoted_later(tmp_path):
    layout = KVLayout("rounds-model", 2, 2, 8, dtype="float32", block_tokens=4)
    s = make_store(tmp_path, hot_capacity_bytes=UNIT, warm_capacity_bytes=4 * UNIT)
    s.create_session("s", layout)
    keys, values = kv(8, layout)
    s.put_kv("s", list(range(4)), [k[:, :4] for k in keys], [v[:, :4] for v in values])
    s.put_kv("s", list(range(8)), keys, values)  # turn 2: block 0 kept, block 1 new
    first, second = s.session("s").chain
    s.create_session("push", layout, namespace="o")
    s.put_kv("push", list(range(16)), *kv(16, layout, seed=5))  # both go warm
    assert s.pool.warm_tier.stored_dtype(first) == torch.float32  # turn 0: the model's dtype
    assert s.pool.warm_tier.stored_dtype(second) == torch.float16  # a later round: fp16
    blocks = split_kv(layout, keys, values)
    got = list(s.iter_session("s"))
    assert got[0].exact and torch.equal(got[0].block, blocks[0])
    assert not got[1].exact and got[1].lossy == "float16"
    s.close()
