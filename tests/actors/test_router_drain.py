"""Draining a device: its sessions, memory mode included, move to another device whole.

A real SessionRouter over two real devices sharing one cold tier (as the
devices of a cluster share its archives), no Ray: the same fixture as
test_router_lost_device.
"""

from __future__ import annotations

import asyncio

import pytest

from memkv.errors import ConflictError, InvalidInputError
from memkv.protocol.enums import AckMode
from memkv.protocol.services import CreateSession, LayoutSpec
from memkv.storage.config import ArchiveConfig, CodecConfig
from memkv.storage.tiers import ColdTier

from .test_router_lost_device import LAYOUT, _Node, _turn, devices_sharing


class _Archive(ColdTier):
    """One cold tier shared by both devices, as the cluster's archives are: a device
    never deletes from it (only the router's collector does, knowing every session)."""

    def remove(self, key: bytes) -> None:
        return None


def _archive(tmp_path) -> _Archive:
    return _Archive(ArchiveConfig(directory=tmp_path / "cold", fsync="never"), CodecConfig())


@pytest.fixture
def cluster(tmp_path):
    with devices_sharing(_archive(tmp_path), tmp_path.name) as made:
        yield made


def _payload_bytes(payloads) -> list[bytes]:
    return [p.data.tobytes() for p in payloads]


def test_a_drained_device_hands_every_session_over_whole_and_takes_no_new_ones(cluster):
    router, nodes, devices, loop = cluster

    async def scenario():
        written = {}
        for i, ack in enumerate([AckMode.MEMORY, AckMode.ARCHIVE, AckMode.MEMORY]):
            sid = f"s{i}"
            await router.create_session(CreateSession(
                session_id=sid, layout=LayoutSpec.of(LAYOUT), namespace="n", ack=ack))
            request, payloads, chain = _turn(sid, [i * 1000 + t for t in range(10)])
            await router.put_blocks(request, payloads)
            written[sid] = (chain, _payload_bytes(payloads))
        # (dev-b registers after the appends: every session is on dev-a)
        await router.register_device("dev-b", nodes[1])
        report = await router.drain_device("dev-a")
        return written, report

    written, report = loop.run_until_complete(scenario())
    assert report.sessions_moved == 3 and report.sessions_lost == 0
    assert report.tokens_lost == 0 and report.moved_to == {"dev-b": 3}
    assert report.blocks_archived > 0  # the memory-mode sessions' blocks, made durable
    for sid, (chain, data) in written.items():
        assert router.state.get(sid).device_id == "dev-b"
        assert router.state.get(sid).tokens == 10
        assert [p.data.tobytes() for p in devices[1].get_blocks(chain)] == data
    # Retired: the table forgot it, placement never chooses it, a second drain says so.
    assert "dev-a" not in router.members.devices and "dev-a" not in router.state.devices

    async def after():
        await router.create_session(CreateSession(
            session_id="new", layout=LayoutSpec.of(LAYOUT), namespace="n"))
        request, payloads, _ = _turn("new", list(range(500, 508)))
        await router.put_blocks(request, payloads)
        with pytest.raises(InvalidInputError, match="already gone"):
            await router.drain_device("dev-a")

    loop.run_until_complete(after())
    assert router.state.get("new").device_id == "dev-b"


def test_the_last_device_is_not_drained(cluster):
    router, _, _, loop = cluster
    with pytest.raises(ConflictError, match="only one left"):
        loop.run_until_complete(router.drain_device("dev-a"))
    with pytest.raises(InvalidInputError, match="unknown device"):
        loop.run_until_complete(router.drain_device("dev-zz"))


def test_an_append_during_a_drain_lands_before_or_after_the_move_never_between(cluster):
    router, nodes, devices, loop = cluster

    async def scenario():
        await router.create_session(CreateSession(
            session_id="busy", layout=LayoutSpec.of(LAYOUT), namespace="n"))
        first, payloads, _ = _turn("busy", list(range(8)))
        await router.put_blocks(first, payloads)
        await router.register_device("dev-b", nodes[1])
        second, more, chain = _turn("busy", list(range(16)))
        drained, _ = await asyncio.gather(router.drain_device("dev-a"),
                                          router.put_blocks(second, more))
        # The first two blocks are the first turn's (content-addressed: kept once).
        return drained, chain, _payload_bytes(payloads)[:2] + _payload_bytes(more)[2:]

    drained, chain, data = loop.run_until_complete(scenario())
    record = router.state.get("busy")
    assert record.device_id == "dev-b" and record.tokens == 16
    assert [p.data.tobytes() for p in devices[1].get_blocks(chain)] == data
    assert drained.sessions_lost == 0 and drained.tokens_lost == 0


class _DiesOnSecondAdopt(_Node):
    """A device whose node dies while a drain is moving sessions to it."""

    adopted = 0

    def __getattr__(self, name: str):
        if name == "adopt" and not self.dead:
            self.adopted += 1
            if self.adopted == 2:
                self.dead = True
        return super().__getattr__(name)


def test_a_drain_whose_target_dies_moves_the_rest_elsewhere_and_loses_nothing(tmp_path):
    names = ("dev-a", "dev-c", "dev-b")  # dev-b (last: dies on cue) is the first target
    with devices_sharing(_archive(tmp_path), tmp_path.name, names,
                         node=_DiesOnSecondAdopt) as (router, nodes, devices, loop):
        node_of = dict(zip(names, nodes, strict=True))

        async def scenario():
            written = {}
            for i in range(4):
                sid = f"s{i}"
                await router.create_session(CreateSession(
                    session_id=sid, layout=LayoutSpec.of(LAYOUT), namespace="n",
                    ack=AckMode.MEMORY))
                request, payloads, chain = _turn(sid, [i * 1000 + t for t in range(10)])
                await router.put_blocks(request, payloads)
                written[sid] = (chain, _payload_bytes(payloads))
            await router.register_device("dev-b", node_of["dev-b"])
            await router.register_device("dev-c", node_of["dev-c"])
            return written, await router.drain_device("dev-a")

        written, report = loop.run_until_complete(scenario())
        # dev-b took a session, then died with it: that session went on from the
        # archive (the drain archived it first), to dev-c like the rest.
        assert "dev-b" in router.members.lost
        assert report.sessions_lost == 0 and report.tokens_lost == 0
        for sid, (chain, data) in written.items():
            record = router.state.get(sid)
            assert record.device_id == "dev-c" and record.tokens == 10 and not record.lost
            assert [p.data.tobytes() for p in devices[1].get_blocks(chain)] == data


def test_a_device_that_joins_takes_sessions_until_loads_are_even(tmp_path):
    with devices_sharing(_archive(tmp_path), tmp_path.name,
                         rebalance_on_join=True) as (router, nodes, devices, loop):

        async def scenario():
            written = {}
            for i in range(5):
                sid = f"s{i}"
                await router.create_session(CreateSession(
                    session_id=sid, layout=LayoutSpec.of(LAYOUT), namespace="n"))
                request, payloads, chain = _turn(sid, [i * 1000 + t for t in range(10)])
                await router.put_blocks(request, payloads)
                written[sid] = (chain, _payload_bytes(payloads))
            await router.suspend("s3", False)  # idle sessions move first
            await router.register_device("dev-b", nodes[1])  # answers before the moves
            await asyncio.gather(*router._rebalancing)
            return written

        written = loop.run_until_complete(scenario())
        on = {sid: router.state.get(sid).device_id for sid in written}
        assert sorted(on.values()).count("dev-b") == 2  # 5 sessions: 3 and 2
        assert on["s3"] == "dev-b"
        for sid, (chain, data) in written.items():
            device = devices[0] if on[sid] == "dev-a" else devices[1]
            assert [p.data.tobytes() for p in device.get_blocks(chain)] == data, sid
            assert router.state.get(sid).tokens == 10
        # Even already: a second pass moves nothing.
        assert loop.run_until_complete(router.rebalance_device("dev-b")) == 0
