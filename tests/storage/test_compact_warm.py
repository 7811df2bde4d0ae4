"""Warm blocks kept as Delta+RL frames (precision.compact_idle_seconds), decoded on read."""

import torch

from memkv.protocol.enums import Tier
from memkv.storage.codecs import decode_frame, peek_header
from memkv.storage.config import PrecisionConfig
from memkv.storage.layout import KVLayout, split_kv
from memkv.storage.precision import EncodedBlock

from .test_store import FakeClock, kv, make_store

LAYOUT = KVLayout("compact-model", 2, 2, 32, dtype="float16", block_tokens=16)
BLOCK = LAYOUT.block_nbytes()  # 8 KiB: two arena units


def _idle_compact_store(tmp_path, clock, *, exact_only=False):
    s = make_store(
        tmp_path,
        clock=clock,
        hot_capacity_bytes=8 * BLOCK,  # the push below fills it
        warm_capacity_bytes=16 * BLOCK,
        precision=PrecisionConfig(compact_idle_seconds=60),
    )
    s.create_session("s", LAYOUT, exact_only=exact_only)
    keys, values = kv(64, LAYOUT)
    s.put_kv("s", list(range(64)), keys, values)
    clock.t += 3600  # long idle: the next demotions may compact
    s.create_session("push", LAYOUT, namespace="o")
    s.put_kv("push", list(range(128)), *kv(128, LAYOUT, seed=5))  # fills hot: "s" goes warm
    return s, split_kv(LAYOUT, keys, values)


def test_an_idle_block_leaving_hot_is_kept_warm_as_a_frame_and_read_back_close(tmp_path):
    s, originals = _idle_compact_store(tmp_path, FakeClock())
    chain = list(s.session("s").chain)
    assert all(s.locate(k) is Tier.WARM for k in chain)
    for key, original in zip(chain, originals, strict=True):
        stored = s.pool.warm_tier.load(key)
        assert isinstance(stored, EncodedBlock) and stored.codec == "delta_rl"
        # Gaussian test data: ~3 bits of entropy a value at the default step, plus the
        # frame's scales (memkv bench codecs measures model KV: ~2.5 bits).
        assert stored.nbytes * 8 / original.numel() < 6
    fetched = list(s.iter_session("s"))
    for got, original in zip(fetched, originals, strict=True):
        assert not got.exact and got.block.dtype == original.dtype
        err = (got.block.float() - original.float()).abs().max().item()
        assert 0 < err < 0.5 * original.float().abs().max().item()  # lossy, and bounded
    stats = s.stats()
    assert stats.lossy_conversions >= len(chain)
    s.close()


def test_a_compact_warm_block_goes_cold_as_its_own_frame(tmp_path):
    s, _ = _idle_compact_store(tmp_path, FakeClock())
    chain = list(s.session("s").chain)
    warm = {k: s.pool.warm_tier.load(k).frame.clone() for k in chain}
    served = {k: decode_frame(warm[k].numpy().data) for k in chain}
    s.suspend("s")
    for key in chain:
        frame = s.pool.cold.backend.segments.get(key)
        assert peek_header(frame).codec == "delta_rl"
        assert bytes(frame) == warm[key].numpy().tobytes()  # not decoded and re-encoded
    for key in chain:
        assert torch.equal(s.get(key), served[key])
    s.close()


def test_a_compact_block_is_planned_from_a_decoded_hot_copy(tmp_path):
    s, _ = _idle_compact_store(tmp_path, FakeClock())
    chain = list(s.session("s").chain)
    plans = s.plan_reads(chain[:2])
    for plan in plans:
        assert plan is not None and plan.found is Tier.WARM and not plan.exact
        assert plan.lossy == "delta_rl" and s.locate(plan.key) is Tier.HOT
    s.unpin_blocks(chain[:2])
    s.close()


def test_an_exact_only_session_is_never_compacted(tmp_path):
    s, originals = _idle_compact_store(tmp_path, FakeClock(), exact_only=True)
    chain = list(s.session("s").chain)
    assert {s.pool.warm_tier.stored_dtype(k) for k in chain} == {torch.float16}
    for got, original in zip(s.iter_session("s"), originals, strict=True):
        assert got.exact and torch.equal(got.block, original)
    s.close()
