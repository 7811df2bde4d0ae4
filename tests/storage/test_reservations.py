"""Write reservations (memkv.device.reservations): a writer on the device's node
fills slots of its shared memory, the append names them, the device adopts the bytes
where they are (no copy), and slots nobody named go back."""

from __future__ import annotations

import mmap
import os
import uuid

import numpy as np
import pytest
import torch

from memkv.device import DeviceService
from memkv.errors import InvalidInputError, LeaseExpiredError
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.layout import block_token_count
from memkv.protocol.members import SlotGrant
from memkv.protocol.payload import StagedBlock
from memkv.router.sessions import SessionTable
from memkv.storage.config import AllocatorConfig, ArchiveConfig, StoreConfig
from memkv.storage.layout import KVLayout
from memkv.storage.payloads import from_payload

LAYOUT = KVLayout("reserve", 2, 2, 8, dtype="float32", block_tokens=4)
BLOCK = LAYOUT.block_nbytes()
UNIT = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def device(tmp_path, clock):
    cfg = StoreConfig(
        hot_capacity_bytes=16 * UNIT, warm_capacity_bytes=16 * UNIT,
        allocator=AllocatorConfig(min_unit_bytes=UNIT),
        archive=ArchiveConfig(directory=tmp_path, fsync="never"),
        debug_refcounts=True,
    )
    service = DeviceService(f"reserve-{uuid.uuid4().hex[:8]}", cfg, node_id="n1", clock=clock)
    yield service
    service.close()


def _write(grant: SlotGrant, blocks: list[torch.Tensor]) -> None:
    """What the writer does: map the device's segment and copy each block to its slot."""
    fd = os.open(f"/dev/shm/{grant.segment}", os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, grant.segment_bytes)
    finally:
        os.close(fd)
    array = np.frombuffer(mapped, dtype=np.uint8)
    for block, offset in zip(blocks, grant.offsets, strict=False):
        raw = block.contiguous().view(torch.uint8).numpy().reshape(-1)
        array[offset : offset + raw.size] = raw
    del array
    mapped.close()


def _named(grant: SlotGrant, chain: list[bytes], blocks: list[torch.Tensor],
           **change: object) -> list[StagedBlock]:
    out = []
    for key, block, offset in zip(chain, blocks, grant.offsets, strict=False):
        fields = dict(key=key, dtype=LAYOUT.dtype, shape=tuple(block.shape),
                      segment=grant.segment, segment_bytes=grant.segment_bytes,
                      incarnation=grant.incarnation, offset=offset,
                      nbytes=block.numel() * block.element_size(), node_id=grant.node_id,
                      reservation=grant.reservation_id)
        fields.update(change)
        out.append(StagedBlock(**fields))  # type: ignore[arg-type]
    return out


def _turn(table: SessionTable, sid: str, tokens: list[int]):
    if sid not in table:
        table.create(sid, LAYOUT, namespace="t")
    chain = [bytes(k) for k in chain_hashes(tokens, LAYOUT, "t")]
    counts = block_token_count(LAYOUT, len(tokens))
    blocks = [torch.randn(LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, n, LAYOUT.head_dim)
              for n in counts]
    return table.plan_append(sid, len(tokens), chain, 0), chain, blocks


def test_named_slots_are_adopted_where_they_lie_and_read_back_exactly(device):
    table = SessionTable()
    update, chain, blocks = _turn(table, "s", list(range(10)))  # 2 full blocks and a tail
    grant = device.reserve_slots(len(blocks), BLOCK)
    assert grant is not None and len(set(grant.offsets)) == 3
    assert grant.segment == device.pool.hot_tier.arena.name  # a CPU device's hot tier
    _write(grant, blocks)
    stored = device.put(update, _named(grant, chain, blocks))
    assert stored.new_blocks == 3
    # Adopted: each block lives at the offset it was written to (no copy was made).
    for key, offset in zip(chain, grant.offsets, strict=True):
        assert device.pool.hot_tier.location(key)[0] == offset
    for key, block in zip(chain, blocks, strict=True):
        got = from_payload(device.get_blocks([key])[0])
        assert torch.equal(got, block)
    assert device.reservations.adopted_slots == 3 and len(device.reservations) == 0
    # Each block got its CRC32 where it lay: a same-node plan serves it.
    plan = device.read_plan(chain)
    assert all(e is not None and e.crc32 is not None for e in plan.entries)
    device.release_lease(plan.lease_id)


def test_duplicates_and_unnamed_slots_go_back(device):
    table = SessionTable()
    update, chain, blocks = _turn(table, "a", list(range(8)))
    device.put(update, [b for b in blocks])  # stored by value first
    table.commit_append("a", update)
    used = device.pool.hot_tier.arena.stats().used_bytes
    update_b, chain_b, blocks_b = _turn(table, "b", list(range(8)))  # the same blocks
    grant = device.reserve_slots(4, BLOCK)  # two more than the append names
    assert grant is not None
    _write(grant, blocks_b)
    stored = device.put(update_b, _named(grant, chain_b, blocks_b))
    assert stored.new_blocks == 0 and stored.deduplicated_blocks == 2
    assert device.pool.hot_tier.arena.stats().used_bytes == used  # every slot went back
    assert len(device.reservations) == 0


def test_a_reservation_that_runs_out_goes_back_and_cannot_be_named(device, clock):
    table = SessionTable()
    update, chain, blocks = _turn(table, "s", list(range(8)))
    before = device.pool.hot_tier.arena.stats().used_bytes
    grant = device.reserve_slots(2, BLOCK, ttl_s=5)
    assert grant is not None
    assert device.pool.hot_tier.arena.stats().used_bytes == before + 2 * BLOCK
    clock.now += 6
    with pytest.raises(LeaseExpiredError, match="not held here"):
        device.put(update, _named(grant, chain, blocks))
    assert device.pool.hot_tier.arena.stats().used_bytes == before
    assert device.reservations.expired == 1
    assert device.pool.stats().blocks == 0  # nothing half-stored


def test_a_block_naming_a_slot_it_was_not_given_is_refused_and_frees_the_rest(device):
    table = SessionTable()
    update, chain, blocks = _turn(table, "s", list(range(8)))
    before = device.pool.hot_tier.arena.stats().used_bytes
    grant = device.reserve_slots(2, BLOCK)
    assert grant is not None
    wrong = _named(grant, chain, blocks)
    wrong[1] = _named(grant, chain[1:], blocks[1:], offset=grant.offsets[0] + 64)[0]
    with pytest.raises(InvalidInputError, match="not an open slot"):
        device.put(update, wrong)
    assert device.pool.hot_tier.arena.stats().used_bytes == before
    assert device.pool.stats().blocks == 0


def test_reservations_are_bounded(device):
    with pytest.raises(InvalidInputError, match="positive"):
        device.reserve_slots(0, BLOCK)
    with pytest.raises(InvalidInputError, match="ttl_s"):
        device.reserve_slots(1, BLOCK, ttl_s=0)
    # At most half the tier is held by reservations at a time.
    half = device.pool.shared_capacity_bytes() // 2 // BLOCK
    assert device.reserve_slots(half + 1, BLOCK) is None
    assert device.reserve_slots(half, BLOCK) is not None
    assert device.reserve_slots(1, BLOCK) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_device_reserves_in_its_warm_tier_and_adopts_there(tmp_path):
    """A writer cannot map GPU memory: a CUDA device's slots are in its (pinned,
    shared) warm tier, and blocks adopted there read back exactly."""
    from memkv.protocol.enums import Tier

    cfg = StoreConfig(
        device="cuda:0", hot_capacity_bytes=16 * UNIT, warm_capacity_bytes=16 * UNIT,
        allocator=AllocatorConfig(min_unit_bytes=UNIT),
        archive=ArchiveConfig(directory=tmp_path, fsync="never"),
    )
    service = DeviceService(f"reserve-gpu-{uuid.uuid4().hex[:8]}", cfg, node_id="n1")
    try:
        table = SessionTable()
        update, chain, blocks = _turn(table, "s", list(range(8)))
        grant = service.reserve_slots(len(blocks), BLOCK)
        assert grant is not None and grant.segment == service.pool.warm_tier.arena.name
        _write(grant, blocks)
        service.put(update, _named(grant, chain, blocks))
        for key, block in zip(chain, blocks, strict=True):
            assert service.pool.locate(key) is Tier.WARM
            assert torch.equal(from_payload(service.get_blocks([key])[0]), block)
    finally:
        service.close()
