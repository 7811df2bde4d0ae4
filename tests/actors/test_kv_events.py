"""A device's tier changes as vLLM's KV events: a real ZMQ subscriber reads a session's
blocks stored hot, demoted to warm and cold, and dropped, with their chain; vLLM's own
decoder reads the same payload (the format is vLLM's, not a look-alike)."""

from __future__ import annotations

import subprocess
import time

import pytest
import zmq

from memkv.actors.device import DeviceCache
from memkv.bench.vllm import VLLM_PYTHON
from memkv.config.schema import KVEventsSettings
from memkv.device.kv_events import batch_of
from memkv.protocol.enums import Tier
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
)
from memkv.protocol.layout import KVLayout
from memkv.router.sessions import SessionTable
from memkv.storage.config import AllocatorConfig, ArchiveConfig, StoreConfig
from memkv.storage.layout import split_kv
from memkv.storage.payloads import to_payload
from memkv.storage.tier_events import TierEventLog

from ..kvdata import random_kv

LAYOUT = KVLayout("kv-events", 2, 2, 64, block_tokens=4)  # a block: one 4 KiB unit
UNIT = 4096


def _append(device: DeviceCache, owner: SessionTable, sid: str, tokens: int, seed: int
            ) -> list[bytes]:
    owner.create(sid, LAYOUT, namespace=sid)
    keys, values = random_kv(LAYOUT, tokens, seed)
    chain = [bytes(k) for k in chain_hashes(range(tokens), LAYOUT, sid)]
    update = owner.plan_append(sid, tokens, chain)
    device.put(update, [to_payload(b"", b) for b in split_kv(LAYOUT, keys, values)])
    owner.commit_append(sid, update)
    return chain


def _events(sub: zmq.Socket, until, timeout_s: float = 10.0) -> list:
    seen: list = []
    deadline = time.monotonic() + timeout_s
    while not until(seen):
        assert time.monotonic() < deadline, f"never saw it: {seen}"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"memkv@127.0.0.1/events-dev" and len(seq) == 8
            seen += decode_batch(payload).events
    return seen


def _stored(events, medium: str) -> list[bytes]:
    return [k for e in events if isinstance(e, BlockStored) and e.medium == medium
            for k in e.block_hashes]


def _removed(events, medium: str) -> list[bytes]:
    return [k for e in events if isinstance(e, BlockRemoved) and e.medium == medium
            for k in e.block_hashes]


def test_a_subscriber_sees_blocks_stored_demoted_and_dropped_by_tier(tmp_path):
    config = StoreConfig(hot_capacity_bytes=4 * UNIT, warm_capacity_bytes=4 * UNIT,
                         allocator=AllocatorConfig(min_unit_bytes=UNIT),
                         archive=ArchiveConfig(directory=tmp_path / "cold", fsync="never"))
    device = DeviceCache("events-dev", config, kv_events=KVEventsSettings(
        endpoint="tcp://127.0.0.1:0", interval_s=0.01))
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        assert device.kv_events is not None
        sub.setsockopt(zmq.SUBSCRIBE, b"memkv@")
        sub.connect(device.kv_events.endpoint)
        time.sleep(0.3)  # (a PUB socket drops what it sends before the subscriber joins)
        owner = SessionTable()
        first = _append(device, owner, "a", 16, seed=1)  # 4 blocks: the hot tier, full
        events = _events(sub, lambda seen: len(_stored(seen, "GPU")) >= 4)
        stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"]
        # A chain's blocks in order, each event naming the parent of its first (one
        # event per batch the chain's blocks fell in, as vLLM sends a request's).
        assert [k for e in stored for k in e.block_hashes] == first
        assert [e.parent_block_hash for e in stored] == [None] + [
            first[first.index(e.block_hashes[0]) - 1] for e in stored[1:]]
        assert {(e.block_size, len(e.token_ids)) for e in stored} == {(4, 0)}
        second = _append(device, owner, "b", 16, seed=2)  # pushes a's blocks down a tier
        events += _events(sub, lambda seen: len(_stored(seen, "GPU")) >= 4)
        demoted = _removed(events, "GPU")
        assert set(demoted) & set(first)  # (the headroom keeper may demote b's too)
        assert set(demoted) <= set(_stored(events, "CPU")) | set(_stored(events, "STORAGE"))
        assert set(second) <= set(_stored(events, "GPU"))
        # The session lets its blocks go: each copy it had is removed from its tier.
        device.release(first, True, "")
        events += _events(sub, lambda seen: set(first) <= set(
            _removed(seen, "GPU") + _removed(seen, "CPU") + _removed(seen, "STORAGE")))
    finally:
        sub.close(linger=0)
        device.close()


def test_a_publisher_that_fell_behind_starts_over_with_all_blocks_cleared():
    log = TierEventLog(max_queued=3)
    for i in range(5):
        log.stored(bytes([i]) * 16, None, Tier.HOT, 16)
    cleared, changes = log.take()
    assert cleared and len(changes) == 2 and log.dropped == 3
    batch = batch_of(cleared, changes, 0.0)
    assert isinstance(batch.events[0], AllBlocksCleared)
    assert log.take() == (False, [])


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv (make vllm-venv)")
def test_vllms_own_decoder_reads_memkvs_batches():
    log = TierEventLog()
    log.stored(b"a" * 16, None, Tier.HOT, 16)
    log.stored(b"b" * 16, b"a" * 16, Tier.HOT, 16)
    log.removed(b"a" * 16, Tier.HOT)
    log.stored(b"a" * 16, None, Tier.COLD, 16)
    payload = encode_batch(batch_of(*log.take(), 12.5))
    read = subprocess.run(
        [str(VLLM_PYTHON), "-c",
         "import sys, msgspec\n"
         "from vllm.distributed.kv_events import KVEventBatch\n"
         "batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(sys.stdin.buffer.read())\n"
         "for e in batch.events:\n"
         "    print(type(e).__name__, e.medium, [bytes(h)[:1].decode() for h in e.block_hashes],"
         " getattr(e, 'parent_block_hash', None))\n"
         "print(batch.ts)\n"],
        input=payload, capture_output=True, timeout=120, check=True)
    assert read.stdout.decode().splitlines() == [
        "BlockStored GPU ['a', 'b'] None", "BlockRemoved GPU ['a'] None",
        "BlockStored STORAGE ['a'] None", "12.5"]
