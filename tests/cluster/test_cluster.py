"""Integration: two device actors, one archive actor and the router on one local Ray."""

import itertools
import time

import pytest
import ray
import torch

from memkv.errors import BlockLostError, UnknownSessionError
from memkv.storage.layout import KVLayout, split_kv

from ..kvdata import random_kv

LAYOUT = KVLayout("cluster-test", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
_ids = itertools.count()


def kv(tokens, seed):
    return random_kv(LAYOUT, tokens, seed)


def new_session(
    cluster, tokens, *, seed, prefix=(), priority="normal", namespace="tenant", ack=None
):
    sid = f"s{next(_ids)}"
    cluster.create_session(sid, LAYOUT, namespace=namespace, priority=priority, ack=ack)
    token_ids = list(prefix) + [10_000 + seed * 1000 + i for i in range(tokens - len(prefix))]
    keys, values = kv(tokens, seed)
    cluster.put_kv(sid, token_ids, keys, values)
    return sid, token_ids, split_kv(LAYOUT, keys, values)


def read(cluster, sid):
    return [block.clone() for _, block in cluster.read_session(sid)]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def device_blocks(cluster, device_id):
    return ray.get(cluster.devices[device_id].stats.remote()).blocks


def test_sessions_are_placed_on_both_devices(cluster):
    placed = {cluster.device_of(new_session(cluster, 8, seed=i)[0]) for i in range(4)}
    assert placed == set(cluster.devices)


def test_a_shared_prefix_is_stored_once(cluster):
    prefix = list(range(8))  # two full blocks of a system prompt
    a, _, a_blocks = new_session(cluster, 12, seed=100, prefix=prefix)
    device = cluster.device_of(a)
    before = device_blocks(cluster, device)
    b, _, b_blocks = new_session(cluster, 12, seed=101, prefix=prefix)
    assert cluster.device_of(b) == device  # prefix affinity
    assert device_blocks(cluster, device) == before + 1  # only b's own block is new
    assert same(read(cluster, b)[:2], a_blocks[:2])


def test_a_turn_is_appended_by_reference_to_blocks_another_session_stored(cluster):
    """The vLLM connector's in-cluster save of a turn its engine's prefix cache held whole:
    no block sent, the session made of the blocks memkv holds, read back exactly."""
    a, tokens, blocks = new_session(cluster, 12, seed=102)
    b = f"s{next(_ids)}"
    cluster.create_session(b, LAYOUT, namespace="tenant")
    made = cluster.put_blocks(b, tokens, [], start_block=len(blocks))
    assert cluster.device_of(b) == cluster.device_of(a)  # where the blocks are
    assert same(read(cluster, b), blocks)
    # The same turn again (an engine that loaded the session from memkv): no change.
    again = cluster.put_blocks(b, tokens, [], start_block=len(blocks))
    assert again.replayed and again.turn == made.turn and not made.replayed


def test_suspend_archives_and_resume_is_lazy_and_byte_identical(cluster):
    sid, _, blocks = new_session(cluster, 64, seed=200)
    info = cluster.suspend(sid)
    assert info.state == "archived"
    device = cluster.devices[cluster.device_of(sid)]
    assert ray.get(device.locations.remote(info.chain)) == ["cold"] * 16
    handle = cluster.resume(sid)
    # The answer lists the chain before any block was promoted: lazy.
    assert [b.tier for b in handle.blocks] == ["cold"] * 16
    stream = cluster.read_session(sid)
    first_key, first = next(stream)
    assert first_key == info.chain[0] and torch.equal(first, blocks[0])
    # The first block is here while the tail is still in the archive: blocks are
    # promoted as the reader needs them (back-pressure + a bounded read-ahead).
    assert ray.get(device.locations.remote(info.chain[-4:])) == ["cold"] * 4
    assert same([first.clone()] + [b.clone() for _, b in stream], blocks)


def test_high_priority_stays_hot_while_background_is_demoted(cluster):
    prefix = [7, 7, 7, 7]  # shared first block: both land on the same device
    vip, _, _ = new_session(cluster, 16, seed=300, prefix=prefix, priority="high")
    # 64 blocks against a 32-block hot tier: pressure.
    bg, _, bg_blocks = new_session(cluster, 256, seed=301, prefix=prefix, priority="background")
    assert cluster.device_of(vip) == cluster.device_of(bg)
    device = cluster.devices[cluster.device_of(vip)]
    vip_chain = cluster.session(vip).chain
    bg_chain = cluster.session(bg).chain
    assert set(ray.get(device.locations.remote(vip_chain))) == {"hot"}
    bg_tiers = ray.get(device.locations.remote(bg_chain[1:]))
    assert bg_tiers.count("hot") < 32 and {"warm", "cold"} & set(bg_tiers)
    # (block 0 is the shared one, stored from vip's KV)
    assert same(read(cluster, bg)[1:], bg_blocks[1:])


def test_killed_device_serves_archived_sessions_again(fault_cluster):
    archived, _, blocks = new_session(fault_cluster, 24, seed=400)
    device_id = fault_cluster.device_of(archived)
    fault_cluster.suspend(archived)
    # An active session on the same device whose blocks never left memory.
    active = None
    for seed in range(401, 420):
        sid, active_tokens, active_blocks = new_session(fault_cluster, 4, seed=seed)
        if fault_cluster.device_of(sid) == device_id:
            active, active_seed = sid, seed
            break
    assert active is not None
    assert fault_cluster.match_prefix(LAYOUT, "tenant", active_tokens)[0] == 4
    # An active archive-mode session there too: acknowledged means on disk.
    durable = None
    for seed in range(420, 440):
        sid, _, durable_blocks = new_session(fault_cluster, 8, seed=seed, ack="archive")
        if fault_cluster.device_of(sid) == device_id:
            durable = sid
            break
    assert durable is not None
    before = ray.get(fault_cluster.devices[device_id].ping.remote()).incarnation
    ray.kill(fault_cluster.devices[device_id], no_restart=False)

    assert same(read(fault_cluster, archived), blocks)  # the router noticed and re-adopted it
    assert same(read(fault_cluster, durable), durable_blocks)
    after = ray.get(fault_cluster.devices[device_id].ping.remote()).incarnation
    assert after != before
    with pytest.raises(BlockLostError, match="restarted"):
        fault_cluster.session(active)
    # [2/6] item 4: a match offers only what a tier holds, never blocks that went
    # with the device (an engine sent to load them would find nothing and recompute).
    assert fault_cluster.match_prefix(LAYOUT, "tenant", active_tokens) == (0, [])
    fault_cluster.delete_session(active)  # a lost session can still be deleted
    with pytest.raises(UnknownSessionError):
        fault_cluster.session(active)
    # Stored again by another session: a match finds them, and they read by key.
    again, _, _ = new_session(fault_cluster, 4, seed=active_seed)
    matched, keys = fault_cluster.match_prefix(LAYOUT, "tenant", active_tokens)
    assert matched == 4 and same(read(fault_cluster, again), active_blocks)


def _incarnation(device):
    """The device process's incarnation, None while it is down."""
    try:
        return ray.get(device.ping.remote(), timeout=10).incarnation
    except ray.exceptions.RayError:  # died, restarting, or slow to answer
        return None


def test_a_session_missing_its_tail_serves_the_prefix_that_survived(fault_cluster):
    # Turn 1 reaches the archive (suspend); turn 2's blocks live only in device
    # memory (memory mode) when the device is killed.
    sid, tokens, _ = new_session(fault_cluster, 8, seed=450)
    fault_cluster.suspend(sid)
    fault_cluster.resume(sid)
    keys, values = kv(16, 451)
    first = kv(8, 450)
    keys = [torch.cat([a, b[:, 8:]], dim=1) for a, b in zip(first[0], keys, strict=True)]
    values = [torch.cat([a, b[:, 8:]], dim=1) for a, b in zip(first[1], values, strict=True)]
    all_tokens = tokens + [90_000 + i for i in range(8)]
    fault_cluster.put_kv(sid, all_tokens, keys, values)
    blocks = split_kv(LAYOUT, keys, values)
    assert fault_cluster.session(sid).tokens == 16
    # The premise: turn 2 has not reached the archive. The devices demote ahead of
    # their tiny tiers (and LRU-K picks blocks seen once first), so turn 2 may have
    # been written to cold by now: such copies are taken away, as if not yet written.
    device = fault_cluster.devices[fault_cluster.device_of(sid)]
    ray.get(device.flush_cold.remote())
    tail = list(fault_cluster.session(sid).chain[2:])
    ray.get([a.delete.remote(tail) for a in fault_cluster.archives.values()])
    before = ray.get(device.ping.remote()).incarnation
    ray.kill(device, no_restart=False)
    # ray.kill returns before the process is gone: read once the restarted one answers.
    deadline = time.monotonic() + 60
    while _incarnation(device) in (before, None):
        assert time.monotonic() < deadline, "the device did not come back"
        time.sleep(0.05)

    got = read(fault_cluster, sid)  # before: BlockLostError, all 16 tokens lost for 8
    assert same(got, blocks[:2])
    info = fault_cluster.session(sid)
    assert (info.tokens, info.lost_tokens) == (8, 8)
    assert "restarted" in info.partial_reason and "blocks 2..3 of 4" in info.partial_reason
    assert fault_cluster.match_prefix(LAYOUT, "tenant", all_tokens)[0] == 8
    # The next turn sends the lost blocks again (hashed from the same tokens).
    fault_cluster.put_kv(sid, all_tokens, keys, values)
    assert same(read(fault_cluster, sid), blocks)
    assert fault_cluster.session(sid).tokens == 16


def test_a_second_deployment_on_the_same_ray_is_a_world_of_its_own(cluster, fault_cluster):
    """The fault tests' deployment shares the Ray, the node and the device names,
    and nothing else: its devices write to its own archive (found in its own
    namespace, not the creating job's) and its sessions are unknown here."""

    def archived_blocks(c):
        return sum(ray.get(a.stats.remote()).blocks for a in c.archives.values())

    ours_before, theirs_before = archived_blocks(cluster), archived_blocks(fault_cluster)
    sid, _, blocks = new_session(fault_cluster, 12, seed=700, namespace="apart")
    fault_cluster.suspend(sid)
    assert archived_blocks(fault_cluster) == theirs_before + 3
    assert archived_blocks(cluster) == ours_before
    with pytest.raises(UnknownSessionError):
        cluster.session(sid)
    assert sorted(cluster.devices) == sorted(fault_cluster.devices)  # same names, apart
    assert same(read(fault_cluster, sid), blocks)
    fault_cluster.delete_session(sid)


def test_a_sessions_blocks_by_key_in_any_order(cluster):
    sid, _, blocks = new_session(cluster, 12, seed=470)
    chain = list(cluster.session(sid).chain)
    assert same(cluster.get_blocks(sid, chain[::-1]), blocks[::-1])


def test_delete_frees_blocks_everywhere(cluster):
    sid, _, _ = new_session(cluster, 16, seed=500, namespace="delete-me")
    device = cluster.device_of(sid)
    before = device_blocks(cluster, device)
    chain = cluster.session(sid).chain
    cluster.suspend(sid)
    archive = next(iter(cluster.archives.values()))
    assert ray.get(archive.contains.remote(chain)) == [True] * 4
    cluster.delete_session(sid)
    assert device_blocks(cluster, device) == before - 4
    assert ray.get(archive.contains.remote(chain)) == [False] * 4


def test_restarted_archive_rebuilds_its_index_and_serves_again(fault_cluster):
    sid, _, blocks = new_session(fault_cluster, 20, seed=600, namespace="archive-restart")
    fault_cluster.suspend(sid)
    (name, archive), *_ = fault_cluster.archives.items()
    before = ray.get(archive.ping.remote())
    ray.kill(archive, no_restart=False)
    # The device's reads wait out the restart; the archive reopened its segments.
    assert same(read(fault_cluster, sid), blocks)
    assert ray.get(archive.ping.remote()) != before
    assert ray.get(archive.stats.remote()).blocks >= 5


def test_prefix_match_and_reads_by_key_in_cluster_and_from_shared_memory(cluster):
    """What an engine inside the cluster uses (the vLLM connector's cluster transport)."""
    from memkv.errors import UnknownBlockError
    from memkv.storage.payloads import from_payload

    sid, tokens, blocks = new_session(cluster, 12, seed=300, namespace="by-key")
    matched, keys = cluster.match_prefix(LAYOUT, "by-key", tokens + [1, 2, 3])
    assert matched == 12 and len(keys) == 3
    assert cluster.match_prefix(LAYOUT, "other", tokens) == (0, [])
    device = cluster.devices[cluster.device_of(sid)]
    granted = ray.get(device.stats.remote()).leases.granted
    for same_node in (False, True):
        got = cluster.blocks_by_key(list(reversed(keys)), "by-key", same_node=same_node)
        assert [p.key for p in got] == list(reversed(keys))
        assert same([from_payload(p) for p in reversed(got)], blocks)
    # The same-node read went through one lease (hot blocks sit in shared memory).
    assert ray.get(device.stats.remote()).leases.granted == granted + 1
    # Blocks of another namespace are not found, whoever holds them.
    with pytest.raises(UnknownBlockError, match="no session holds block"):
        cluster.blocks_by_key(keys[:1], "other")


def test_attach_finds_the_running_cluster_and_creates_nothing(cluster):
    from memkv.cluster import attach
    from memkv.errors import ConfigError

    joined = attach("auto", namespace=cluster.config.cluster.namespace)
    assert set(joined.devices) == set(cluster.devices)
    assert joined.match_prefix(LAYOUT, "nobody", [1, 2, 3, 4]) == (0, [])
    with pytest.raises(ConfigError, match="no memkv router"):
        attach("auto", namespace="no-memkv-here")


def test_sessions_created_in_bulk_and_a_bad_spec_named(cluster):
    from memkv.errors import ConflictError, InvalidInputError
    from memkv.protocol.services import CreateSession, LayoutSpec

    def request(sid, **options):
        return CreateSession(session_id=sid, layout=LayoutSpec.of(LAYOUT), **options)

    ids = [f"bulk-{next(_ids)}" for _ in range(5)]
    views = cluster.create_sessions([request(sid, namespace="bulk") for sid in ids])
    assert [v.session_id for v in views] == ids
    assert all(cluster.session(sid).namespace == "bulk" for sid in ids)
    more = f"bulk-{next(_ids)}"
    with pytest.raises(ConflictError, match=r"spec 1"):
        cluster.create_sessions([request(more), request(ids[0])])
    assert cluster.session(more).session_id == more  # the one before it was created
    with pytest.raises(InvalidInputError, match=r"spec 0 \('has space'\)"):
        cluster.create_sessions([request("has space")])
    for sid in [*ids, more]:
        cluster.delete_session(sid)


def test_in_cluster_appends_are_staged_for_this_nodes_devices(cluster, monkeypatch):
    sid, _, blocks = new_session(cluster, 12, seed=300)
    staging = cluster._put_staging()
    assert staging is not None  # the test devices run on this node
    assert same(read(cluster, sid), blocks)
    # A writer on another node (as a device sees it): the device refuses the staged
    # blocks, the append goes by the object store and staging is dropped.
    from memkv.cluster import memkv_cluster

    monkeypatch.setattr(memkv_cluster, "staging_node", lambda: "a-node-elsewhere")
    other, _, other_blocks = new_session(cluster, 12, seed=301)
    assert cluster._staging is None
    assert same(read(cluster, other), other_blocks)
    monkeypatch.undo()
    cluster._staging_checked = False  # let later tests stage again


def test_in_cluster_reads_say_which_blocks_are_exact(cluster):
    """Item 13 of [1/5]: read_session dropped the per-block exactness flags."""
    sid, _, blocks = new_session(cluster, 8, seed=460)
    cluster.suspend(sid, offline=True)  # unshared blocks: the lossy Delta+RL codec
    cluster.resume(sid)
    read = list(cluster.read_session_payloads(sid))
    assert [p.key for p in read] == list(cluster.session(sid).chain)
    assert all(not p.exact and p.lossy == "delta_rl" for p in read), [
        (p.exact, p.lossy) for p in read
    ]
    exact, _, _ = new_session(cluster, 8, seed=461)
    assert all(p.exact and p.lossy == "" for p in cluster.read_session_payloads(exact))


def test_a_client_resyncs_by_itself_after_a_partial_loss(fault_cluster, fault_gateway):
    """[2/6] item 10: the client's view still names the lost tail; its next append (with
    every token's KV) goes again from the surviving prefix instead of answering 422."""
    from memkv.client import Client

    tokens = [70_000 + i for i in range(16)]
    keys, values = kv(16, 470)
    with Client(fault_gateway.url, block_port=False) as client:
        client.create_session("resync", LAYOUT, namespace="tenant")
        client.append_turn("resync", tokens[:8], [k[:, :8] for k in keys],
                           [v[:, :8] for v in values])
        client.suspend("resync")  # turn 1 reaches the archive
        client.resume("resync")
        client.append_turn("resync", tokens, keys, values)  # turn 2 lives only in memory
        device = fault_cluster.devices[fault_cluster.device_of("resync")]
        ray.get(device.flush_cold.remote())
        tail = list(fault_cluster.session("resync").chain[2:])
        ray.get([a.delete.remote(tail) for a in fault_cluster.archives.values()])
        before = ray.get(device.ping.remote()).incarnation
        ray.kill(device, no_restart=False)
        deadline = time.monotonic() + 60
        while _incarnation(device) in (before, None):
            assert time.monotonic() < deadline, "the device did not come back"
            time.sleep(0.05)
        read(fault_cluster, "resync")  # the router notices the restart
        assert fault_cluster.session("resync").lost_tokens == 8
        # The client's view still has 16 tokens: its append of 20 starts after them.
        k3, v3 = kv(20, 471)
        k3 = [torch.cat([a, b[:, 16:]], dim=1) for a, b in zip(keys, k3, strict=True)]
        v3 = [torch.cat([a, b[:, 16:]], dim=1) for a, b in zip(values, v3, strict=True)]
        result = client.append_turn("resync", tokens + [70_100 + i for i in range(4)], k3, v3)
        assert len(result.chain) == 5
    assert same(read(fault_cluster, "resync"), split_kv(LAYOUT, k3, v3))
