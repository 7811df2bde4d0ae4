"""A session table split over two router shards, on the shared cluster's devices.

The shards are extra router actors of their own (a journal each) beside the
suite's router: three owners of references on the same device actors. One
shard is killed with SIGKILL; Ray restarts it, it rebuilds its table from its
journal and resyncs only its own references. Archived blocks that sessions of
both shards share stay until the last holder, on either shard, goes.
"""

import os
import signal

import pytest
import ray
import torch

from memkv.actors.router import SessionRouterActor
from memkv.actors.router_shards import RouterShards
from memkv.cluster.connect import MemkvCluster
from memkv.protocol.hashing import chain_hashes
from memkv.protocol.shards import shard_name, shard_of
from memkv.storage.layout import KVLayout, split_kv

from ..kvdata import with_shared_prefix
from .test_restarts import _wait_for

LAYOUT = KVLayout("shard-test", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
NAMESPACE = "sharded"
PREFIX = list(range(8))  # two shared blocks
ROUTER = "test-sharded-router"


def session_kv(seed):
    """The shared prefix's KV (one for all), then the session's own block."""
    return with_shared_prefix(LAYOUT, len(PREFIX), 4, seed)


@pytest.fixture
def sharded(cluster, tmp_path):
    namespace = cluster.config.cluster.namespace
    handles = [
        SessionRouterActor.options(
            name=shard_name(ROUTER, i), namespace=namespace, num_cpus=0
        ).remote(background_prefetch_interval_s=3600, journal_dir=str(tmp_path / f"shard-{i}"),
                 journal_fsync=False, shard=i, shards=2, router_name=ROUTER)
        for i in range(2)
    ]
    for h in handles:
        ray.get([h.register_archive.remote(n, a) for n, a in cluster.archives.items()])
        ray.get([h.register_device.remote(n, d) for n, d in cluster.devices.items()])
    yield MemkvCluster(cluster.config, RouterShards(handles), cluster.devices, cluster.archives,
                       owned=[], started_ray=False)
    for h in handles:
        ray.kill(h, no_restart=True)


def read(client, sid):
    return [block.clone() for _, block in client.read_session(sid)]


def test_a_killed_shard_resyncs_its_own_references_and_no_one_elses(cluster, sharded):
    sids = [f"agent-{i}" for i in range(8)]
    owners = {sid: shard_of(sid, 2) for sid in sids}
    assert set(owners.values()) == {0, 1}
    expected = {}
    for i, sid in enumerate(sids):
        # archive mode: every block is on disk when the append answers.
        sharded.create_session(sid, LAYOUT, namespace=NAMESPACE, ack="archive")
        keys, values = session_kv(1 + i)
        sharded.put_kv(sid, PREFIX + [500 + 4 * i + j for j in range(4)], keys, values)
        expected[sid] = split_kv(LAYOUT, keys, values)
    stats = sharded.stats()
    assert stats.shard_sessions == [list(owners.values()).count(s) for s in (0, 1)]
    # The suite's own router (a third owner on the same devices) keeps a session too;
    # another namespace (another deployment's table, which does not see these shards).
    cluster.create_session("beside-shards", LAYOUT, namespace="beside")
    bk, bv = session_kv(99)
    cluster.put_kv("beside-shards", PREFIX + [9000, 9001, 9002, 9003], bk, bv)

    shard_1 = sharded.routers.handles[1]
    pid = ray.get(shard_1.__ray_call__.remote(lambda _self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    _wait_for(shard_1)
    for sid in sids:  # both shards' sessions, bit for bit
        got = read(sharded, sid)
        assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, expected[sid],
                                                                       strict=True)), sid
    assert [b.clone() for _, b in cluster.read_session("beside-shards")][2].equal(
        split_kv(LAYOUT, bk, bv)[2])

    prefix = [bytes(k) for k in chain_hashes(PREFIX, LAYOUT, NAMESPACE)]
    archive = next(iter(cluster.archives.values()))
    cluster.delete_session("beside-shards")
    assert ray.get(archive.contains.remote(prefix)) == [True, True]
    for sid in [s for s in sids if owners[s] == 0]:
        sharded.delete_session(sid)
    # Shard 0 holds the prefix no more; shard 1's sessions do: it stays archived.
    assert ray.get(archive.contains.remote(prefix)) == [True, True]
    for sid in [s for s in sids if owners[s] == 1]:
        assert len(read(sharded, sid)) == 3
        sharded.delete_session(sid)
    assert ray.get(archive.contains.remote(prefix)) == [False, False]
