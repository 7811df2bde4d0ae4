"""The same-node read path against a plain DeviceCache (no Ray): plans, leases, errors."""

import os

import numpy as np
import pytest
import torch

from memkv.actors.device import DeviceCache
from memkv.device.leases import LeaseTable
from memkv.errors import (
    InvariantViolationError,
    LeaseExpiredError,
    UnknownBlockError,
    WrongNodeError,
)
from memkv.protocol.hashing import chain_hashes
from memkv.router.sessions import SessionTable
from memkv.shm.same_node import SameNodeReader, copy_entries
from memkv.storage.config import AllocatorConfig, ArchiveConfig, StoreConfig
from memkv.storage.layout import KVLayout, split_kv
from memkv.storage.payloads import to_payload

LAYOUT = KVLayout("same-node", 2, 2, 8, block_tokens=4)
UNIT = 4096  # 8 blocks of 512 bytes


class SteppingClock:
    """Monotonic time that the test moves by hand."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_blocks(tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_kv_heads, tokens, LAYOUT.head_dim)
    ks = [torch.randn(shape, generator=g).half() for _ in range(LAYOUT.num_layers)]
    vs = [torch.randn(shape, generator=g).half() for _ in range(LAYOUT.num_layers)]
    return split_kv(LAYOUT, ks, vs)


@pytest.fixture
def device(tmp_path):
    cfg = StoreConfig(
        hot_capacity_bytes=UNIT,
        warm_capacity_bytes=UNIT,
        allocator=AllocatorConfig(min_unit_bytes=UNIT),
        archive=ArchiveConfig(directory=tmp_path, fsync="never"),
        debug_refcounts=True,
    )
    dev = DeviceCache(f"same-node-{os.getpid()}-{tmp_path.name}", cfg)
    dev.clock = SteppingClock()
    dev.leases = LeaseTable(
        lambda keys: dev.pool.unpin_blocks([bytes(k) for k in keys]), clock=dev.clock
    )
    yield dev
    dev.close()


def put(dev, sid, tokens, seed=0, namespace="t"):
    """Store a session's blocks on ``dev`` the way its owner (the router) would."""
    owner = SessionTable()
    owner.create(sid, LAYOUT, namespace=namespace)
    blocks = make_blocks(tokens, seed)
    chain = [bytes(k) for k in chain_hashes(range(tokens), LAYOUT, namespace)]
    dev.put(owner.plan_append(sid, tokens, chain), [to_payload(b"", b) for b in blocks])
    return chain, blocks


def test_reads_are_byte_identical_and_release_their_pins(device):
    chain, blocks = put(device, "s", 16)
    with SameNodeReader(device, node_id=device.node_id, clock=device.clock) as reader:
        got = reader.read(chain)
    assert [g.key for g in got] == chain
    for g, b in zip(got, blocks, strict=True):
        assert g.exact and g.found == "hot" and g.dtype == "float16"
        assert np.array_equal(g.array, b.numpy())
    assert len(device.leases) == 0
    with pytest.raises(InvariantViolationError):
        device.pool.unpin_blocks(chain[:1])  # nothing left pinned


def test_reads_into_caller_buffers(device):
    chain, blocks = put(device, "s", 8)
    out = [np.zeros(LAYOUT.block_nbytes(), dtype=np.uint8) for _ in chain]
    reader = SameNodeReader(device, node_id=device.node_id, clock=device.clock)
    got = reader.read(chain, out=out)
    for g, o, b in zip(got, out, blocks, strict=True):
        assert np.shares_memory(g.array, o)
        assert o.tobytes() == b.numpy().tobytes()


def test_an_expired_lease_raises_and_returns_nothing(device):
    chain, _ = put(device, "s", 8)
    reader = SameNodeReader(device, node_id=device.node_id, ttl_s=5, clock=device.clock)
    plan = reader.plan(chain)
    device.clock.t += 6  # the reader stalled past its lease
    assert reader.release(plan) is False
    assert device.leases.expired == 1

    # Through read(): the clock jumps while the copy runs.
    real_copy = __import__("memkv.shm.same_node", fromlist=["copy_entries"]).copy_entries

    def slow_copy(*args, **kwargs):
        device.clock.t += 6
        return real_copy(*args, **kwargs)

    import memkv.shm.same_node as same_node

    same_node.copy_entries, saved = slow_copy, same_node.copy_entries
    try:
        with pytest.raises(LeaseExpiredError, match="ran out"):
            reader.read(chain)
    finally:
        same_node.copy_entries = saved
    assert len(device.leases) == 0


def test_blocks_freed_under_an_expired_plan_are_never_served(device):
    chain, blocks = put(device, "a", 8)
    reader = SameNodeReader(device, node_id=device.node_id, ttl_s=5, clock=device.clock)
    plan = reader.plan(chain)
    device.clock.t += 6
    # The expired lease is swept, the session goes, and another session's put
    # reuses the freed slots: the planned offsets now hold other bytes.
    device.leases.sweep()
    device.release(chain, True)  # session a deleted
    put(device, "b", 32, seed=7, namespace="other")
    stale = copy_entries(reader._maps, plan, [e for e in plan.entries if e is not None])
    assert any(
        s.tobytes() != b.numpy().tobytes() for s, b in zip(stale, blocks, strict=True)
    )  # what a reader that ignored its lease would get
    assert reader.release(plan) is False  # so read() raises LeaseExpiredError
    with pytest.raises(UnknownBlockError):
        reader.read(chain)


def test_blocks_evicted_after_release_are_read_again_from_where_they_went(device):
    chain, blocks = put(device, "a", 8)
    reader = SameNodeReader(device, node_id=device.node_id, clock=device.clock)
    reader.read(chain)
    put(device, "b", 32, seed=7, namespace="other")  # pushes a's blocks down
    assert any(device.pool.locate(k).value != "hot" for k in chain)
    again = reader.read(chain)
    assert [g.array.tobytes() for g in again] == [b.numpy().tobytes() for b in blocks]
    assert {g.found for g in again} - {"hot"}


def test_a_reader_on_another_node_is_refused_and_pins_nothing(device):
    chain, _ = put(device, "s", 8)
    reader = SameNodeReader(device, node_id="some-other-node")
    with pytest.raises(WrongNodeError, match="same node"):
        reader.read(chain)
    assert len(device.leases) == 0


def test_a_bad_lease_length_is_refused(device):
    chain, _ = put(device, "s", 4)
    for ttl in (0, -1, 10_000, "5", True):
        with pytest.raises(ValueError, match="ttl_s"):
            device.read_plan(chain, None, ttl)


def test_a_restarted_device_segment_is_not_read(device, tmp_path):
    chain, _ = put(device, "s", 4)
    reader = SameNodeReader(device, node_id=device.node_id, clock=device.clock)
    plan = reader.plan(chain)
    reader.release(plan)
    entry = plan.entries[0]
    from memkv.protocol.messages import ReadPlan
    from memkv.shm.same_node import SegmentMaps

    gone = ReadPlan(
        plan.lease_id,
        plan.device_id,
        plan.node_id,
        "new-incarnation",
        5.0,
        (
            type(entry)(
                **{**{f: getattr(entry, f) for f in entry.__slots__}, "segment": "memkv-gone"}
            ),
        ),
    )
    from memkv.shm.same_node import copy_entries

    with pytest.raises(LeaseExpiredError, match="gone"):
        copy_entries(SegmentMaps(), gone, [gone.entries[0]])


def test_a_device_without_same_node_reads_plans_nothing_and_reads_go_in_cluster(tmp_path):
    cfg = StoreConfig(
        hot_capacity_bytes=UNIT,
        warm_capacity_bytes=UNIT,
        allocator=AllocatorConfig(min_unit_bytes=UNIT),
        archive=ArchiveConfig(directory=tmp_path, fsync="never"),
    )
    dev = DeviceCache(f"no-plans-{os.getpid()}", cfg, same_node_reads=False)
    try:
        chain, blocks = put(dev, "s", 8)
        plan = dev.read_plan(chain)
        assert not plan.same_node and plan.entries == (None, None) and len(dev.leases) == 0
        got = SameNodeReader(dev, node_id=dev.node_id).read(chain)
        assert [g.array.tobytes() for g in got] == [b.numpy().tobytes() for b in blocks]
    finally:
        dev.close()


def test_a_lease_with_an_owner_is_released_only_by_that_owner():
    unpinned: list[tuple[bytes, ...]] = []
    table = LeaseTable(lambda keys: unpinned.append(tuple(keys)), clock=SteppingClock())
    lease = table.grant([b"k"], 10.0, owner="acme")
    assert not table.release(lease.lease_id, "evil") and not table.release(lease.lease_id)
    assert len(table) == 1 and unpinned == []  # still pinned for its owner
    assert table.release(lease.lease_id, "acme") and unpinned == [(b"k",)]
    anyone = table.grant([b"j"], 10.0)  # no owner: whoever holds the id
    assert table.release(anyone.lease_id, "evil")
