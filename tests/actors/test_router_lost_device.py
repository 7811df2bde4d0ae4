"""A device whose node died is lost for good: the router moves its sessions to the others.

A real SessionRouter over two real devices that share one cold tier (the way
two devices of a node share its archive); the first device's handle then
answers every call with MemberLostError, as a Ray actor pinned to a dead node
does (``ActorUnschedulableError``). No Ray.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import pytest
import torch

from memkv.device.service import DeviceService
from memkv.errors import BlockLostError, MemberLostError
from memkv.protocol.enums import AckMode, SessionState
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.services import AppendTurn, CreateSession, LayoutSpec
from memkv.router.service import SessionRouter
from memkv.storage.config import AllocatorConfig, ArchiveConfig, CodecConfig, StoreConfig
from memkv.storage.layout import KVLayout, split_kv
from memkv.storage.payloads import to_payload
from memkv.storage.tiers import ColdTier

from ..api.fakes import Resolved

LAYOUT = KVLayout("lost-model", 2, 2, 8, block_tokens=4)
UNIT = 4096


class _Node:
    """A device as a BlockStore in this process, whose node can die: then every
    call raises MemberLostError."""

    def __init__(self, device: DeviceService) -> None:
        self.device = device
        self.endpoint = device
        self.dead = False

    def __getattr__(self, name: str):
        method = getattr(self.device, name)

        async def run(*args, **kwargs):
            if self.dead:
                raise MemberLostError("the actor's node is gone")
            return method(*args, **kwargs)

        # Sent at once, as an actor call is (a caller may not wait for the answer).
        return lambda *args, **kwargs: asyncio.ensure_future(run(*args, **kwargs))


def _device(name: str, cold: ColdTier, scope: str) -> DeviceService:
    cfg = StoreConfig(hot_capacity_bytes=16 * UNIT, warm_capacity_bytes=16 * UNIT,
                      allocator=AllocatorConfig(min_unit_bytes=UNIT), debug_refcounts=True)
    return DeviceService(name, cfg, cold_tier=lambda _codecs: cold, put_object=Resolved,
                         archive_name="archive-0", segment_scope=scope)


def _turn(sid: str, tokens: list[int]) -> tuple[AppendTurn, list, list[bytes]]:
    g = torch.Generator().manual_seed(len(tokens))
    shape = (LAYOUT.num_kv_heads, len(tokens), LAYOUT.head_dim)
    keys = [torch.randn(shape, generator=g).half() for _ in range(LAYOUT.num_layers)]
    values = [torch.randn(shape, generator=g).half() for _ in range(LAYOUT.num_layers)]
    chain = [bytes(k) for k in chain_hashes(tokens, LAYOUT, "n")]
    payloads = [to_payload(k, b) for k, b in zip(chain, split_kv(LAYOUT, keys, values),
                                                  strict=True)]
    return AppendTurn(session_id=sid, token_ids=AppendTurn.pack_tokens(tokens)), payloads, chain


@contextmanager
def devices_sharing(cold: ColdTier, scope: str, names: tuple[str, ...] = ("dev-a", "dev-b"),
                    node: type[_Node] | None = None, **router_options):
    """A real router over real devices sharing ``cold``; the first device registered.

    ``node``: the class of the last device's handle (a device that dies on cue).
    Yields ``(router, nodes, devices, loop)``.
    """
    devices = [_device(n, cold, scope) for n in names]
    nodes = [(node if node is not None and i == len(names) - 1 else _Node)(d)
             for i, d in enumerate(devices)]
    router = SessionRouter(background_prefetch_interval_s=3600, **router_options)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(router.register_device(names[0], nodes[0]))
    try:
        yield router, nodes, devices, loop
    finally:
        router.background.cancel()
        loop.run_until_complete(asyncio.sleep(0))  # let the cancelled task end
        for d in devices:
            d.close()
        loop.close()


@pytest.fixture
def cluster(tmp_path):
    cold = ColdTier(ArchiveConfig(directory=tmp_path / "cold", fsync="never"), CodecConfig())
    with devices_sharing(cold, tmp_path.name) as made:
        yield made


def test_archive_mode_sessions_of_a_lost_device_move_whole_and_memory_ones_say_why(cluster):
    router, nodes, devices, loop = cluster
    tokens = list(range(10))  # 3 blocks, the last partial

    async def scenario():
        views = {}
        for sid, ack in (("durable", AckMode.ARCHIVE), ("volatile", AckMode.MEMORY)):
            views[sid] = await router.create_session(
                CreateSession(session_id=sid, layout=LayoutSpec.of(LAYOUT), namespace="n",
                              ack=ack))
        chains = {}
        for sid in views:  # both on dev-a, the only device yet
            request, payloads, chains[sid] = _turn(sid, tokens if sid == "durable"
                                                   else [t + 100 for t in tokens])
            await router.put_blocks(request, payloads)
            assert router.state.get(sid).device_id == "dev-a"
        await router.register_device("dev-b", nodes[1])
        nodes[0].dead = True
        durable = await router.resume("durable")
        with pytest.raises(BlockLostError, match="gone"):
            await router.resume("volatile")
        return chains, durable

    chains, durable = loop.run_until_complete(scenario())
    assert durable.device_id == "dev-b"
    assert durable.tokens == len(tokens)
    assert [b.key for b in durable.blocks] == chains["durable"]
    read = devices[1].get_blocks(chains["durable"])
    _, payloads, _ = _turn("durable", tokens)
    assert [p.data.tobytes() for p in read] == [p.data.tobytes() for p in payloads]
    assert router.state.get("durable").state is SessionState.ACTIVE
    assert "dev-a" in router.members.lost and "dev-a" not in router.members.devices
    # The cluster's figures leave the lost device out rather than fail.
    stats = loop.run_until_complete(router.stats())
    assert set(stats.devices) == {"dev-b"}


def test_a_new_session_is_never_placed_on_a_lost_device(cluster):
    router, nodes, _, loop = cluster
    loop.run_until_complete(router.register_device("dev-b", nodes[1]))
    nodes[0].dead = True

    async def scenario():
        await router.device_failed("dev-a")
        placed = []
        for i in range(4):
            sid = f"s{i}"
            await router.create_session(
                CreateSession(session_id=sid, layout=LayoutSpec.of(LAYOUT), namespace="n"))
            request, payloads, _ = _turn(sid, [i * 1000 + t for t in range(4)])
            await router.put_blocks(request, payloads)
            placed.append(router.state.get(sid).device_id)
        return placed

    assert loop.run_until_complete(scenario()) == ["dev-b"] * 4


def test_the_cluster_figures_leave_a_device_out_when_they_find_it_lost(cluster):
    router, nodes, _, loop = cluster
    loop.run_until_complete(router.register_device("dev-b", nodes[1]))
    nodes[0].dead = True
    stats = loop.run_until_complete(router.stats())
    assert set(stats.devices) == {"dev-b"}
    assert "dev-a" in router.members.lost
