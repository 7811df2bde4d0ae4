"""A gateway over a session table split across two router shards (real classes, no Ray).

Both shards place their sessions on one device; sessions of different shards
share a prefix there. Each call must reach the session's owner, the whole-table
questions (stats, prefix match, reads by key) must merge every shard's answer,
and one shard resyncing its references after a restart must leave the other
shard's blocks alone.
"""

import asyncio

import pytest

from memkv.actors.device import DeviceCache
from memkv.actors.handles import PeerHandle
from memkv.actors.router import SessionRouterShell
from memkv.actors.router_shards import RouterShards, merge_created
from memkv.api.app import create_app
from memkv.client import Client
from memkv.errors import CapacityError, ConflictError, InvalidInputError
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.services import CreateSession, CreateSessions, LayoutSpec, Quota
from memkv.protocol.shards import shard_of
from memkv.storage.config import AllocatorConfig, ArchiveConfig, StoreConfig
from memkv.storage.layout import KVLayout, split_kv

from ..kvdata import with_shared_prefix
from .fakes import FakeHandle, Resolved
from .test_gateway_fakes import _Server

LAYOUT = KVLayout("shard-model", 2, 2, 8, block_tokens=4)
UNIT = 4096
SESSIONS = [f"agent-{i}" for i in range(8)]
PREFIX = list(range(8))  # a shared system prompt: two blocks


@pytest.fixture
def sharded(tmp_path):
    cfg = StoreConfig(
        hot_capacity_bytes=8 * UNIT,
        warm_capacity_bytes=8 * UNIT,
        allocator=AllocatorConfig(min_unit_bytes=UNIT),
        archive=ArchiveConfig(directory=tmp_path / "cold", fsync="never"),
        debug_refcounts=True,
    )
    device = DeviceCache("fake-shard-dev", cfg, put_object=Resolved)
    routers = [SessionRouterShell(background_prefetch_interval_s=3600, shard=i, shards=2)
               for i in range(2)]
    loop = asyncio.new_event_loop()
    for router in routers:
        loop.run_until_complete(router.register_device("dev-0", FakeHandle(device)))
    # Peers are found by Ray name in a deployment; here they are handed over.
    routers[0].peers._peers = [PeerHandle(FakeHandle(routers[1]))]
    routers[1].peers._peers = [PeerHandle(FakeHandle(routers[0]))]
    app = create_app(RouterShards([FakeHandle(r) for r in routers]), same_node_reads=False,
                     put_object=lambda payload: payload)
    server = _Server(app)
    yield server, device, routers, loop
    server.stop()
    device.close()
    loop.close()


def session_kv(i):
    """The shared prefix's KV (the same for every session) then the session's own block."""
    return with_shared_prefix(LAYOUT, len(PREFIX), 4, seed=1 + i)


def tokens_of(i):
    return PREFIX + [1000 + 4 * i + j for j in range(4)]


def test_each_session_goes_to_its_shard_and_shards_share_blocks(sharded):
    server, device, routers, loop = sharded
    owners = {sid: shard_of(sid, 2) for sid in SESSIONS}
    assert set(owners.values()) == {0, 1}  # both shards own some of them
    expected = {}
    with Client(server.url) as client:
        for i, sid in enumerate(SESSIONS):
            client.create_session(sid, LAYOUT, namespace="t")
            keys, values = session_kv(i)
            client.append_turn(sid, tokens_of(i), keys, values)
            expected[sid] = split_kv(LAYOUT, keys, values)
        for shard, router in enumerate(routers):
            assert sorted(r.session_id for r in router.state.sessions) == sorted(
                sid for sid, owner in owners.items() if owner == shard)
        stats = client.stats()
        assert stats["sessions"] == len(SESSIONS)
        assert stats["shard_sessions"] == [list(owners.values()).count(s) for s in (0, 1)]
        # The prefix is stored once, held by every session of both shards.
        prefix_keys = [bytes(k) for k in chain_hashes(PREFIX, LAYOUT, "t")]
        assert [device.pool.refcounts()[k][0] for k in prefix_keys] == [8, 8]
        match = client.match(LAYOUT, "t", PREFIX + [7])
        assert match.tokens == len(PREFIX) and match.blocks == prefix_keys
        got = client.read_blocks_by_key("t", prefix_keys)
        assert [b.array.tobytes() for b in got] == [
            e.numpy().tobytes() for e in expected[SESSIONS[0]][:2]]

        # Shard 0 restarts and sets its references from its table again; then
        # its sessions go. Shard 1's sessions keep every block, bit for bit.
        loop.run_until_complete(routers[0].members.resync("dev-0"))
        device.pool.check_invariants()
        for sid in [s for s in SESSIONS if owners[s] == 0]:
            client.delete_session(sid)
        kept = [s for s in SESSIONS if owners[s] == 1]
        assert [device.pool.refcounts()[k][0] for k in prefix_keys] == [len(kept)] * 2
        for sid in kept:
            got = list(client.read_blocks(sid))
            assert [b.array.tobytes() for b in got] == [e.numpy().tobytes() for e in expected[sid]]
        for sid in kept:
            client.delete_session(sid)
    assert device.pool.refcounts() == {}


def test_a_shard_refuses_a_session_it_does_not_own(sharded):
    _, _, routers, loop = sharded
    sid = next(s for s in SESSIONS if shard_of(s, 2) == 1)
    with pytest.raises(InvalidInputError, match="belongs to router shard 1 of 2"):
        loop.run_until_complete(routers[0].create_session(
            CreateSession(session_id=sid, layout=LayoutSpec.of(LAYOUT))))


def test_a_quota_counts_the_tenants_sessions_on_every_shard(sharded):
    _, _, routers, loop = sharded
    ids = [f"tenant-a/s{i}" for i in range(40)]
    created = []
    for sid in ids:
        router = routers[shard_of(sid, 2)]
        try:
            loop.run_until_complete(
                router.create_session(CreateSession(
                    session_id=sid, layout=LayoutSpec.of(LAYOUT), quota=Quota(max_sessions=5))))
        except CapacityError as e:
            assert "has 5 sessions, its quota is 5" in str(e)
            break
        created.append(sid)
    assert len(created) == 5
    assert {shard_of(s, 2) for s in created} == {0, 1}  # the five span both shards


def test_a_bulk_create_asks_the_other_shards_for_a_tenants_use_once(sharded, monkeypatch):
    _, _, routers, loop = sharded
    ids = [f"tenant-b/s{i}" for i in range(40)]
    mine = [sid for sid in ids if shard_of(sid, 2) == 0]
    theirs = next(sid for sid in ids if shard_of(sid, 2) == 1)
    loop.run_until_complete(routers[1].create_session(
        CreateSession(session_id=theirs, layout=LayoutSpec.of(LAYOUT))))
    asked = []
    totals = routers[1].tenant_totals

    async def counted(tenant):
        asked.append(tenant)
        return await totals(tenant)

    monkeypatch.setattr(routers[1], "tenant_totals", counted)
    specs = tuple(CreateSession(session_id=sid, layout=LayoutSpec.of(LAYOUT),
                                quota=Quota(max_sessions=6)) for sid in mine[:6])
    # The other shard's session counts: five more fit under a quota of six.
    with pytest.raises(CapacityError, match="spec 5 .*has 6 sessions, its quota is 6"):
        loop.run_until_complete(routers[0].create_sessions(CreateSessions(requests=specs)))
    assert asked == ["tenant-b"]
    assert len(routers[0].state.sessions) == 5


async def _gather(calls):
    return list(await asyncio.gather(*calls))


def test_a_bulk_create_over_shards_names_the_callers_index(sharded):
    _, _, routers, loop = sharded
    shards = RouterShards([FakeHandle(r) for r in routers])
    specs = [CreateSession(session_id=sid, layout=LayoutSpec.of(LAYOUT)) for sid in SESSIONS[:4]]
    indices, calls = shards.create_sessions(specs)
    answers = loop.run_until_complete(_gather(calls))
    assert [v.session_id for v in merge_created(indices, answers)] == SESSIONS[:4]
    again = [CreateSession(session_id="fresh-one", layout=LayoutSpec.of(LAYOUT)), specs[3]]
    indices, calls = shards.create_sessions(again)
    with pytest.raises(ConflictError, match="spec 1 "):
        loop.run_until_complete(_gather(calls))
