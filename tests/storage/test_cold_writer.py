"""The cold writer: demotions written behind the caller, in batches, outside the pool's lock."""

import threading

import pytest
import torch

from memkv.errors import CapacityError, UnknownBlockError
from memkv.protocol.enums import Tier
from memkv.protocol.hashing import HASH_BYTES
from memkv.router.sessions import SessionTable
from memkv.storage.block_pool import BlockPool
from memkv.storage.cold_writer import ColdWriter
from memkv.storage.config import (
    AllocatorConfig,
    ArchiveConfig,
    CodecConfig,
    ColdWriterConfig,
    StoreConfig,
)
from memkv.storage.tiers import ColdTier

from .test_block_pool import LAYOUT, UNIT, append

FP = bytes(16)


class GatedDisk(ColdTier):
    """Segment files whose batch writes wait for ``gate`` (and may be told to fail)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_next: Exception | None = None
        self.batches: list[list[bytes]] = []
        self.removed: list[bytes] = []

    def put_many(self, items, *, durable=False):
        self.entered.set()
        self.gate.wait()
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        self.batches.append([k for k, *_ in items])
        return super().put_many(items, durable=durable)

    def remove(self, key):
        self.removed.append(key)
        super().remove(key)


def disk(tmp_path, capacity=None):
    archive = ArchiveConfig(directory=tmp_path / "cold", fsync="never")
    return GatedDisk(archive, CodecConfig(), capacity)


def writer(backend, pending=1 << 30, batch=64):
    return ColdWriter(backend, CodecConfig(), max_pending_bytes=pending, max_batch_blocks=batch)


def key(i):
    return bytes([i]) * HASH_BYTES


def block(i):
    return torch.full((2, 64), float(i))


def stuck_writer(tmp_path, codec):
    """A writer whose thread is held inside the backend with block 0, a batch of its own."""
    backend = disk(tmp_path)
    backend.gate.clear()
    w = writer(backend)
    w.put(key(0), block(0), fingerprint=FP, codec=codec)
    backend.entered.wait()
    return backend, w


def test_a_queued_block_is_served_before_it_lands_and_written_in_one_batch(tmp_path):
    backend, w = stuck_writer(tmp_path, "zstd")
    for i in range(1, 5):
        w.put(key(i), block(i), fingerprint=FP, codec="zstd")
    assert all(key(i) in w for i in range(5))
    assert w.missing([key(i) for i in range(6)]) == [key(5)]
    assert torch.equal(w.load(key(3)), block(3))
    assert key(3) not in backend  # not landed yet
    backend.gate.set()
    w.flush()
    assert backend.batches == [[key(0)], [key(i) for i in range(1, 5)]]
    assert all(torch.equal(backend.load(key(i)), block(i)) for i in range(5))
    assert w.writer_stats().pending_blocks == 0
    w.close()


def test_stats_count_queued_writes_without_waiting_for_them(tmp_path):
    backend, w = stuck_writer(tmp_path, "none")
    w.put(key(1), block(1), fingerprint=FP, codec="none")
    queued = w.stats()  # answers although the writer is stuck
    assert queued.blocks == 2 and queued.live_bytes == 2 * block(0).nbytes
    backend.gate.set()
    w.flush()
    assert w.stats().blocks == 2 and w.writer_stats().pending_blocks == 0
    w.close()


def test_the_writer_keeps_its_own_copy_of_the_block(tmp_path):
    backend = disk(tmp_path)
    backend.gate.clear()
    w = writer(backend)
    source = block(7)
    w.put(key(7), source, fingerprint=FP, codec="lz4")
    source.zero_()  # the arena slot is reused at once
    backend.gate.set()
    w.flush()
    assert torch.equal(backend.load(key(7)), block(7))
    w.close()


def test_a_delete_cancels_a_queued_write_and_comes_before_a_later_one(tmp_path):
    backend, w = stuck_writer(tmp_path, "none")
    w.put(key(1), block(1), fingerprint=FP, codec="none")
    w.remove(key(1))  # freed before its write
    assert key(1) not in w and w.missing([key(1)]) == [key(1)]
    with pytest.raises(UnknownBlockError):
        w.load(key(1))
    w.remove(key(2))
    w.put(key(2), block(2), fingerprint=FP, codec="none")  # freed, then demoted again
    assert key(2) in w
    backend.gate.set()
    w.flush()
    assert backend.batches == [[key(0)], [key(2)]]  # key 1 was never written
    assert key(1) not in backend and key(2) in backend
    assert backend.removed == [key(1), key(2)]
    w.close()


def test_a_failed_batch_stays_readable_is_raised_to_the_next_caller_and_retried(tmp_path):
    backend = disk(tmp_path)
    backend.fail_next = OSError("disk unplugged")
    w = writer(backend)
    w.put(key(0), block(0), fingerprint=FP, codec="zstd")
    with pytest.raises(OSError, match="disk unplugged"):
        w.flush()
    assert torch.equal(w.load(key(0)), block(0))  # still served from the queued copy
    w.flush()  # the error was collected, so the batch is retried
    assert torch.equal(backend.load(key(0)), block(0))
    assert w.writer_stats().failures == 1
    w.close()


def test_demotions_wait_when_the_queued_copies_reach_their_bound(tmp_path):
    backend = disk(tmp_path)
    backend.gate.clear()
    one = block(0).nbytes
    w = writer(backend, pending=2 * one)
    w.put(key(0), block(0), fingerprint=FP, codec="none")
    w.put(key(1), block(1), fingerprint=FP, codec="none")
    third = threading.Thread(
        target=w.put, args=(key(2), block(2)), kwargs={"fingerprint": FP, "codec": "none"}
    )
    third.start()
    third.join(timeout=0.2)
    assert third.is_alive()  # waiting for room
    backend.gate.set()
    third.join()
    w.flush()
    assert w.writer_stats().backpressure_waits == 1
    assert all(key(i) in backend for i in range(3))
    w.close()


def test_a_full_cold_tier_is_refused_when_the_block_is_queued(tmp_path):
    one = block(0).nbytes
    backend = disk(tmp_path, capacity=2 * one + 200)
    backend.gate.clear()
    w = writer(backend)
    w.put(key(0), block(0), fingerprint=FP, codec="none")
    w.put(key(1), block(1), fingerprint=FP, codec="none")
    with pytest.raises(CapacityError, match="cold tier full"):
        w.put(key(2), block(2), fingerprint=FP, codec="none")
    backend.gate.set()
    w.close()


def test_a_lossy_queued_write_is_served_as_the_frame_will_decode(tmp_path):
    backend = disk(tmp_path)
    backend.gate.clear()
    w = writer(backend)
    kv = torch.randn(2, 2, 2, 4, 8)  # (k|v, layers, heads, tokens, dim): a block's shape
    w.put(key(9), kv, fingerprint=FP, codec="delta_rl")
    queued = w.load(key(9))
    assert not torch.equal(queued, kv)
    backend.gate.set()
    w.flush()
    assert torch.equal(backend.load(key(9)), queued)
    w.close()


def pool(tmp_path, backend, write_behind=True):
    cfg = StoreConfig(
        hot_capacity_bytes=8 * UNIT,
        warm_capacity_bytes=8 * UNIT,
        allocator=AllocatorConfig(min_unit_bytes=UNIT),
        cold_writer=ColdWriterConfig(write_behind=write_behind),
        debug_refcounts=True,
    )
    return BlockPool(cfg, cold=backend)


def test_a_slow_cold_write_does_not_hold_the_pool(tmp_path):
    backend = disk(tmp_path)
    p = pool(tmp_path, backend)
    owner = SessionTable()
    owner.create("a", LAYOUT, namespace="a")
    backend.gate.clear()
    chain, _ = append(p, owner, "a", 1024)  # 256 blocks: most of them demoted to cold
    assert backend.entered.wait(timeout=30)  # the writer is stuck in the backend...
    hot = next(k for k in chain if p.locate(k) is Tier.HOT)
    done = threading.Event()
    threading.Thread(target=lambda: (p.get(hot), done.set())).start()
    assert done.wait(timeout=30)  # ...and readers still get the pool
    cold = [k for k in chain if p.locate(k) is Tier.COLD]
    assert p.stats().tiers[Tier.COLD].blocks >= len(cold)  # stats do not wait either
    assert cold and p.get(cold[0]) is not None  # a queued block reads back
    backend.gate.set()
    p.flush_cold()
    stats = p.stats()
    # Every demotion landed (the read above made one more), a few batches for them all.
    assert stats.cold_blocks_written == stats.tiers[Tier.COLD].blocks >= len(cold)
    assert stats.cold_write_batches < len(cold) / 8
    p.close()


def test_write_behind_and_inline_store_the_same_bytes(tmp_path):
    results = []
    for write_behind in (True, False):
        p = pool(tmp_path / str(write_behind), disk(tmp_path / str(write_behind)), write_behind)
        owner = SessionTable()
        owner.create("a", LAYOUT, namespace="a")
        chain, _ = append(p, owner, "a", 128, seed=3)
        results.append([p.get(k).clone() for k in chain])
        assert (p.cold_writer_stats() is not None) is write_behind
        p.close()
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
