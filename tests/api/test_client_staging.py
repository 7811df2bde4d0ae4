"""Appends a same-host client stages in its own shared memory (memkv.api.client_segments).

The blocks are named (segment, offset), not sent; the gateway checks them where
they lie and the device copies them from there. Over the block port and HTTP,
against the session's cluster and gateway (on this host).
"""

from __future__ import annotations

import os
import uuid

import msgpack
import numpy as np
import pytest
import torch

from memkv.client import Client
from memkv.client.frames import append_body
from memkv.errors import InvalidInputError
from memkv.port_connection import PortConnection, PortError
from memkv.shm.staging import client_staging
from memkv.storage.layout import KVLayout, split_kv

from ..kvdata import random_kv

LAYOUT = KVLayout("stage-test", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)


def _staged_blocks(client: Client, tokens: int, seed: int):
    """The KV of ``tokens`` tokens, written into a slot of the client's staging; the slot,
    the staged blocks and a copy of them held elsewhere."""
    keys, values = random_kv(LAYOUT, tokens, seed)
    expected = split_kv(LAYOUT, keys, values)
    staging = client.staging(1 << 20)
    assert staging is not None
    nbytes = sum(b.numel() * b.element_size() for b in expected)
    slot = staging.lease(nbytes)
    view = slot.take(nbytes)
    words = torch.frombuffer(view, dtype=torch.uint8).view(expected[0].dtype)
    staged = words.view(len(expected), *expected[0].shape)
    for i, block in enumerate(expected):
        staged[i].copy_(block)
    return slot, [staged[i] for i in range(len(expected))], expected


def _tokens(seed: int, count: int = 8) -> list[int]:
    """Tokens of this test's own (blocks are stored by their tokens' hash)."""
    return [seed * 1000 + i for i in range(count)]


def _new_session(client: Client) -> str:
    sid = f"stage-{uuid.uuid4().hex[:8]}"
    client.create_session(sid, LAYOUT, namespace=None)
    return sid


@pytest.mark.parametrize("block_port", [True, False], ids=["block port", "http"])
def test_staged_blocks_are_named_not_sent_and_read_back_exactly(gateway, block_port):
    with Client(gateway.url, block_port=block_port) as c:
        sid = _new_session(c)
        seed = 3 if block_port else 4
        slot, blocks, expected = _staged_blocks(c, 8, seed=seed)
        tokens = _tokens(seed)
        before = c.stats()["gateway"]
        body, _ = append_body(c.session(sid), tokens, blocks, None, None, 0, None,
                              c.staging(1 << 20))
        assert sum(memoryview(x).nbytes for x in body) < 2048  # headers only, no payloads
        # Nothing crossed a wire: no checksum is sent, the device makes each as it stores.
        assert b"crc32" not in b"".join(bytes(x) for x in body)
        result = c.append_turn(sid, tokens, blocks=blocks, start_block=0)
        assert result.new_blocks == 2 and c.stages_appends
        slot.release()  # the device copied the bytes before the append was answered
        got = list(c.read_blocks(sid))
        assert all(torch.equal(b.tensor, e) for b, e in zip(got, expected, strict=True))
        after = c.stats()["gateway"]
        assert after["staged_bytes"] - before["staged_bytes"] == sum(
            e.numel() * e.element_size() for e in expected)


def test_staged_bytes_that_fail_their_checksum_are_refused_and_nothing_is_stored(gateway):
    with Client(gateway.url) as c:
        sid = _new_session(c)
        slot, blocks, _ = _staged_blocks(c, 8, seed=5)
        # A writer may send its checksums with staged blocks: then they are checked.
        body, _ = append_body(c.session(sid), _tokens(5), blocks, None, None, 0, None,
                              c.staging(1 << 20), checksum_staged=True)
        blocks[1].view(torch.uint8)[0] ^= 0xFF  # changed after its checksum was made
        conn = PortConnection("127.0.0.1", gateway.block_port, token=None, timeout=10)
        try:
            with pytest.raises(PortError) as bad:
                conn.request({"op": "append", "session_id": sid}, body)
            assert bad.value.status == 422 and "checksum" in bad.value.error["message"]
        finally:
            conn.close()
        assert c.session(sid).turn == 0
        slot.release()


def test_a_staged_block_may_name_only_a_client_staging_segment(gateway):
    """Not a device's pool, not a gateway's staging: nothing another tenant wrote."""
    with Client(gateway.url) as c:
        sid = _new_session(c)
        slot, blocks, _ = _staged_blocks(c, 4, seed=6)
        body, _ = append_body(c.session(sid), _tokens(6, 4), blocks, None, None, 0, None,
                              c.staging(1 << 20))
        staging = c.staging(1 << 20)
        assert staging is not None
        pools = [n for n in os.listdir("/dev/shm")
                 if n.startswith("memkv-warm-") and not n.endswith(".lock")
                 and "client-stage" not in n]
        assert pools  # the cluster's devices and the gateway's staging
        forged = [bytes(x).replace(staging.segment.encode(), pools[0].encode()[:len(
            staging.segment)].ljust(len(staging.segment), b"x")) for x in body]
        conn = PortConnection("127.0.0.1", gateway.block_port, token=None, timeout=10)
        try:
            with pytest.raises(PortError) as bad:
                conn.request({"op": "append", "session_id": sid}, forged)
            assert bad.value.status == 422
            assert "client staging segment" in bad.value.error["message"]
        finally:
            conn.close()
        assert c.session(sid).turn == 0
        slot.release()


def test_a_gateway_that_cannot_see_the_segment_gets_the_bytes_instead(gateway):
    """As from another host: the client's segment is not in the gateway's /dev/shm."""
    with Client(gateway.url) as c:
        sid = _new_session(c)
        slot, blocks, expected = _staged_blocks(c, 8, seed=7)
        staging = c.staging(1 << 20)
        assert staging is not None
        os.unlink(f"/dev/shm/{staging.segment}")  # the client keeps its mapping
        try:
            result = c.append_turn(sid, _tokens(7), blocks=blocks, start_block=0)
            assert result.new_blocks == 2 and not c.stages_appends
            got = list(c.read_blocks(sid))
            assert all(torch.equal(b.tensor, e) for b, e in zip(got, expected, strict=True))
        finally:
            # (close() unlinks: recreate the name so it has something to unlink)
            open(f"/dev/shm/{staging.segment}", "wb").close()
        slot.release()


def test_client_segments_are_unguessable_and_prefaulted():
    a, b = client_staging(1 << 20), client_staging(1 << 20)
    assert a is not None and b is not None
    try:
        assert a.segment != b.segment and len(a.incarnation) == 32
        a.prefault()
        assert int(np.count_nonzero(a.array)) == 0
    finally:
        a.close()
        b.close()
    with pytest.raises(InvalidInputError):
        from memkv.api.client_segments import ClientSegments

        ClientSegments().resolve("memkv-warm-device-0", 0, 16)


def test_the_async_client_stages_its_appends_too(gateway):
    import asyncio

    from memkv.client import AsyncClient

    async def main() -> None:
        async with AsyncClient(gateway.url) as c:
            sid = f"stage-{uuid.uuid4().hex[:8]}"
            await c.create_session(sid, LAYOUT, namespace=None)
            keys, values = random_kv(LAYOUT, 8, 9)
            expected = split_kv(LAYOUT, keys, values)
            staging = c.staging(1 << 20)
            assert staging is not None
            nbytes = sum(b.numel() * b.element_size() for b in expected)
            slot = staging.lease(nbytes)
            words = torch.frombuffer(slot.take(nbytes), dtype=torch.uint8)
            staged = words.view(expected[0].dtype).view(len(expected), *expected[0].shape)
            for i, block in enumerate(expected):
                staged[i].copy_(block)
            result = await c.append_turn(sid, _tokens(9), blocks=list(staged), start_block=0)
            assert result.new_blocks == 2 and c.stages_appends
            slot.release()
            got = [b async for b in c.read_blocks(sid)]
            assert all(torch.equal(b.tensor, e) for b, e in zip(got, expected, strict=True))

    asyncio.run(main())


def _reserved_blocks(client: Client, sid: str, tokens: list[int], seed: int):
    """A write reservation for the KV of ``tokens``, each block copied into its slot."""
    keys, values = random_kv(LAYOUT, len(tokens), seed)
    expected = split_kv(LAYOUT, keys, values)
    reservation = client.reserve_slots(sid, len(expected), tokens=tokens)
    assert reservation is not None and reservation.writable
    blocks = []
    for i, block in enumerate(expected):
        nbytes = block.numel() * block.element_size()
        slot = torch.from_numpy(reservation.slot(i)[:nbytes]).view(block.dtype).view(block.shape)
        slot.copy_(block)
        blocks.append(slot)
    return reservation, blocks, expected


@pytest.mark.parametrize("block_port", [True, False], ids=["block port", "http"])
def test_reserved_slots_are_filled_in_place_and_adopted_without_a_copy(gateway, block_port):
    with Client(gateway.url, block_port=block_port) as c:
        sid = _new_session(c)
        seed = 11 if block_port else 12
        tokens = _tokens(seed, 10)  # two full blocks and a partial tail
        reservation, blocks, expected = _reserved_blocks(c, sid, tokens, seed)
        body, _ = append_body(c.session(sid), tokens, blocks, None, None, 0, None,
                              reserved=reservation)
        assert sum(memoryview(x).nbytes for x in body) < 2048  # headers only, no payloads
        result = c.append_turn(sid, tokens, blocks=blocks, start_block=0, reserved=reservation)
        assert result.new_blocks == 3
        # Stored where the client wrote them: no copy was made.
        lease = c.lease_blocks(None, c.session(sid).chain)
        try:
            assert [(e.segment, e.offset) for _, e in lease.blocks] == [
                (reservation.segment, o) for o in reservation.offsets]
        finally:
            for plan in lease.plans:
                c.release_lease(plan.lease_id)
        got = list(c.read_blocks(sid))
        assert all(torch.equal(b.tensor, e) for b, e in zip(got, expected, strict=True))


def test_a_reserved_slot_named_wrongly_is_refused_and_nothing_is_stored(gateway):
    with Client(gateway.url) as c:
        sid = _new_session(c)
        tokens = _tokens(13)
        reservation, blocks, _ = _reserved_blocks(c, sid, tokens, 13)
        body, _ = append_body(c.session(sid), tokens, blocks, None, None, 0, None,
                              reserved=reservation)
        # Block 1 names another offset of the same segment: not a slot it was given.
        frame = bytes(body[2])  # after the turn frame's prefix and header
        offset = reservation.offsets[1]
        assert msgpack.packb(offset) in frame
        wrong = [*body[:2], frame.replace(msgpack.packb(offset), msgpack.packb(offset + 64)),
                 *body[3:]]
        conn = PortConnection("127.0.0.1", gateway.block_port, token=None, timeout=10)
        try:
            with pytest.raises(PortError) as bad:
                conn.request({"op": "append", "session_id": sid}, wrong)
            assert bad.value.status == 422 and "not an open slot" in bad.value.error["message"]
        finally:
            conn.close()
        assert c.session(sid).turn == 0
        # A reservation named by a failed append is over: its slots went back.
        with pytest.raises(Exception, match="not held here"):
            c.append_turn(sid, tokens, blocks=blocks, start_block=0, reserved=reservation)


def test_a_reservation_may_not_name_a_client_staging_segment(gateway):
    with Client(gateway.url) as c:
        from memkv.api.client_segments import ClientSegments

        staging = c.staging(1 << 20)
        assert staging is not None
        with pytest.raises(InvalidInputError, match="device's segment"):
            ClientSegments().resolver("ab" * 16)(staging.segment, 0, 16)


def test_blocks_of_another_layout_are_refused_not_hashed_as_the_sessions(gateway):
    """An engine of another model appending to a session id that exists: refused
    rather than its KV stored under the session's model's hashes."""
    from memkv.errors import ConflictError

    other = KVLayout("another-model", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
    with Client(gateway.url) as c:
        sid = _new_session(c)
        keys, values = random_kv(LAYOUT, 8, 14)
        with pytest.raises(ConflictError, match="another-model"):
            c.append_turn(sid, _tokens(14), blocks=split_kv(LAYOUT, keys, values),
                          start_block=0, layout=other)
        assert c.session(sid).turn == 0
        c.append_turn(sid, _tokens(14), blocks=split_kv(LAYOUT, keys, values), start_block=0,
                      layout=LAYOUT)
        assert c.session(sid).turn == 1


def test_a_client_maps_the_reservation_segments_of_its_host_at_start(gateway):
    with Client(gateway.url) as c:
        segments = c.host_segments()
        # Each device's hot and warm tiers; reservations in the hot one (a CPU device's).
        assert len(segments) == 4 and sum(s["reservable"] for s in segments) == 2
        assert c.map_reservation_segments(segments) == 2
        segments = c._device_segments
        assert segments is not None and len(segments._maps) == 2
        sid = _new_session(c)
        reservation, _, _ = _reserved_blocks(c, sid, _tokens(15), 15)
        assert reservation.segment in segments._maps  # the mapping made at start


def test_the_vllm_transport_maps_this_hosts_device_segments_at_start(gateway):
    """What the connector does when its engine starts: every device segment of the host
    mapped for loads, the reservable ones writable for saves, page tables populated."""
    from memkv.integrations.vllm.transport import GatewayTransport
    from memkv.shm.same_node import SegmentMaps

    transport = GatewayTransport(LAYOUT, url=gateway.url, token=None, namespace=None,
                                 save_staging_bytes=1 << 20)
    maps = SegmentMaps()
    try:
        transport.prepare_shared_memory(maps, reservations=True)
        assert len(maps._maps) == 4  # two devices, hot and warm each
        assert len(transport._client._device_segments._maps) == 2
    finally:
        maps.close()
        transport.close()


def test_the_async_client_fills_reserved_slots_too(gateway):
    import asyncio

    from memkv.client import AsyncClient

    async def main() -> None:
        async with AsyncClient(gateway.url) as c:
            sid = f"stage-{uuid.uuid4().hex[:8]}"
            await c.create_session(sid, LAYOUT, namespace=None)
            tokens = _tokens(16)
            keys, values = random_kv(LAYOUT, len(tokens), 16)
            expected = split_kv(LAYOUT, keys, values)
            reservation = await c.reserve_slots(sid, len(expected), tokens=tokens)
            assert reservation is not None
            blocks = []
            for i, block in enumerate(expected):
                slot = torch.from_numpy(reservation.slot(i)).view(block.dtype)
                blocks.append(slot[: block.numel()].view(block.shape))
                blocks[-1].copy_(block)
            result = await c.append_turn(sid, tokens, blocks=blocks, start_block=0,
                                         reserved=reservation, layout=LAYOUT)
            assert result.new_blocks == len(expected)
            got = [b async for b in c.read_blocks(sid)]
            assert all(torch.equal(b.tensor, e) for b, e in zip(got, expected, strict=True))

    asyncio.run(main())


@pytest.mark.parametrize("scoped", [None, "p7"], ids=["namespace", "partition"])
def test_the_vllm_transport_appends_a_turn_by_reference_to_a_new_session(gateway, scoped):
    """What the connector sends for a named session's turn whose every full block vLLM's
    prefix cache held: no bytes, the turn's tokens; memkv holds the blocks (stored for
    another session), and the named session is made of them, read back exactly."""
    from memkv.integrations.vllm.transport import GatewayTransport

    transport = GatewayTransport(LAYOUT, url=gateway.url, token=None, namespace=None)
    scoped_transport = transport.scoped(scoped)
    tokens = _tokens(31, 12)
    keys, values = random_kv(LAYOUT, 12, 31)
    blocks = split_kv(LAYOUT, keys, values)
    try:
        scoped_transport.save("ref-first", "normal", tokens, blocks, 0)  # computed once
        named = f"ref-{uuid.uuid4().hex[:8]}"
        scoped_transport.save(named, "normal", tokens, [], len(blocks))  # by reference
        own = named if scoped is None else f"{named}:{scoped}"
        with Client(gateway.url) as c:
            view = c.session(own)
            assert view.tokens == 12 and view.chain == c.session(
                "ref-first" if scoped is None else f"ref-first:{scoped}").chain
            got = list(c.read_blocks(own))
            assert len(got) == len(blocks) and all(block.exact for block in got)
            for block, expected in zip(got, blocks, strict=True):
                assert torch.equal(block.tensor, expected)
        # Blocks memkv does not hold cannot be referenced: refused, nothing stored.
        with pytest.raises(Exception, match="not stored"):
            scoped_transport.save(f"ref-{uuid.uuid4().hex[:8]}", "normal", _tokens(32, 12),
                                  [], 3)
    finally:
        transport.close()
